// SPDX-License-Identifier: Apache-2.0
// GPU test harness: mirrors a host TestProblem on the device (same shapes and strides; index
// tensors stay on the host), poisons the device outputs, runs the CUDA backend and reads the
// outputs back into the oracle's layout.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "common/inputs.h"
#include "common/poison.h"
#include "common/tolerance.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {

#define SP_CUDA_CHECK(expr)                                                              \
  do {                                                                                   \
    const cudaError_t sp_err_ = (expr);                                                  \
    ASSERT_EQ(sp_err_, cudaSuccess) << #expr << ": " << cudaGetErrorString(sp_err_);     \
  } while (0)

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

// A policy whose tensors (exact_gate thresholds) live on the device.
struct DevicePolicy {
  Policy policy;
  DeviceBuffer thresholds;
  HostTensor host_thresholds;
};
inline std::unique_ptr<DevicePolicy> to_device(const Policy& host) {
  auto d = std::make_unique<DevicePolicy>();
  d->policy = host;
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
// back into tp's host output tensors and r.out.
inline GpuRun run_gpu(TestProblem* tp, const Policy& policy, void* stream = nullptr) {
  GpuRun r;
  const AttentionProblem host = tp->problem();
  DeviceBuffer q, k, v, o, lse;
  AttentionProblem dev = host;
  dev.q = to_device(tp->q, &q);
  dev.k = to_device(tp->k, &k);
  dev.v = to_device(tp->v, &v);
  poison(&tp->o);
  poison(&tp->lse);
  AttentionOutput out;
  out.o = to_device(tp->o, &o);
  out.lse = to_device(tp->lse, &lse);
  const auto dev_policy = to_device(policy);
  RunOptions opt;
  opt.backend = Backend::kCUDA;
  opt.cuda_stream = stream;
  // (void): nvcc reads the assignment's Status& result as a discarded [[nodiscard]] value.
  static_cast<void>(r.status = run(dev, dev_policy->policy, out, opt, &r.stats, &r.decisions));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  if (r.status.ok()) {
    to_host(o, &tp->o);
    to_host(lse, &tp->lse);
    ProblemShape shape;
    EXPECT_TRUE(validate_problem(host, nullptr, &shape).ok());
    r.out = read_output(tp->output(), shape);
  }
  return r;
}

}  // namespace sparseprefill::test
