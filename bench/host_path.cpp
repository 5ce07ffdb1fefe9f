// SPDX-License-Identifier: Apache-2.0
// The C++ host path of one CUDA call, without Python: calls back to back on the GPU machine,
// per-call wall time (elapsed / calls, one synchronisation at the end) and host time (until
// the last call returned). Llama-3.1-8B attention shape (h_q 32, h_kv 8, d 128, bf16, causal),
// random inputs; `layers` input sets used in turn, so each call sees new tensor addresses as a
// model's layers do.
// Cases: run(plan) and run() (unplanned) at each length; a varlen batch of 16 sequences (its
// tensor maps no longer fit the kernel parameters: the metadata cache's path).
// Usage: sp_host_path [--lengths 128,4096] [--layers 32] [--calls 2000]
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sparseprefill/sparseprefill.h"

namespace sp = sparseprefill;

namespace {

#define CHECK_CUDA(x)                                                                  \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)
#define CHECK_OK(x)                                                         \
  do {                                                                      \
    const sp::Status s_ = (x);                                              \
    if (!s_.ok()) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.to_string().c_str()); \
      std::exit(1);                                                         \
    }                                                                       \
  } while (0)

constexpr int kHq = 32, kHkv = 8, kD = 128;

void* device_random(std::size_t elems, std::mt19937* gen) {
  std::vector<std::uint16_t> host(elems);
  std::normal_distribution<float> dist;
  for (auto& x : host) {
    const float f = dist(*gen);
    std::uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<std::uint16_t>(bits >> 16);  // bf16 by truncation: any finite values do
  }
  void* dev = nullptr;
  CHECK_CUDA(cudaMalloc(&dev, elems * 2));
  CHECK_CUDA(cudaMemcpy(dev, host.data(), elems * 2, cudaMemcpyHostToDevice));
  return dev;
}

struct Set {
  sp::AttentionProblem problem;
  sp::AttentionOutput out;
};

// One input set: batched [1, s, h, d], or varlen [total, h, d] with host cu_seqlens.
Set make_set(const std::vector<std::int64_t>& lengths, std::vector<std::int32_t>* cu, std::mt19937* gen) {
  const sp::Device dev{sp::DeviceKind::kCUDA, 0};
  std::int64_t total = 0;
  for (auto l : lengths) total += l;
  Set s;
  const bool varlen = lengths.size() > 1;
  auto view = [&](void* p, int heads, sp::DType t) {
    return varlen ? sp::TensorView::contiguous(p, t, {total, heads, kD}, dev)
                  : sp::TensorView::contiguous(p, t, {1, total, heads, kD}, dev);
  };
  s.problem.q = view(device_random(static_cast<std::size_t>(total) * kHq * kD, gen), kHq, sp::DType::kBF16);
  s.problem.k = view(device_random(static_cast<std::size_t>(total) * kHkv * kD, gen), kHkv, sp::DType::kBF16);
  s.problem.v = view(device_random(static_cast<std::size_t>(total) * kHkv * kD, gen), kHkv, sp::DType::kBF16);
  s.problem.causal = true;
  void* o = nullptr;
  void* lse = nullptr;
  CHECK_CUDA(cudaMalloc(&o, static_cast<std::size_t>(total) * kHq * kD * 2));
  CHECK_CUDA(cudaMalloc(&lse, static_cast<std::size_t>(total) * kHq * 4));
  s.out.o = view(o, kHq, sp::DType::kBF16);
  if (varlen) {
    cu->assign(1, 0);
    for (auto l : lengths) cu->push_back(cu->back() + static_cast<std::int32_t>(l));
    s.problem.cu_seqlens_q = sp::TensorView::contiguous(cu->data(), sp::DType::kInt32,
                                                         {static_cast<std::int64_t>(cu->size())});
    s.problem.cu_seqlens_k = s.problem.cu_seqlens_q;
    s.out.lse = sp::TensorView::contiguous(lse, sp::DType::kFP32, {kHq, total}, dev);
  } else {
    s.out.lse = sp::TensorView::contiguous(lse, sp::DType::kFP32, {1, kHq, total}, dev);
  }
  return s;
}

template <class Fn>
void time_calls(const char* what, std::int64_t s, int calls, const Fn& fn) {
  for (int i = 0; i < 64; ++i) fn(i);  // warm-up: caches, pools, the first call's setup
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn(i);
  const auto t1 = std::chrono::steady_clock::now();
  CHECK_CUDA(cudaDeviceSynchronize());
  const auto t2 = std::chrono::steady_clock::now();
  const double host = std::chrono::duration<double, std::micro>(t1 - t0).count() / calls;
  const double wall = std::chrono::duration<double, std::micro>(t2 - t0).count() / calls;
  std::printf("| %s | %lld | %.1f | %.1f |\n", what, static_cast<long long>(s), wall, host);
}

std::vector<std::int64_t> parse_list(const char* text) {
  std::vector<std::int64_t> v;
  for (const char* p = text; *p != '\0';) {
    v.push_back(std::strtoll(p, const_cast<char**>(&p), 10));
    if (*p == ',') ++p;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::int64_t> lengths = {128, 4096};
  int layers = 32, calls = 2000;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--lengths") lengths = parse_list(argv[i + 1]);
    if (a == "--layers") layers = std::atoi(argv[i + 1]);
    if (a == "--calls") calls = std::atoi(argv[i + 1]);
  }
  std::mt19937 gen(7);
  std::printf("| call | s | wall µs/call | host µs/call |\n|---|---:|---:|---:|\n");
  struct Case {
    std::string name;
    std::vector<std::int64_t> seqs;
  };
  std::vector<Case> cases;
  for (auto s : lengths) cases.push_back({"batch 1", {s}});
  cases.push_back({"varlen 16 x 128", std::vector<std::int64_t>(16, 128)});
  for (const Case& c : cases) {
    std::vector<std::vector<std::int32_t>> cus(static_cast<std::size_t>(layers));
    std::vector<Set> sets;
    for (int l = 0; l < layers; ++l) sets.push_back(make_set(c.seqs, &cus[static_cast<std::size_t>(l)], &gen));
    sp::Plan plan;
    CHECK_OK(sp::make_plan(sets[0].problem, sp::DenseParams{}, {}, &plan));
    const std::int64_t s = c.seqs.size() > 1 ? c.seqs[0] : c.seqs[0];
    time_calls(("run(plan), " + c.name).c_str(), s, calls, [&](int i) {
      const Set& x = sets[static_cast<std::size_t>(i % layers)];
      CHECK_OK(sp::run(plan, x.problem, x.out));
    });
    time_calls(("run(), " + c.name).c_str(), s, calls, [&](int i) {
      const Set& x = sets[static_cast<std::size_t>(i % layers)];
      CHECK_OK(sp::run(x.problem, sp::DenseParams{}, x.out));
    });
    time_calls(("make_plan + run(plan), " + c.name).c_str(), s, calls / 4, [&](int i) {
      const Set& x = sets[static_cast<std::size_t>(i % layers)];
      sp::Plan p;
      CHECK_OK(sp::make_plan(x.problem, sp::DenseParams{}, {}, &p));
      CHECK_OK(sp::run(p, x.problem, x.out));
    });
  }
  std::printf("\n%s", sp::build_info().c_str());
  return 0;
}
