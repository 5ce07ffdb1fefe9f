// SPDX-License-Identifier: Apache-2.0
// run(): validation, policy/problem consistency, backend choice and statistics. No arithmetic
// happens here; the backends (src/reference, src/cpu, src/cuda) compute.
#include "sparseprefill/attention.h"

#include <sstream>
#include <thread>

#include "core/stats.h"
#include "core/tensor_access.h"
#include "cpu/cpu_backend.h"
#include "reference/reference.h"
#include "sparseprefill/version.h"
#if defined(SP_WITH_CUDA)
#include "cuda/cuda_backend.h"
#endif

namespace sparseprefill {
namespace {

// Checks that only make sense with both the policy and the problem in hand.
Status validate_policy_for(const Policy& policy, const ProblemShape& s) {
  SP_RETURN_IF_ERROR(validate_policy(policy));
  if (const auto* g = std::get_if<ExactGateParams>(&policy)) {
    if (g->thresholds.shape[0] != s.h_q) {
      return invalid_argument("thresholds: expected [h_q, positions] with h_q = " + std::to_string(s.h_q) +
                              ", got " + describe(g->thresholds));
    }
    if (g->thresholds.device != s.device) {
      return invalid_argument("thresholds: expected q's device, got " + describe(g->thresholds));
    }
  }
  if (const auto* m = std::get_if<BlockSparseParams>(&policy)) {
    Status st = m->mask.validate_for(s);
    if (!st.ok()) return invalid_argument("mask: " + st.message());
  }
  if (!s.causal && (std::holds_alternative<EstimateSelectParams>(policy) ||
                    std::holds_alternative<PermuteStopParams>(policy))) {
    return unsupported(std::string(policy_name(policy)) + ": defined for causal attention only (causal = false given)");
  }
  return {};
}

Backend resolve_backend(Backend requested, const ProblemShape& s) {
  if (requested != Backend::kAuto) return requested;
  return s.device.kind == DeviceKind::kCUDA ? Backend::kCUDA : Backend::kCPU;
}

Status require_host(const ProblemShape& s, Backend b) {
  if (s.device.kind != DeviceKind::kCPU) {
    return invalid_argument(std::string("backend ") + backend_name(b) + ": expected host (CPU) tensors, got CUDA tensors");
  }
  return {};
}

// The oracle computes in fp64 into its own arrays; store them through the output views.
Status run_reference_into(const AttentionProblem& problem, const ProblemShape& s, const Policy& policy,
                          const AttentionOutput& output, Decisions* decisions) {
  ref::Result result;
  SP_RETURN_IF_ERROR(ref::run_reference(problem, policy, &result));
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
    detail::store_output<double>(output, s, b, result.o.data() + row0 * s.h_q * s.d, lse_seq.data());
    row0 += s_q;
  }
  *decisions = std::move(result.decisions);
  return {};
}

}  // namespace

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAuto: return "auto";
    case Backend::kReference: return "reference";
    case Backend::kCPU: return "cpu";
    case Backend::kCUDA: return "cuda";
  }
  return "?";
}

Status run(const AttentionProblem& problem, const Policy& policy, const AttentionOutput& output,
           const RunOptions& options, RunStats* stats, Decisions* decisions) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, &output, &shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, shape));
  if (options.num_threads < 0) return invalid_argument("num_threads: expected >= 0, got " + std::to_string(options.num_threads));
  const Backend backend = resolve_backend(options.backend, shape);
  Decisions local;
  switch (backend) {
    case Backend::kReference:
      SP_RETURN_IF_ERROR(require_host(shape, backend));
      SP_RETURN_IF_ERROR(run_reference_into(problem, shape, policy, output, &local));
      break;
    case Backend::kCPU:
      SP_RETURN_IF_ERROR(require_host(shape, backend));
      SP_RETURN_IF_ERROR(cpu::run_cpu(problem, shape, policy, output, options.num_threads, &local));
      break;
    case Backend::kCUDA:
#if defined(SP_WITH_CUDA)
      if (shape.device.kind != DeviceKind::kCUDA) {
        return invalid_argument("backend cuda: expected CUDA tensors, got host tensors");
      }
      {
        // Device decisions cost a copy back and a synchronisation: only when asked for, or when
        // stats need them (dense and block_sparse stats follow from the policy alone).
        const bool stats_need = stats != nullptr && !std::holds_alternative<DenseParams>(policy) &&
                                !std::holds_alternative<BlockSparseParams>(policy);
        const bool want = stats_need || decisions != nullptr || options.collect_decisions;
        SP_RETURN_IF_ERROR(cuda::run_cuda(problem, shape, policy, output, options, want ? &local : nullptr));
      }
      break;
#else
      return unsupported("backend cuda: this build has no CUDA backend (configure with SP_ENABLE_CUDA=ON)");
#endif
    case Backend::kAuto:
      return {StatusCode::kInternal, "backend auto was not resolved"};
  }
  if (stats != nullptr) *stats = detail::stats_from_decisions(shape, policy, local);
  if (decisions != nullptr) *decisions = std::move(local);
  return {};
}

Status can_run(const AttentionProblem& problem, const Policy& policy, Backend backend) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, shape));
  backend = resolve_backend(backend, shape);
  switch (backend) {
    case Backend::kReference:
    case Backend::kCPU: return require_host(shape, backend);
    case Backend::kCUDA:
#if defined(SP_WITH_CUDA)
      return cuda::can_run_cuda(shape, policy);
#else
      return unsupported("backend cuda: this build has no CUDA backend (configure with SP_ENABLE_CUDA=ON)");
#endif
    case Backend::kAuto: break;
  }
  return {StatusCode::kInternal, "backend auto was not resolved"};
}

std::string build_info() {
  std::ostringstream os;
  os << "sparseprefill " << SPARSEPREFILL_VERSION_STRING << "\n";
  os << "backend reference: fp64 oracle, every policy\n";
  os << "backend cpu: fp32, " << std::thread::hardware_concurrency() << " threads, every policy\n";
#if defined(SP_WITH_CUDA)
  os << "backend cuda: compiled\n" << cuda::cuda_build_info();
#else
  os << "backend cuda: not compiled\n";
#endif
  return os.str();
}

}  // namespace sparseprefill
