// SPDX-License-Identifier: Apache-2.0
// The oracle behind the backend interface: it decides, then attends (run_reference), into its
// own fp64 arrays, which are stored through the output views.
#include "reference/backend.h"

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/tensor_access.h"
#include "reference/reference.h"
#include "reference/statistics.h"

namespace sparseprefill::ref {
namespace {

Status require_host(const ProblemShape& s) {
  if (s.device.kind != DeviceKind::kCPU) {
    return invalid_argument("backend reference: expected host (CPU) tensors, got CUDA tensors");
  }
  return {};
}

class ReferenceBackend final : public detail::BackendImpl {
 public:
  Backend kind() const override { return Backend::kReference; }

  Status can_run(const ProblemShape& shape, const Policy&) const override { return require_host(shape); }

  Status plan(const AttentionProblem&, const ProblemShape& shape, const Policy&, const RunOptions&, bool,
              std::unique_ptr<detail::PreparedRun>* out) const override {
    SP_RETURN_IF_ERROR(require_host(shape));
    auto prepared = std::make_unique<detail::PreparedRun>();
    prepared->info.backend = Backend::kReference;
    prepared->info.path = "reference";
    *out = std::move(prepared);
    return {};
  }

  Status run(const detail::PreparedRun& prepared, const AttentionProblem& problem, const ProblemShape& s, const Policy& policy,
             const AttentionOutput& output, const RunOptions&, Decisions* decisions, ExecutionInfo* ran) const override {
    *ran = prepared.info;
    Result result;
    SP_RETURN_IF_ERROR(run_reference(problem, policy, &result));
    const std::int64_t rows = s.total_q();
    std::vector<double> lse_seq;
    std::int64_t row0 = 0;
    for (int b = 0; b < s.batch; ++b) {
      const std::int64_t s_q = s.seq_q[static_cast<std::size_t>(b)];
      lse_seq.resize(static_cast<std::size_t>(s_q * s.h_q));
      for (int h = 0; h < s.h_q; ++h) {
        for (std::int64_t r = 0; r < s_q; ++r) {
          lse_seq[static_cast<std::size_t>(h * s_q + r)] = result.lse[static_cast<std::size_t>(h * rows + row0 + r)];
        }
      }
      detail::store_output<double>(output, s, b, result.o.data() + row0 * s.h_q * s.d_v, lse_seq.data());
      row0 += s_q;
    }
    if (decisions != nullptr) *decisions = std::move(result.decisions);
    return {};
  }

  Status select(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy, const RunOptions&,
                Decisions* decisions) const override {
    SP_RETURN_IF_ERROR(require_host(shape));
    return decide_reference(problem, policy, decisions);
  }

  Status block_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape, int block_q,
                          int block_k, bool want_max, bool want_g, void*,
                          std::vector<BlockStatistics>* out) const override {
    return ref::block_statistics(who, sample, shape, block_q, block_k, want_max, want_g, out);
  }

  Status select_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                           const EstimateSelectParams& base, void*, std::vector<SelectStatistics>* out) const override {
    return ref::select_statistics(who, sample, shape, base, out);
  }

  std::string build_info() const override { return "backend reference: fp64 oracle, every policy\n"; }
};

}  // namespace

const detail::BackendImpl& reference_backend() {
  static const ReferenceBackend backend;
  return backend;
}

}  // namespace sparseprefill::ref
