// SPDX-License-Identifier: Apache-2.0
// The CUDA backend behind the backend interface.
#include "cuda/backend.h"

#include <utility>

#include "cuda/cuda_backend.h"

namespace sparseprefill::cuda {
namespace {

Status require_cuda(const ProblemShape& s) {
  if (s.device.kind != DeviceKind::kCUDA) return invalid_argument("backend cuda: expected CUDA tensors, got host tensors");
  return {};
}

Status prefixed(const char* who, Status st) {
  if (st.ok()) return st;
  return Status(st.code(), std::string(who) + ": " + st.message());
}

struct CudaPrepared final : detail::PreparedRun {
  std::shared_ptr<const PlanState> state;  // null for a transient plan
};

class CudaBackend final : public detail::BackendImpl {
 public:
  Backend kind() const override { return Backend::kCUDA; }

  Status can_run(const ProblemShape& shape, const Policy& policy) const override {
    SP_RETURN_IF_ERROR(require_cuda(shape));
    return can_run_cuda(shape, policy);
  }

  Status plan(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
              const RunOptions& options, bool persistent, std::unique_ptr<detail::PreparedRun>* out) const override {
    SP_RETURN_IF_ERROR(require_cuda(shape));
    auto prepared = std::make_unique<CudaPrepared>();
    prepared->info.backend = Backend::kCUDA;
    if (persistent) SP_RETURN_IF_ERROR(make_plan_state(problem, shape, policy, options, &prepared->state));
    *out = std::move(prepared);
    return {};
  }

  Status run(const detail::PreparedRun& prepared, const AttentionProblem& problem, const ProblemShape& shape,
             const Policy& policy, const AttentionOutput& output, const RunOptions& options,
             Decisions* decisions) const override {
    const auto& cuda = static_cast<const CudaPrepared&>(prepared);
    return run_cuda(problem, shape, policy, output, options, decisions, cuda.state.get());
  }

  Status select(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                const RunOptions& options, Decisions* decisions) const override {
    SP_RETURN_IF_ERROR(require_cuda(shape));
    const auto* es = std::get_if<EstimateSelectParams>(&policy);
    if (es == nullptr) return {StatusCode::kInternal, "cuda select: only estimate_select has a selector"};
    return select_cuda(problem, shape, *es, options, decisions);
  }

  Status block_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape, int block_q,
                          int block_k, bool want_max, bool want_g, void* cuda_stream,
                          std::vector<BlockStatistics>* out) const override {
    return prefixed(who, block_statistics_cuda(sample, shape, block_q, block_k, want_max, want_g, cuda_stream, out));
  }

  Status select_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                           const EstimateSelectParams& base, void* cuda_stream,
                           std::vector<SelectStatistics>* out) const override {
    return prefixed(who, select_statistics_cuda(sample, shape, base, cuda_stream, out));
  }

  std::string build_info() const override { return "backend cuda: compiled\n" + cuda_build_info(); }
};

}  // namespace

const detail::BackendImpl& cuda_backend() {
  static const CudaBackend backend;
  return backend;
}

}  // namespace sparseprefill::cuda
