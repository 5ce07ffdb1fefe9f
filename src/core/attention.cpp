// SPDX-License-Identifier: Apache-2.0
// run(), select() and plans: validation, policy/problem consistency, backend choice and
// statistics. No arithmetic happens here; the backends (src/reference, src/cpu, src/cuda)
// compute.
#include "sparseprefill/attention.h"

#include <memory>
#include <sstream>
#include <thread>

#include "core/estimate_chunks.h"
#include "core/policy_dtype.h"
#include "core/stats.h"
#include "core/tensor_access.h"
#include "cpu/cpu_backend.h"
#include "cpu/cpu_policies.h"
#include "reference/reference.h"
#include "sparseprefill/plan.h"
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
  if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    detail::EstimateChunks chunks;
    SP_RETURN_IF_ERROR(detail::read_estimate_chunks(*es, s, &chunks));
  }
  SP_RETURN_IF_ERROR(detail::check_policy_dtype(policy, s.dtype));
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

// The CUDA backend is compiled in and the tensors are on a CUDA device.
Status require_cuda(const ProblemShape& s) {
#if defined(SP_WITH_CUDA)
  if (s.device.kind != DeviceKind::kCUDA) return invalid_argument("backend cuda: expected CUDA tensors, got host tensors");
  return {};
#else
  (void)s;
  return unsupported("backend cuda: this build has no CUDA backend (configure with SP_ENABLE_CUDA=ON)");
#endif
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

// The work of run() once the problem and the policy are known to agree: `backend` resolved,
// `plan_state` the CUDA plan's device state (or null).
Status dispatch(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                const AttentionOutput& output, const RunOptions& options, Backend backend,
                [[maybe_unused]] const void* plan_state, RunStats* stats, Decisions* decisions) {
  if (options.num_threads < 0) return invalid_argument("num_threads: expected >= 0, got " + std::to_string(options.num_threads));
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
      SP_RETURN_IF_ERROR(require_cuda(shape));
#if defined(SP_WITH_CUDA)
      {
        // Device decisions cost a copy back and a synchronisation: only when asked for, or when
        // stats need them (dense and block_sparse stats follow from the policy alone).
        const bool stats_need = stats != nullptr && !std::holds_alternative<DenseParams>(policy) &&
                                !std::holds_alternative<BlockSparseParams>(policy);
        const bool want = stats_need || decisions != nullptr || options.collect_decisions;
        SP_RETURN_IF_ERROR(cuda::run_cuda(problem, shape, policy, output, options, want ? &local : nullptr,
                                          static_cast<const cuda::PlanState*>(plan_state)));
      }
#endif
      break;
    case Backend::kAuto:
      return {StatusCode::kInternal, "backend auto was not resolved"};
  }
  if (stats != nullptr) *stats = detail::stats_from_decisions(shape, policy, local);
  if (decisions != nullptr) *decisions = std::move(local);
  return {};
}

template <class T>
std::string join(const std::vector<T>& v) {
  std::string out = "[";
  for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out + "]";
}

const char* layout_name(KvLayout layout) {
  switch (layout) {
    case KvLayout::kBatched: return "batched";
    case KvLayout::kVarlen: return "varlen";
    case KvLayout::kPaged: return "paged";
  }
  return "?";
}

std::string device_name(const Device& d) {
  return d.kind == DeviceKind::kCUDA ? "cuda:" + std::to_string(d.index) : std::string("cpu");
}

// The first field in which a run's problem differs from its plan's (the scale may differ).
Status check_plan_shape(const ProblemShape& planned, const ProblemShape& given) {
  auto differs = [](const std::string& what, const std::string& was, const std::string& now) {
    return invalid_argument("problem: does not match the plan: " + what + " " + now + ", the plan was made for " + was);
  };
  if (given.batch != planned.batch) return differs("batch", std::to_string(planned.batch), std::to_string(given.batch));
  if (given.h_q != planned.h_q) return differs("h_q", std::to_string(planned.h_q), std::to_string(given.h_q));
  if (given.h_kv != planned.h_kv) return differs("h_kv", std::to_string(planned.h_kv), std::to_string(given.h_kv));
  if (given.d != planned.d) return differs("head_dim", std::to_string(planned.d), std::to_string(given.d));
  if (given.causal != planned.causal) {
    return differs("causal", planned.causal ? "true" : "false", given.causal ? "true" : "false");
  }
  if (given.dtype != planned.dtype) return differs("dtype", dtype_name(planned.dtype), dtype_name(given.dtype));
  if (given.device != planned.device) return differs("device", device_name(planned.device), device_name(given.device));
  if (given.varlen_q != planned.varlen_q) {
    return differs("q layout", planned.varlen_q ? "varlen" : "batched", given.varlen_q ? "varlen" : "batched");
  }
  if (given.kv_layout != planned.kv_layout) {
    return differs("k/v layout", layout_name(planned.kv_layout), layout_name(given.kv_layout));
  }
  if (given.page_size != planned.page_size) {
    return differs("page_size", std::to_string(planned.page_size), std::to_string(given.page_size));
  }
  if (given.seq_q != planned.seq_q) return differs("query lengths", join(planned.seq_q), join(given.seq_q));
  if (given.seq_k != planned.seq_k) return differs("key lengths", join(planned.seq_k), join(given.seq_k));
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
  return dispatch(problem, shape, policy, output, options, resolve_backend(options.backend, shape), nullptr, stats,
                  decisions);
}

Status select(const AttentionProblem& problem, const Policy& policy, const RunOptions& options,
              Decisions* decisions, RunStats* stats) {
  if (decisions == nullptr) return invalid_argument("decisions: expected non-null");
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, shape));
  if (options.num_threads < 0) return invalid_argument("num_threads: expected >= 0, got " + std::to_string(options.num_threads));
  const Backend backend = resolve_backend(options.backend, shape);
  SP_RETURN_IF_ERROR(backend == Backend::kCUDA ? require_cuda(shape) : require_host(shape, backend));
  Decisions local;
  local.policy = policy_name(policy);
  if (std::holds_alternative<DenseParams>(policy)) {
    // Dense has no block size: report it in the policies' default (policy.h) of 128 x 128.
    constexpr int kDenseSelectBlock = 128;
    local.kept = BlockMask::all_visible(shape, kDenseSelectBlock, kDenseSelectBlock, false);
  } else if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    local.kept = bs->mask;
  } else if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    switch (backend) {
      case Backend::kReference:
        SP_RETURN_IF_ERROR(ref::decide_reference(problem, policy, &local));
        break;
      case Backend::kCPU: {
        cpu::EstimatePlan plan;
        SP_RETURN_IF_ERROR(cpu::estimate_select_plan(problem, shape, *es, options.num_threads, &plan));
        local.kept = std::move(plan.kept);
        local.corrected = std::move(plan.corrected);
        break;
      }
      case Backend::kCUDA:
#if defined(SP_WITH_CUDA)
        SP_RETURN_IF_ERROR(cuda::select_cuda(problem, shape, *es, options, &local));
#endif
        break;
      case Backend::kAuto:
        return {StatusCode::kInternal, "backend auto was not resolved"};
    }
  } else if (std::holds_alternative<PermuteStopParams>(policy)) {
    return unsupported("permute_stop: select() has no selection to return: pass 2 stops its ranked walk where the "
                       "attention it computes says so; run() with decisions returns the visit counts (tiles) and "
                       "query order");
  } else {
    return unsupported(std::string(policy_name(policy)) +
                       ": select() has no selection to return: the gate decides inside the attention kernel from "
                       "the scores it computes; run() with decisions returns its kept blocks");
  }
  if (stats != nullptr) *stats = detail::stats_from_decisions(shape, policy, local);
  *decisions = std::move(local);
  return {};
}

struct Plan::State {
  ProblemShape shape;
  Policy policy;
  Backend backend = Backend::kAuto;
  std::shared_ptr<const void> device;  // cuda::PlanState on the CUDA backend
};

Plan::Plan() = default;
Plan::~Plan() = default;
Plan::Plan(const Plan&) = default;
Plan& Plan::operator=(const Plan&) = default;
Plan::Plan(Plan&&) noexcept = default;
Plan& Plan::operator=(Plan&&) noexcept = default;
const ProblemShape& Plan::shape() const { return state_->shape; }
const Policy& Plan::policy() const { return state_->policy; }
Backend Plan::backend() const { return state_->backend; }

Status make_plan(const AttentionProblem& problem, const Policy& policy, const RunOptions& options, Plan* plan) {
  if (plan == nullptr) return invalid_argument("plan: expected non-null");
  auto state = std::make_shared<Plan::State>();
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &state->shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, state->shape));
  state->backend = resolve_backend(options.backend, state->shape);
  switch (state->backend) {
    case Backend::kReference:
    case Backend::kCPU:
      SP_RETURN_IF_ERROR(require_host(state->shape, state->backend));
      break;
    case Backend::kCUDA: {
      SP_RETURN_IF_ERROR(require_cuda(state->shape));
#if defined(SP_WITH_CUDA)
      std::shared_ptr<const cuda::PlanState> device;
      SP_RETURN_IF_ERROR(cuda::make_plan_state(problem, state->shape, policy, options, &device));
      state->device = std::move(device);
#endif
      break;
    }
    case Backend::kAuto:
      return {StatusCode::kInternal, "backend auto was not resolved"};
  }
  state->policy = policy;
  plan->state_ = std::move(state);
  return {};
}

Status run(const Plan& plan, const AttentionProblem& problem, const AttentionOutput& output, const RunOptions& options,
           RunStats* stats, Decisions* decisions) {
  if (!plan.valid()) return invalid_argument("plan: expected a plan from make_plan");
  const Plan::State& state = *plan.state_;
  if (options.backend != Backend::kAuto && options.backend != state.backend) {
    return invalid_argument(std::string("backend: the plan was made for backend ") + backend_name(state.backend) +
                            ", got " + backend_name(options.backend));
  }
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, &output, &shape));
  SP_RETURN_IF_ERROR(check_plan_shape(state.shape, shape));
  return dispatch(problem, shape, state.policy, output, options, state.backend, state.device.get(), stats,
                  decisions);
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
