// SPDX-License-Identifier: Apache-2.0
// Device copies of test tensors for the CUDA backend's tests (tests/cuda) and the CUDA
// targets of the backend-conformance suite (tests/conformance): plain C++ over the CUDA
// runtime, compiled (device.cpp, library sp_test_device) only in builds with the CUDA backend.
// Index tensors (cu_seqlens, seqused_k, block_table, prompt_len, block_means_valid) stay on the
// host, as the API takes them.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "common/inputs.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {

// Why this machine cannot run the CUDA backend ("" when device 0 can): no CUDA device.
std::string cuda_unavailable();
// Whether device 0 has compute capability 9.0 (the Hopper kernels' sm_90a code).
bool hopper_device();

// Device memory owned by a test.
struct DeviceBuffer {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
};

// A device copy of contiguous host tensor `t`, viewed with t's shape (contiguous strides), and
// the copy back into t.
TensorView to_device(const HostTensor& t, DeviceBuffer* buf);
void to_host(const DeviceBuffer& buf, HostTensor* t);
// The same for a contiguous host view (same shape and strides).
TensorView view_to_device(const TensorView& t, DeviceBuffer* buf);
void view_to_host(const DeviceBuffer& buf, const TensorView& t);

// A policy whose tensors live on the device: exact_gate's thresholds (copied contiguous), and
// estimate_select's cache of block means. means_to_host copies the cache, which a call writes,
// back into the host policy's tensors.
struct DevicePolicy {
  Policy policy;
  DeviceBuffer thresholds;
  HostTensor host_thresholds;
  DeviceBuffer k_means, v_means;
  TensorView host_k_means, host_v_means;

  void means_to_host() const;
};
std::unique_ptr<DevicePolicy> to_device(const Policy& host);

// A TestProblem's tensors on the device: q, k, v, FP8 descales and sinks copied; O and LSE
// device buffers poisoned with NaN (so that an element no kernel writes shows); the policy's
// tensors.
struct DeviceProblem {
  AttentionProblem problem;
  AttentionOutput output;
  std::unique_ptr<DevicePolicy> policy;
  DeviceBuffer q, k, v, o, lse, descale[3], sinks;

  // Copies O and LSE back into tp's host tensors and the cache of block means into the host
  // policy's.
  void read_back(TestProblem* tp) const;
};
std::unique_ptr<DeviceProblem> to_device(TestProblem* tp, const Policy& policy);

// Waits for the device and expects no error.
void expect_device_synchronized();

struct GpuRun {
  Status status;
  ref::Result out;  // the GPU output in the oracle's layout
  Decisions decisions;
  RunStats stats;
};

// Runs `policy` with `options` (backend kCUDA) on the device copy of tp and, when the call
// succeeds, reads O and LSE back into tp's host output tensors and r.out (and a cache of block
// means into the policy's host tensors).
GpuRun run_gpu(TestProblem* tp, const Policy& policy, const RunOptions& options);
// The same with the default options but `overrides` (and the stream).
GpuRun run_gpu(TestProblem* tp, const Policy& policy, void* stream = nullptr, const ExecutionOverrides& overrides = {});

}  // namespace sparseprefill::test
