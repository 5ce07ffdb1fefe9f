// SPDX-License-Identifier: Apache-2.0
// Developer timing of the forward kernel instances (not a benchmark against peers: bench/ is):
// each compiled instance on the Llama-3.1-8B and SmolLM2 shapes: dense; device-resident block
// masks at 5/20/50% density (the kernel alone, no host-side mask handling); exact_gate with
// T = -inf (gate overhead, everything kept) and T = +inf (only the partial blocks kept: the
// Q·Kᵀ-only floor of skipped blocks), block_k 64 and 128 on the portable kernel and 128 on the
// Hopper kernel (which runs when the device is compute capability 9.0); paged K/V on both
// kernels (pages of 16 and 64 keys in a shuffled order, dense and the 20% mask) against the
// same contiguous calls. The measurements behind docs/cuda.md. `sp_cuda_tiles paged [PAGE...]`:
// Llama 32K bf16 dense only, contiguous against paged K/V at each page size (default 8 to 256),
// pages shuffled and in order, on the kernel that runs there (Hopper on 9.0: TMA boxes and
// gathered rows at every size boxes can load, gathered rows at the others).
// `sp_cuda_tiles calib`:
// instead, the calibration statistics of one layer of a 128K-token sample through the public
// API (calibration.h), each step timed on its own.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "cuda/kernel/ptx.cuh"
#include "cuda/plan.h"
#include "cuda/registry.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill::cuda {
namespace {

#define SP_DEV_CHECK(expr)                                                                   \
  do {                                                                                       \
    const cudaError_t e_ = (expr);                                                           \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

// Values in (-2, 2) from a hash of the index, never zero, as 16-bit bf16 or fp16 bits.
__global__ void fill_kernel(std::uint16_t* x, std::int64_t n, std::uint64_t seed, bool bf16) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + static_cast<std::uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = (static_cast<float>(z >> 40) + 0.5f) / 16777216.0f * 4.0f - 2.0f;
    x[i] = bf16 ? ptx::from_float<true>(u) : ptx::from_float<false>(u);
  }
}

struct Shape {
  const char* name;
  int h_q, h_kv, d;
  std::int64_t s;
};

// One instance as the timing loop calls it.
struct Instance {
  std::string name;
  std::function<int(const FwdParams&)> launch;
  bool hopper;
};

// The HostUpload of the Hopper instances' tensor maps: the same bytes as the previous call are
// not copied again (as the backend's metadata cache does), so that a timed launch is the kernel.
struct CachedUpload {
  std::vector<unsigned char> host;
  void* dev = nullptr;
  static int call(void* context, const void* bytes, std::size_t n, const void** out) {
    auto* self = static_cast<CachedUpload*>(context);
    if (self->host.size() != n || std::memcmp(self->host.data(), bytes, n) != 0) {
      if (self->dev != nullptr) SP_DEV_CHECK(cudaFree(self->dev));
      SP_DEV_CHECK(cudaMalloc(&self->dev, n));  // 256-byte aligned
      SP_DEV_CHECK(cudaMemcpy(self->dev, bytes, n, cudaMemcpyHostToDevice));
      self->host.assign(static_cast<const unsigned char*>(bytes), static_cast<const unsigned char*>(bytes) + n);
    }
    *out = self->dev;
    return 0;
  }
};

double median_ms(const Instance& v, const FwdParams& p, int reps) {
  cudaEvent_t a, b;
  SP_DEV_CHECK(cudaEventCreate(&a));
  SP_DEV_CHECK(cudaEventCreate(&b));
  SP_DEV_CHECK(static_cast<cudaError_t>(v.launch(p)));  // warm-up
  std::vector<float> ms;
  for (int i = 0; i < reps; ++i) {
    SP_DEV_CHECK(cudaEventRecord(a));
    SP_DEV_CHECK(static_cast<cudaError_t>(v.launch(p)));
    SP_DEV_CHECK(cudaEventRecord(b));
    SP_DEV_CHECK(cudaEventSynchronize(b));
    float t = 0.f;
    SP_DEV_CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  SP_DEV_CHECK(cudaEventDestroy(a));
  SP_DEV_CHECK(cudaEventDestroy(b));
  return ms[ms.size() / 2];
}

// What run_shape times: everything (the default), or with `paged_only` dense alone, contiguous
// against paged K/V at `page_sizes`, each page size with shuffled and with in-order pages.
struct Options {
  std::vector<int> page_sizes{16, 64};
  bool paged_only = false;
  std::vector<DType> dtypes{DType::kBF16, DType::kFP16};
};

void run_shape(const Shape& sh, const Options& opt) {
  const std::int64_t nq = sh.s * sh.h_q * sh.d, nkv = sh.s * sh.h_kv * sh.d;
  std::uint16_t *q, *k, *v, *o;
  float* lse;
  SP_DEV_CHECK(cudaMalloc(&q, nq * 2));
  SP_DEV_CHECK(cudaMalloc(&k, nkv * 2));
  SP_DEV_CHECK(cudaMalloc(&v, nkv * 2));
  SP_DEV_CHECK(cudaMalloc(&o, nq * 2));
  SP_DEV_CHECK(cudaMalloc(&lse, sh.s * sh.h_q * 4));
  SeqInfo seq{sh.s, sh.s, 0, 0, 0, 0, 0};
  SeqInfo* d_seq;
  SP_DEV_CHECK(cudaMalloc(&d_seq, sizeof(SeqInfo)));
  SP_DEV_CHECK(cudaMemcpy(d_seq, &seq, sizeof(SeqInfo), cudaMemcpyHostToDevice));
  float* thr;
  SP_DEV_CHECK(cudaMalloc(&thr, sizeof(float) * 2));
  const float thr_host[2] = {-INFINITY, INFINITY};
  SP_DEV_CHECK(cudaMemcpy(thr, thr_host, sizeof(thr_host), cudaMemcpyHostToDevice));
  int cc_major = 0, cc_minor = 0;
  SP_DEV_CHECK(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, 0));
  SP_DEV_CHECK(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, 0));
  const bool hopper = cc_major == 9 && cc_minor == 0;  // sm_90a code runs there alone
  CachedUpload maps;

  // Causal pairs: s(s+1)/2 per head; 4·d FLOP per pair (Q·Kᵀ and P·V).
  const double flop = 4.0 * sh.d * static_cast<double>(sh.s) * static_cast<double>(sh.s + 1) / 2.0 * sh.h_q;
  for (DType dtype : opt.dtypes) {
    const bool bf16 = dtype == DType::kBF16;
    fill_kernel<<<1024, 256>>>(q, nq, 1, bf16);
    fill_kernel<<<1024, 256>>>(k, nkv, 2, bf16);
    fill_kernel<<<1024, 256>>>(v, nkv, 3, bf16);
    SP_DEV_CHECK(cudaDeviceSynchronize());
    FwdParams p{};
    p.q = q;
    p.k = k;
    p.v = v;
    p.o = o;
    p.lse = lse;
    p.q_row_stride = p.o_row_stride = static_cast<std::int64_t>(sh.h_q) * sh.d;
    p.k_row_stride = p.v_row_stride = static_cast<std::int64_t>(sh.h_kv) * sh.d;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = sh.d;
    p.lse_head_stride = sh.s;
    p.lse_row_stride = 1;
    p.seqs = d_seq;
    p.batch = 1;
    p.h_q = sh.h_q;
    p.h_kv = sh.h_kv;
    p.group = sh.h_q / sh.h_kv;
    p.num_q_blocks = static_cast<int>((sh.s + kBlockQ - 1) / kBlockQ);
    p.q_pack = 1;
    p.grid = p.num_q_blocks * p.h_q;  // portable_grid and hopper_grid of one unpacked sequence
    p.causal = true;
    p.scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
    p.scale_log2 = p.scale * 1.4426950408889634f;

    std::vector<Instance> instances;
    // The portable kernel: the instance its launch would choose for each row.
    const FwdVariant* var = find_fwd(dtype, sh.d, sh.d, false, true);
    if (var != nullptr) {
      instances.push_back({var->name,
                           [dtype, d = sh.d](const FwdParams& fp) {
                             return find_fwd(dtype, d, d, gated_mode(fp.mode), plain_call(fp))->launch(fp, nullptr);
                           },
                           false});
    }
    const Fwd90Variant* var90 = find_fwd90(dtype, sh.d, sh.d, false);
    if (var90 != nullptr && hopper) {
      instances.push_back({var90->name,
                           [var90, &seq, &maps](const FwdParams& fp) {
                             const HostUpload upload{&maps, &CachedUpload::call};
                             return var90->launch(fp, &seq, nullptr, upload, nullptr);
                           },
                           true});
    }
    // The paged Hopper instance (time_paged), launched with the host copy of its block table.
    const Fwd90Variant* var90_paged = hopper ? find_fwd90(dtype, sh.d, sh.d, true) : nullptr;
    for (const Instance& inst : instances) {
      if (opt.paged_only && hopper && !inst.hopper) continue;  // what runs on 9.0: the Hopper kernel
      const char* tag = inst.name.c_str();
      p.mode = PolicyMode::kDense;
      p.block_k = dense_block_k(sh.d);
      const double dense = median_ms(inst, p, 7);
      std::printf("%-8s %s d=%3d s=%6lld dense %8.3f ms %6.1f TFLOP/s\n", sh.name, tag, sh.d,
                  static_cast<long long>(sh.s), dense, flop / dense * 1e-9);
      // The same call on K/V read as pages of `page` keys through a shuffled block table (the
      // buffers are reinterpreted as [s / page, page, h_kv, d]; timing does not depend on
      // values): the portable instance, or for the Hopper one its paged instance.
      auto time_paged = [&](const FwdParams& base, const char* what, double contiguous) {
        if (inst.hopper && var90_paged == nullptr) return;
        for (int page : opt.page_sizes) {
          // paged_only: pages shuffled and in order as the plan loads them, and on the Hopper
          // kernel the other way too where both work (mode 2: boxes for gathered sizes that
          // boxes can load, gathered rows for boxed ones).
          for (int mode : {0, 1, 2}) {
            const bool shuffled = mode != 1;
            const bool gathered = hopper_gathers_pages(page) != (mode == 2);
            if (mode > 0 && !opt.paged_only) continue;
            if (mode == 2 && (!inst.hopper || !hopper_can_box_pages(page))) continue;
            const std::int64_t pages = (sh.s + page - 1) / page;
            std::vector<std::int32_t> table(static_cast<std::size_t>(pages));
            for (std::int64_t i = 0; i < pages; ++i) table[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(i);
            std::uint64_t rng = 777;
            for (std::int64_t i = pages - 1; i > 0 && shuffled; --i) {
              rng = rng * 6364136223846793005ull + 1442695040888963407ull;
              std::swap(table[static_cast<std::size_t>(i)],
                        table[static_cast<std::size_t>((rng >> 33) % static_cast<std::uint64_t>(i + 1))]);
            }
            std::int32_t* table_d;
            SP_DEV_CHECK(cudaMalloc(&table_d, table.size() * sizeof(std::int32_t)));
            SP_DEV_CHECK(cudaMemcpy(table_d, table.data(), table.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice));
            FwdParams pp = base;
            pp.paged.block_table = table_d;
            pp.paged.table_stride = pages;
            pp.paged.page_size = page;
            pp.paged.k_page_stride = pp.paged.v_page_stride = static_cast<std::int64_t>(page) * p.k_row_stride;
            pp.paged.gather_rows = gathered;
            const Instance paged_inst =
                inst.hopper ? Instance{var90_paged->name,
                                       [&](const FwdParams& fp) {
                                         const HostUpload upload{&maps, &CachedUpload::call};
                                         return var90_paged->launch(fp, &seq, table.data(), upload, nullptr);
                                       },
                                       true}
                            : inst;
            const double t = median_ms(paged_inst, pp, 7);
            std::printf("%-8s %s d=%3d s=%6lld %s paged (page %3d, %s%s): %8.3f ms (%.3f of contiguous)\n", sh.name,
                        paged_inst.name.c_str(), sh.d, static_cast<long long>(sh.s), what, page,
                        !inst.hopper ? "portable" : gathered ? "gathered" : "TMA boxes", shuffled ? "" : ", in order", t,
                        t / contiguous);
            SP_DEV_CHECK(cudaFree(table_d));
          }
        }
      };
      time_paged(p, "dense", dense);
      if (opt.paged_only) continue;
      // Block masks built here (per query head: the diagonal blocks, block 0 and a random
      // fraction of the rest, block_k 128), uploaded once: the kernel's own time, without
      // host-side mask handling.
      for (double density : {0.05, 0.2, 0.5}) {
        const int nqb = p.num_q_blocks, nkb = static_cast<int>((sh.s + 127) / 128);
        std::vector<std::int32_t> full_count, partial_count;
        std::vector<std::int64_t> full_start, partial_start;
        std::vector<std::int32_t> full_index, partial_index;
        std::uint64_t rng = 12345;
        std::int64_t kept = 0, visible = 0;
        for (int h = 0; h < sh.h_q; ++h) {
          for (int qb = 0; qb < nqb; ++qb) {
            full_start.push_back(static_cast<std::int64_t>(full_index.size()));
            partial_start.push_back(static_cast<std::int64_t>(partial_index.size()));
            int fc = 0;
            for (int kb = 0; kb < qb; ++kb) {
              rng = rng * 6364136223846793005ull + 1442695040888963407ull;
              if (kb == 0 || static_cast<double>(rng >> 11) / 9007199254740992.0 < density) {
                full_index.push_back(kb);
                ++fc;
              }
            }
            partial_index.push_back(qb);  // the diagonal block (s_q = s_k, block 128)
            full_count.push_back(fc);
            partial_count.push_back(1);
            kept += fc + 1;
            visible += qb + 1;
          }
        }
        auto upload = [](const auto& host, auto** dev) {
          using T = std::remove_reference_t<decltype(host[0])>;
          SP_DEV_CHECK(cudaMalloc(dev, host.size() * sizeof(T) + 16));
          SP_DEV_CHECK(cudaMemcpy(*dev, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
        };
        std::int32_t *fc_d, *pc_d, *fi_d, *pi_d;
        std::int64_t *fs_d, *ps_d;
        upload(full_count, &fc_d);
        upload(partial_count, &pc_d);
        upload(full_index, &fi_d);
        upload(partial_index, &pi_d);
        upload(full_start, &fs_d);
        upload(partial_start, &ps_d);
        FwdParams m = p;
        m.mode = PolicyMode::kBlockMask;
        m.block_k = 128;
        m.full_count = fc_d;
        m.partial_count = pc_d;
        m.full_index = fi_d;
        m.partial_index = pi_d;
        m.full_start = fs_d;
        m.partial_start = ps_d;
        m.mask_heads = sh.h_q;
        m.mask_per_kv_head = false;
        m.mask_q_blocks = nqb;
        m.mask_k_blocks = nkb;
        const double t = median_ms(inst, m, 7);
        const double rho = static_cast<double>(kept) / static_cast<double>(visible);
        // Targets: time <= (rho + 0.05) · dense on the portable kernel (issue 3), (rho + 0.03) ·
        // dense on the Hopper one (issue 4).
        const double slack = inst.hopper ? 0.03 : 0.05;
        std::printf("%-8s %s d=%3d s=%6lld block mask density %.3f: %8.3f ms (%.3f of dense; target rho + %.2f = %.3f)\n",
                    sh.name, tag, sh.d, static_cast<long long>(sh.s), rho, t, t / dense, slack, rho + slack);
        if (density == 0.2) time_paged(m, "block mask 0.2", t);
        for (void* ptr : {static_cast<void*>(fc_d), static_cast<void*>(pc_d), static_cast<void*>(fi_d),
                          static_cast<void*>(pi_d), static_cast<void*>(fs_d), static_cast<void*>(ps_d)}) {
          SP_DEV_CHECK(cudaFree(ptr));
        }
      }
      for (int block_k : {64, 128}) {
        if (inst.hopper && block_k != 128) continue;  // the Hopper kernel's blocks are its 128-key tiles
        FwdParams g = p;
        g.block_k = block_k;
        g.mode = PolicyMode::kExactGate;
        g.thresholds = thr;
        g.thr_head_stride = 0;
        g.thr_pos_stride = 0;
        g.thr_positions = 1;
        const double keep_all = median_ms(inst, g, 7);
        g.thresholds = thr + 1;
        const double skip_all = median_ms(inst, g, 7);
        std::printf("%-8s %s d=%3d s=%6lld block_k=%3d  gate keep-all %8.3f ms (%.3f of dense) | skip-all %8.3f ms (%.3f of dense)\n",
                    sh.name, tag, sh.d, static_cast<long long>(sh.s), block_k, keep_all, keep_all / dense, skip_all,
                    skip_all / dense);
      }
    }
  }
  SP_DEV_CHECK(cudaFree(q));
  SP_DEV_CHECK(cudaFree(k));
  SP_DEV_CHECK(cudaFree(v));
  SP_DEV_CHECK(cudaFree(o));
  SP_DEV_CHECK(cudaFree(lse));
  SP_DEV_CHECK(cudaFree(d_seq));
  SP_DEV_CHECK(cudaFree(thr));
  if (maps.dev != nullptr) SP_DEV_CHECK(cudaFree(maps.dev));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define SP_DEV_OK(expr)                                                              \
  do {                                                                               \
    const Status st_ = (expr);                                                       \
    if (!st_.ok()) {                                                                 \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, st_.to_string().c_str()); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

// One layer of a calibration sample of sh.s tokens (bf16, causal, batch 1): the calib kernel
// alone (block 128 x 128 and 64 x 64), then the public calls a calibration run makes per layer:
// compute_block_statistics (kernel, copy back, per-sequence records), compute_select_statistics
// (means + selector, copy back) and the three calibrators' add_statistics plus their factors.
void time_calibration(const Shape& sh) {
  const std::int64_t nq = sh.s * sh.h_q * sh.d, nk = sh.s * sh.h_kv * sh.d;
  std::uint16_t *q, *k;
  SP_DEV_CHECK(cudaMalloc(&q, nq * 2));
  SP_DEV_CHECK(cudaMalloc(&k, nk * 2));
  fill_kernel<<<1024, 256>>>(q, nq, 1, true);
  fill_kernel<<<1024, 256>>>(k, nk, 2, true);
  SP_DEV_CHECK(cudaDeviceSynchronize());
  const Device gpu{DeviceKind::kCUDA, 0};
  AttentionProblem p;
  p.q = TensorView::contiguous(q, DType::kBF16, {1, sh.s, sh.h_q, sh.d}, gpu);
  p.k = TensorView::contiguous(k, DType::kBF16, {1, sh.s, sh.h_kv, sh.d}, gpu);
  p.v = p.k;
  ProblemShape shape;
  SP_DEV_OK(validate_problem(p, nullptr, &shape));

  for (int block : {128, 64}) {
    CalibParams cp = make_calib_params(p, shape, block, block);
    const std::size_t cells = static_cast<std::size_t>(sh.h_q) * cp.num_q_blocks * cp.num_k_blocks;
    SeqInfo seq{sh.s, sh.s, 0, 0, 0, 0, 0};
    SeqInfo* d_seq;
    SP_DEV_CHECK(cudaMalloc(&d_seq, sizeof(SeqInfo)));
    SP_DEV_CHECK(cudaMemcpy(d_seq, &seq, sizeof(SeqInfo), cudaMemcpyHostToDevice));
    cp.seqs = d_seq;
    SP_DEV_CHECK(cudaMalloc(&cp.block_max, cells * sizeof(float)));
    SP_DEV_CHECK(cudaMalloc(&cp.skip_g, cells * sizeof(float)));
    const CalibVariant* var = find_calib(DType::kBF16, sh.d);
    cudaEvent_t a, b;
    SP_DEV_CHECK(cudaEventCreate(&a));
    SP_DEV_CHECK(cudaEventCreate(&b));
    SP_DEV_CHECK(static_cast<cudaError_t>(var->launch(cp, nullptr)));  // warm-up
    std::vector<float> ms;
    for (int i = 0; i < 3; ++i) {
      SP_DEV_CHECK(cudaEventRecord(a));
      SP_DEV_CHECK(static_cast<cudaError_t>(var->launch(cp, nullptr)));
      SP_DEV_CHECK(cudaEventRecord(b));
      SP_DEV_CHECK(cudaEventSynchronize(b));
      float t = 0.f;
      SP_DEV_CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    // Q·Kᵀ over the causal pairs of every visible block: 2·d FLOP per pair (masked pairs of
    // partial blocks are computed too and not counted).
    const double flop = 2.0 * sh.d * static_cast<double>(sh.s) * static_cast<double>(sh.s + 1) / 2.0 * sh.h_q;
    std::printf("calib %-8s bf16 d=%-3d s=%-6lld block %dx%d: calib kernel %.1f ms (%.0f TFLOP/s over causal pairs)\n",
                sh.name, sh.d, static_cast<long long>(sh.s), block, block, ms[1], flop / (ms[1] * 1e-3) / 1e12);
    SP_DEV_CHECK(cudaEventDestroy(a));
    SP_DEV_CHECK(cudaEventDestroy(b));
    SP_DEV_CHECK(cudaFree(cp.block_max));
    SP_DEV_CHECK(cudaFree(cp.skip_g));
    SP_DEV_CHECK(cudaFree(d_seq));
  }

  std::vector<BlockStatistics> blocks;
  std::vector<SelectStatistics> select;
  EstimateSelectParams base;  // block 128, the defaults calibrate.py uses
  SP_DEV_OK(compute_block_statistics(p, 128, 128, true, true, &blocks));  // warm-up (pools, metadata)
  auto t0 = std::chrono::steady_clock::now();
  SP_DEV_OK(compute_block_statistics(p, 128, 128, true, true, &blocks));
  const double t_blocks = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  SP_DEV_OK(compute_select_statistics(p, base, &select));
  const double t_select = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  ExactGateCalibrator gate(1, sh.h_q, {2, 4, 8, 16}, 128, 128);
  SoftmaxSkipCalibrator skip(1, 128, 128);
  EstimateSelectCalibrator sel(1, base);
  SP_DEV_OK(gate.add_statistics(0, blocks));
  SP_DEV_OK(skip.add_statistics(0, blocks));
  SP_DEV_OK(sel.add_statistics(0, select));
  const ThresholdTable table = gate.finish();
  double x = 0;
  for (double target : {0.2, 0.4, 0.6, 0.8}) SP_DEV_OK(skip.factor_for(target, 0, &x));
  for (double target : {0.3, 0.4, 0.5, 0.7}) SP_DEV_OK(sel.alpha_for(target, 0, &x));
  const double t_reduce = seconds_since(t0);
  std::printf("calib %-8s bf16 d=%-3d s=%-6lld block 128: block statistics %.2f s, select statistics %.2f s, "
              "reductions + factors %.2f s (host), per layer %.2f s; %zu table values\n",
              sh.name, sh.d, static_cast<long long>(sh.s), t_blocks, t_select, t_reduce, t_blocks + t_select + t_reduce,
              table.values.size());
  SP_DEV_CHECK(cudaFree(q));
  SP_DEV_CHECK(cudaFree(k));
}

}  // namespace
}  // namespace sparseprefill::cuda

int main(int argc, char** argv) {
  using sparseprefill::cuda::Shape;
  if (argc > 1 && std::strcmp(argv[1], "calib") == 0) {
    for (const Shape& sh : {Shape{"llama", 32, 8, 128, 131072}, Shape{"smollm2", 9, 3, 64, 131072}}) {
      sparseprefill::cuda::time_calibration(sh);
    }
    return 0;
  }
  if (argc > 1 && std::strcmp(argv[1], "paged") == 0) {
    sparseprefill::cuda::Options opt;
    opt.paged_only = true;
    opt.dtypes = {sparseprefill::DType::kBF16};
    opt.page_sizes.clear();
    for (int i = 2; i < argc; ++i) opt.page_sizes.push_back(std::atoi(argv[i]));
    if (opt.page_sizes.empty()) opt.page_sizes = {8, 16, 32, 64, 128, 256};
    sparseprefill::cuda::run_shape(Shape{"llama", 32, 8, 128, 32768}, opt);
    return 0;
  }
  for (const Shape& sh : {Shape{"llama", 32, 8, 128, 16384}, Shape{"llama", 32, 8, 128, 32768},
                          Shape{"smollm2", 9, 3, 64, 8192}}) {
    sparseprefill::cuda::run_shape(sh, sparseprefill::cuda::Options{});
  }
  return 0;
}
