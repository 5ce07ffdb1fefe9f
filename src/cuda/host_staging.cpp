// SPDX-License-Identifier: Apache-2.0
// The CUDA backend on host tensors (run() with backend kCUDA and CPU tensors: the CLI on a GPU
// machine): the tensors a kernel reads are copied to the current device, the call runs there
// as any CUDA call, O and LSE (and estimate_select's cache of block means, which a call writes)
// are copied back, and the device time of the call's kernels is reported. Synchronous. Index
// tensors stay on the host, where the library reads them anyway.
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "cuda/host_staging.h"
#include "cuda/runtime.h"

namespace sparseprefill::cuda {
namespace {

// Elements from a view's first to its last element (non-negative strides).
std::int64_t span(const TensorView& t) {
  std::int64_t last = 0;
  for (int i = 0; i < t.rank; ++i) {
    if (t.shape[i] == 0) return 0;
    last += (t.shape[i] - 1) * t.stride[i];
  }
  return last + 1;
}

// Device copies of host views (same shapes and strides), freed when this dies.
class Mirror {
 public:
  explicit Mirror(int device) : device_(device) {}
  Mirror(const Mirror&) = delete;
  Mirror& operator=(const Mirror&) = delete;
  ~Mirror() {
    for (void* p : owned_) cudaFree(p);
  }

  // The device view of `host` (undefined stays undefined); `copy` false: allocated only.
  Status view(const TensorView& host, bool copy, TensorView* out) {
    *out = host;
    if (!host.defined()) return {};
    for (int i = 0; i < host.rank; ++i) {
      if (host.stride[i] < 0) return invalid_argument("host staging: negative strides, got " + describe(host));
    }
    const std::size_t bytes = static_cast<std::size_t>(span(host)) * dtype_size(host.dtype);
    void* dev = nullptr;
    SP_CUDA_TRY(cudaMalloc(&dev, bytes > 0 ? bytes : 16), "cudaMalloc (host staging)");
    owned_.push_back(dev);
    if (copy && bytes > 0) SP_CUDA_TRY(cudaMemcpy(dev, host.data, bytes, cudaMemcpyHostToDevice), "cudaMemcpy (host staging)");
    out->data = dev;
    out->device = Device{DeviceKind::kCUDA, device_};
    return {};
  }

 private:
  int device_;
  std::vector<void*> owned_;
};

Status copy_back(const TensorView& dev, const TensorView& host) {
  if (!host.defined()) return {};
  const std::size_t bytes = static_cast<std::size_t>(span(host)) * dtype_size(host.dtype);
  if (bytes == 0) return {};
  SP_CUDA_TRY(cudaMemcpy(host.data, dev.data, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy (host staging)");
  return {};
}

// The policy with its tensors on the device (thresholds; estimate_select's cache of block
// means, the index tensors of which stay on the host).
Status stage_policy(const Policy& host, Mirror* mirror, Policy* out) {
  *out = host;
  if (auto* g = std::get_if<ExactGateParams>(out)) {
    SP_RETURN_IF_ERROR(mirror->view(std::get<ExactGateParams>(host).thresholds, true, &g->thresholds));
  } else if (auto* es = std::get_if<EstimateSelectParams>(out)) {
    const auto& h = std::get<EstimateSelectParams>(host);
    SP_RETURN_IF_ERROR(mirror->view(h.k_block_means, true, &es->k_block_means));
    SP_RETURN_IF_ERROR(mirror->view(h.v_block_means, true, &es->v_block_means));
  } else if (const auto* bs = std::get_if<BlockSparseParams>(out); bs != nullptr && bs->in_place()) {
    return {StatusCode::kInternal, "host staging: a device mask reaches it as a BlockMask (dispatch converts it)"};
  }
  return {};
}

}  // namespace

Status run_host_staged(const detail::BackendImpl& cuda, const AttentionProblem& problem, const Policy& policy,
                       const AttentionOutput& output, const RunOptions& options, Decisions* decisions,
                       ExecutionInfo* ran) {
  int device = 0;
  SP_CUDA_TRY(cudaGetDevice(&device), "cudaGetDevice");
  Mirror mirror(device);
  AttentionProblem dev = problem;
  SP_RETURN_IF_ERROR(mirror.view(problem.q, true, &dev.q));
  SP_RETURN_IF_ERROR(mirror.view(problem.k, true, &dev.k));
  SP_RETURN_IF_ERROR(mirror.view(problem.v, true, &dev.v));
  SP_RETURN_IF_ERROR(mirror.view(problem.q_descale, true, &dev.q_descale));
  SP_RETURN_IF_ERROR(mirror.view(problem.k_descale, true, &dev.k_descale));
  SP_RETURN_IF_ERROR(mirror.view(problem.v_descale, true, &dev.v_descale));
  SP_RETURN_IF_ERROR(mirror.view(problem.sinks, true, &dev.sinks));
  AttentionOutput dev_out;
  SP_RETURN_IF_ERROR(mirror.view(output.o, false, &dev_out.o));
  SP_RETURN_IF_ERROR(mirror.view(output.lse, false, &dev_out.lse));
  Policy dev_policy;
  SP_RETURN_IF_ERROR(stage_policy(policy, &mirror, &dev_policy));
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(dev, &dev_out, &shape));
  RunOptions opts = options;
  opts.cuda_stream = nullptr;  // the device's default stream: the copies above are synchronous
  std::unique_ptr<detail::PreparedRun> prepared;
  SP_RETURN_IF_ERROR(cuda.plan(dev, shape, dev_policy, opts, /*persistent=*/false, &prepared));
  cudaEvent_t start = nullptr, stop = nullptr;
  SP_CUDA_TRY(cudaEventCreate(&start), "cudaEventCreate");
  SP_CUDA_TRY(cudaEventCreate(&stop), "cudaEventCreate");
  const auto destroy = [&] {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  };
  Status st = cuda_status(cudaEventRecord(start, nullptr), "cudaEventRecord");
  if (st.ok()) st = cuda.run(*prepared, dev, shape, dev_policy, dev_out, opts, decisions, ran);
  if (st.ok()) st = cuda_status(cudaEventRecord(stop, nullptr), "cudaEventRecord");
  if (st.ok()) st = cuda_status(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0.f;
  if (st.ok()) st = cuda_status(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  destroy();
  SP_RETURN_IF_ERROR(st);
  SP_RETURN_IF_ERROR(copy_back(dev_out.o, output.o));
  SP_RETURN_IF_ERROR(copy_back(dev_out.lse, output.lse));
  if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    const auto& d = std::get<EstimateSelectParams>(dev_policy);
    SP_RETURN_IF_ERROR(copy_back(d.k_block_means, es->k_block_means));
    SP_RETURN_IF_ERROR(copy_back(d.v_block_means, es->v_block_means));
  }
  if (ran != nullptr) ran->device_ms = ms;
  return report_mask_faults(device);
}

}  // namespace sparseprefill::cuda
