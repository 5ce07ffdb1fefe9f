// SPDX-License-Identifier: Apache-2.0
// GPU test harness: mirrors a host TestProblem on the device (same shapes and strides; index
// tensors stay on the host), poisons the device outputs, runs the CUDA backend and reads the
// outputs back into the oracle's layout.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/inputs.h"
#include "common/poison.h"
#include "common/tolerance.h"
#include "cuda/cuda_backend.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {

#define SP_CUDA_CHECK(expr)                                                              \
  do {                                                                                   \
    const cudaError_t sp_err_ = (expr);                                                  \
    ASSERT_EQ(sp_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(sp_err_);     \
  } while (0)

// Whether the GPU runs the Hopper kernels here (sm_90a code: compute capability 9.0).
inline bool hopper_device() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

// While alive, sends this thread's calls to the portable kernels (the selector included).
class PortableOnly {
 public:
  explicit PortableOnly(bool on) { cuda::set_portable_only_for_testing(on); }
  ~PortableOnly() { cuda::set_portable_only_for_testing(false); }
  PortableOnly(const PortableOnly&) = delete;
  PortableOnly& operator=(const PortableOnly&) = delete;
};

// The estimate_select selector family a call must choose (choose_select_path).
inline std::string expected_selector_prefix(bool portable) {
  return portable || !hopper_device() ? "select_sm80_" : "select_sm90_";
}

// Device memory owned by a test.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(ptr); }
};

// A device copy of contiguous host tensor `t`, viewed with t's shape (and contiguous strides).
inline TensorView to_device(const HostTensor& t, DeviceBuffer* buf) {
  buf->bytes = t.nbytes();
  EXPECT_EQ(cudaMalloc(&buf->ptr, buf->bytes > 0 ? buf->bytes : 16), cudaSuccess);
  if (buf->bytes > 0) EXPECT_EQ(cudaMemcpy(buf->ptr, t.data(), buf->bytes, cudaMemcpyHostToDevice), cudaSuccess);
  TensorView v = t.view();
  v.data = buf->ptr;
  v.device = Device{DeviceKind::kCUDA, 0};
  return v;
}

inline void to_host(const DeviceBuffer& buf, HostTensor* t) {
  if (buf.bytes > 0) EXPECT_EQ(cudaMemcpy(t->data(), buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

// A device copy of the contiguous host view `t` (same shape and strides), and the copy back.
inline TensorView view_to_device(const TensorView& t, DeviceBuffer* buf) {
  EXPECT_TRUE(t.is_contiguous()) << describe(t);
  buf->bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
  EXPECT_EQ(cudaMalloc(&buf->ptr, buf->bytes > 0 ? buf->bytes : 16), cudaSuccess);
  if (buf->bytes > 0) EXPECT_EQ(cudaMemcpy(buf->ptr, t.data, buf->bytes, cudaMemcpyHostToDevice), cudaSuccess);
  TensorView v = t;
  v.data = buf->ptr;
  v.device = Device{DeviceKind::kCUDA, 0};
  return v;
}
inline void view_to_host(const DeviceBuffer& buf, const TensorView& t) {
  if (buf.bytes > 0) EXPECT_EQ(cudaMemcpy(t.data, buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

// A policy whose tensors live on the device: exact_gate thresholds, and estimate_select's cache
// of block means (its index tensors, prompt_len and block_means_valid, stay on the host).
// means_to_host copies the cache, which a call writes, back into the host policy's tensors.
struct DevicePolicy {
  Policy policy;
  DeviceBuffer thresholds;
  HostTensor host_thresholds;
  DeviceBuffer k_means, v_means;
  TensorView host_k_means, host_v_means;

  void means_to_host() const {
    if (host_k_means.defined()) view_to_host(k_means, host_k_means);
    if (host_v_means.defined()) view_to_host(v_means, host_v_means);
  }
};
inline std::unique_ptr<DevicePolicy> to_device(const Policy& host) {
  auto d = std::make_unique<DevicePolicy>();
  d->policy = host;
  if (auto* es = std::get_if<EstimateSelectParams>(&d->policy)) {
    if (es->k_block_means.defined()) {
      d->host_k_means = es->k_block_means;
      es->k_block_means = view_to_device(es->k_block_means, &d->k_means);
    }
    if (es->v_block_means.defined()) {
      d->host_v_means = es->v_block_means;
      es->v_block_means = view_to_device(es->v_block_means, &d->v_means);
    }
  }
  if (auto* g = std::get_if<ExactGateParams>(&d->policy)) {
    // Copy the (possibly strided) host table into a contiguous one, then to the device.
    const TensorView& t = std::get<ExactGateParams>(host).thresholds;
    d->host_thresholds = HostTensor(DType::kFP32, {t.shape[0], t.shape[1]});
    for (std::int64_t h = 0; h < t.shape[0]; ++h) {
      for (std::int64_t p = 0; p < t.shape[1]; ++p) {
        d->host_thresholds.as<float>()[h * t.shape[1] + p] = static_cast<const float*>(t.data)[h * t.stride[0] + p * t.stride[1]];
      }
    }
    g->thresholds = to_device(d->host_thresholds, &d->thresholds);
  }
  return d;
}

struct GpuRun {
  Status status;
  ref::Result out;  // the GPU output in the oracle's layout
  Decisions decisions;
  RunStats stats;
};

// Runs `policy` on the device copy of tp (outputs poisoned with NaN first) and reads O and LSE
// back into tp's host output tensors and r.out (and a cache of block means into the policy's
// host tensors).
inline GpuRun run_gpu(TestProblem* tp, const Policy& policy, void* stream = nullptr,
                      const ExecutionOverrides& overrides = {}) {
  GpuRun r;
  const AttentionProblem host = tp->problem();
  DeviceBuffer q, k, v, o, lse;
  AttentionProblem dev = host;
  dev.q = to_device(tp->q, &q);
  dev.k = to_device(tp->k, &k);
  dev.v = to_device(tp->v, &v);
  // FP8 descales live on q's device too.
  DeviceBuffer descale[3];
  TensorView* views[3] = {&dev.q_descale, &dev.k_descale, &dev.v_descale};
  HostTensor* tensors[3] = {&tp->q_descale, &tp->k_descale, &tp->v_descale};
  for (int i = 0; i < 3; ++i) {
    if (views[i]->defined()) *views[i] = to_device(*tensors[i], &descale[i]);
  }
  poison(&tp->o);
  poison(&tp->lse);
  AttentionOutput out;
  out.o = to_device(tp->o, &o);
  out.lse = to_device(tp->lse, &lse);
  const auto dev_policy = to_device(policy);
  RunOptions opt;
  opt.backend = Backend::kCUDA;
  opt.cuda_stream = stream;
  opt.overrides = overrides;
  // (void): nvcc reads the assignment's Status& result as a discarded [[nodiscard]] value.
  static_cast<void>(r.status = run(dev, dev_policy->policy, out, opt, &r.stats, &r.decisions));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (r.status.ok()) {
    dev_policy->means_to_host();
    to_host(o, &tp->o);
    to_host(lse, &tp->lse);
    ProblemShape shape;
    EXPECT_TRUE(validate_problem(host, nullptr, &shape).ok());
    r.out = read_output(tp->output(), shape);
  }
  return r;
}

}  // namespace sparseprefill::test
