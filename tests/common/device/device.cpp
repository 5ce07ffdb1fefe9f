// SPDX-License-Identifier: Apache-2.0
// Device copies of test tensors over the CUDA runtime (see device.h).
#include "common/device/device.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <utility>

#include "common/poison.h"
#include "common/tolerance.h"

namespace sparseprefill::test {

std::string cuda_unavailable() {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) return std::string("no CUDA device (cudaGetDeviceCount: ") + cudaGetErrorString(err) + ")";
  return n > 0 ? std::string() : std::string("no CUDA device");
}

bool hopper_device() {
  cudaDeviceProp prop;
  return cudaGetDeviceProperties(&prop, 0) == cudaSuccess && prop.major == 9 && prop.minor == 0;
}

DeviceBuffer::~DeviceBuffer() { cudaFree(ptr); }

TensorView to_device(const HostTensor& t, DeviceBuffer* buf) {
  buf->bytes = t.nbytes();
  EXPECT_EQ(cudaMalloc(&buf->ptr, buf->bytes > 0 ? buf->bytes : 16), cudaSuccess);
  if (buf->bytes > 0) EXPECT_EQ(cudaMemcpy(buf->ptr, t.data(), buf->bytes, cudaMemcpyHostToDevice), cudaSuccess);
  TensorView v = t.view();
  v.data = buf->ptr;
  v.device = Device{DeviceKind::kCUDA, 0};
  return v;
}

void to_host(const DeviceBuffer& buf, HostTensor* t) {
  if (buf.bytes > 0) EXPECT_EQ(cudaMemcpy(t->data(), buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

TensorView view_to_device(const TensorView& t, DeviceBuffer* buf) {
  EXPECT_TRUE(t.is_contiguous()) << describe(t);
  buf->bytes = static_cast<std::size_t>(t.numel()) * dtype_size(t.dtype);
  EXPECT_EQ(cudaMalloc(&buf->ptr, buf->bytes > 0 ? buf->bytes : 16), cudaSuccess);
  if (buf->bytes > 0) EXPECT_EQ(cudaMemcpy(buf->ptr, t.data, buf->bytes, cudaMemcpyHostToDevice), cudaSuccess);
  TensorView v = t;
  v.data = buf->ptr;
  v.device = Device{DeviceKind::kCUDA, 0};
  return v;
}

void view_to_host(const DeviceBuffer& buf, const TensorView& t) {
  if (buf.bytes > 0) EXPECT_EQ(cudaMemcpy(t.data, buf.ptr, buf.bytes, cudaMemcpyDeviceToHost), cudaSuccess);
}

void DevicePolicy::means_to_host() const {
  if (host_k_means.defined()) view_to_host(k_means, host_k_means);
  if (host_v_means.defined()) view_to_host(v_means, host_v_means);
}

std::unique_ptr<DevicePolicy> to_device(const Policy& host) {
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
    // The (possibly strided) host table copied into a contiguous one, then to the device.
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

void DeviceProblem::read_back(TestProblem* tp) const {
  policy->means_to_host();
  to_host(o, &tp->o);
  to_host(lse, &tp->lse);
}

std::unique_ptr<DeviceProblem> to_device(TestProblem* tp, const Policy& policy) {
  auto d = std::make_unique<DeviceProblem>();
  d->problem = tp->problem();
  d->problem.q = to_device(tp->q, &d->q);
  d->problem.k = to_device(tp->k, &d->k);
  d->problem.v = to_device(tp->v, &d->v);
  // FP8 descales live on q's device too.
  TensorView* views[3] = {&d->problem.q_descale, &d->problem.k_descale, &d->problem.v_descale};
  const HostTensor* tensors[3] = {&tp->q_descale, &tp->k_descale, &tp->v_descale};
  for (int i = 0; i < 3; ++i) {
    if (views[i]->defined()) *views[i] = to_device(*tensors[i], &d->descale[i]);
  }
  if (d->problem.sinks.defined()) d->problem.sinks = to_device(tp->sinks, &d->sinks);
  poison(&tp->o);
  poison(&tp->lse);
  d->output.o = to_device(tp->o, &d->o);
  d->output.lse = to_device(tp->lse, &d->lse);
  d->policy = to_device(policy);
  return d;
}

void expect_device_synchronized() { EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess); }

GpuRun run_gpu(TestProblem* tp, const Policy& policy, const RunOptions& options) {
  GpuRun r;
  const auto dev = to_device(tp, policy);
  RunOptions opt = options;
  opt.backend = Backend::kCUDA;
  r.status = run(dev->problem, dev->policy->policy, dev->output, opt, &r.stats, &r.decisions);
  expect_device_synchronized();
  if (r.status.ok()) {
    dev->read_back(tp);
    ProblemShape shape;
    EXPECT_TRUE(validate_problem(tp->problem(), nullptr, &shape).ok());
    r.out = read_output(tp->output(), shape);
  }
  return r;
}

GpuRun run_gpu(TestProblem* tp, const Policy& policy, void* stream, const ExecutionOverrides& overrides) {
  RunOptions opt;
  opt.cuda_stream = stream;
  opt.overrides = overrides;
  return run_gpu(tp, policy, opt);
}

}  // namespace sparseprefill::test
