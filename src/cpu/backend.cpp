// SPDX-License-Identifier: Apache-2.0
// The CPU backend behind the backend interface.
#include "cpu/backend.h"

#include <thread>
#include <utility>

#include "cpu/cpu_backend.h"
#include "cpu/cpu_policies.h"

namespace sparseprefill::cpu {
namespace {

Status require_host(const ProblemShape& s) {
  if (s.device.kind != DeviceKind::kCPU) {
    return invalid_argument("backend cpu: expected host (CPU) tensors, got CUDA tensors");
  }
  return {};
}

class CpuBackend final : public detail::BackendImpl {
 public:
  Backend kind() const override { return Backend::kCPU; }

  Status can_run(const ProblemShape& shape, const Policy&) const override { return require_host(shape); }

  Status plan(const AttentionProblem&, const ProblemShape& shape, const Policy&, const RunOptions&, bool,
              std::unique_ptr<detail::PreparedRun>* out) const override {
    SP_RETURN_IF_ERROR(require_host(shape));
    auto prepared = std::make_unique<detail::PreparedRun>();
    prepared->info.backend = Backend::kCPU;
    prepared->info.path = "cpu";
    *out = std::move(prepared);
    return {};
  }

  Status run(const detail::PreparedRun& prepared, const AttentionProblem& problem, const ProblemShape& shape,
             const Policy& policy, const AttentionOutput& output, const RunOptions& options,
             Decisions* decisions, ExecutionInfo* ran) const override {
    *ran = prepared.info;
    Decisions local;
    SP_RETURN_IF_ERROR(run_cpu(problem, shape, policy, output, options.num_threads, &local));
    if (decisions != nullptr) *decisions = std::move(local);
    return {};
  }

  Status select(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                const RunOptions& options, Decisions* decisions) const override {
    SP_RETURN_IF_ERROR(require_host(shape));
    const auto* es = std::get_if<EstimateSelectParams>(&policy);
    if (es == nullptr) return {StatusCode::kInternal, "cpu select: only estimate_select has a selector"};
    EstimatePlan plan;
    SP_RETURN_IF_ERROR(estimate_select_plan(problem, shape, *es, options.num_threads, &plan));
    decisions->kept = std::move(plan.kept);
    decisions->corrected = std::move(plan.corrected);
    return {};
  }

  std::string build_info() const override {
    return "backend cpu: fp32, " + std::to_string(std::thread::hardware_concurrency()) + " threads, every policy\n";
  }
};

}  // namespace

const detail::BackendImpl& cpu_backend() {
  static const CpuBackend backend;
  return backend;
}

}  // namespace sparseprefill::cpu
