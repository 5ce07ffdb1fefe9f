// SPDX-License-Identifier: Apache-2.0
// run(), select() and plans: validation, policy/problem consistency, backend choice and
// statistics. No arithmetic happens here; the backends (src/reference, src/cpu, src/cuda)
// compute, behind the interface of core/backend.h. Every run is a plan and one run of it: an
// unplanned call makes a transient plan, so both take one code path.
#include "sparseprefill/attention.h"

#include <memory>
#include <sstream>

#include "core/estimate_chunks.h"
#include "core/stats.h"
#include "dispatch/dispatch.h"
#include "sparseprefill/plan.h"
#include "sparseprefill/version.h"

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
    if (m->in_place()) {
      SP_RETURN_IF_ERROR(m->device_mask.validate_for(s));
    } else {
      Status st = m->mask.validate_for(s);
      if (!st.ok()) return invalid_argument("mask: " + st.message());
    }
  }
  if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    detail::EstimateChunks chunks;
    SP_RETURN_IF_ERROR(detail::read_estimate_chunks(*es, s, &chunks));
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

// The policy as backend `b` takes it: the host backends read a block mask given in place (host
// tensors) as a BlockMask, with every device check on the host (an offence is the call's error).
Status policy_for_backend(const Policy& policy, const ProblemShape& shape, Backend b, Policy* out) {
  const auto* bs = std::get_if<BlockSparseParams>(&policy);
  if (bs == nullptr || !bs->in_place() || b == Backend::kCUDA) {
    *out = policy;
    return {};
  }
  BlockSparseParams host;
  SP_RETURN_IF_ERROR(bs->device_mask.to_block_mask(shape, &host.mask));
  *out = std::move(host);
  return {};
}

// The compiled backend behind `b` (resolved), or why there is none.
Status find_backend(Backend b, const detail::BackendImpl** out) {
  *out = detail::backend_impl(b);
  if (*out != nullptr) return {};
  if (b == Backend::kCUDA) {
    return unsupported("backend cuda: this build has no CUDA backend (configure with SP_ENABLE_CUDA=ON)");
  }
  return {StatusCode::kInternal, std::string("backend ") + backend_name(b) + " was not resolved"};
}

// The work of run() once the problem and the policy are known to agree and the call is
// planned: `prepared` from backend.plan().
Status run_prepared(const detail::BackendImpl& backend, const detail::PreparedRun& prepared,
                    const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                    const AttentionOutput& output, const RunOptions& options, RunStats* stats,
                    Decisions* decisions) {
  if (options.num_threads < 0) return invalid_argument("num_threads: expected >= 0, got " + std::to_string(options.num_threads));
  // Decisions cost a GPU backend a copy back and a synchronisation: only when asked for, or
  // when stats need them (dense and block_sparse stats follow from the policy alone).
  const auto* mask = std::get_if<BlockSparseParams>(&policy);
  const bool stats_need = stats != nullptr && !std::holds_alternative<DenseParams>(policy) &&
                          (mask == nullptr || mask->in_place());
  const bool want = stats_need || decisions != nullptr || options.collect_decisions;
  Decisions local;
  ExecutionInfo ran;
  SP_RETURN_IF_ERROR(backend.run(prepared, problem, shape, policy, output, options, want ? &local : nullptr, &ran));
  if (stats != nullptr) {
    *stats = detail::stats_from_decisions(shape, policy, local);
    stats->execution = std::move(ran);
  }
  if (decisions != nullptr) *decisions = std::move(local);
  return {};
}

// run() of host tensors on a device backend: staged to the device and back by the backend.
Status run_host(const detail::BackendImpl& backend, const AttentionProblem& problem, const ProblemShape& shape,
                const Policy& policy, const AttentionOutput& output, const RunOptions& options, RunStats* stats,
                Decisions* decisions) {
  if (options.num_threads < 0) return invalid_argument("num_threads: expected >= 0, got " + std::to_string(options.num_threads));
  Policy host;  // a mask given in place on the host is read as a BlockMask here, as the host backends read it
  SP_RETURN_IF_ERROR(policy_for_backend(policy, shape, Backend::kCPU, &host));
  const auto* mask = std::get_if<BlockSparseParams>(&host);
  const bool want = decisions != nullptr || options.collect_decisions ||
                    (stats != nullptr && !std::holds_alternative<DenseParams>(host) && mask == nullptr);
  Decisions local;
  ExecutionInfo ran;
  SP_RETURN_IF_ERROR(backend.run_host(problem, host, output, options, want ? &local : nullptr, &ran));
  if (stats != nullptr) {
    *stats = detail::stats_from_decisions(shape, host, local);
    stats->execution = std::move(ran);
  }
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
  if (given.d_v != planned.d_v) return differs("v head_dim", std::to_string(planned.d_v), std::to_string(given.d_v));
  if (given.causal != planned.causal) {
    return differs("causal", planned.causal ? "true" : "false", given.causal ? "true" : "false");
  }
  // The window and the chunks decide which blocks are visible (a plan's mask was validated against it) and
  // the softcap every score; the sinks' values are data, whether there are any is not.
  if (given.window_left != planned.window_left || given.window_right != planned.window_right) {
    const auto window = [](const ProblemShape& s) {
      return "(" + std::to_string(s.window_left) + ", " + std::to_string(s.window_right) + ")";
    };
    return differs("window", window(planned), window(given));
  }
  if (given.attention_chunk != planned.attention_chunk) {
    return differs("attention_chunk", std::to_string(planned.attention_chunk), std::to_string(given.attention_chunk));
  }
  if (given.softcap != planned.softcap) return differs("softcap", std::to_string(planned.softcap), std::to_string(given.softcap));
  if (given.sinks != planned.sinks) return differs("sinks", planned.sinks ? "given" : "none", given.sinks ? "given" : "none");
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
  const Backend kind = resolve_backend(options.backend, shape);
  const detail::BackendImpl* backend = nullptr;
  SP_RETURN_IF_ERROR(find_backend(kind, &backend));
  if (kind == Backend::kCUDA && shape.device.kind == DeviceKind::kCPU) return run_host(*backend, problem, shape, policy,
                                                                                        output, options, stats, decisions);
  Policy taken;
  SP_RETURN_IF_ERROR(policy_for_backend(policy, shape, kind, &taken));
  std::unique_ptr<detail::PreparedRun> prepared;
  SP_RETURN_IF_ERROR(backend->plan(problem, shape, taken, options, /*persistent=*/false, &prepared));
  return run_prepared(*backend, *prepared, problem, shape, taken, output, options, stats, decisions);
}

Status select(const AttentionProblem& problem, const Policy& policy, const RunOptions& options,
              Decisions* decisions, RunStats* stats) {
  if (decisions == nullptr) return invalid_argument("decisions: expected non-null");
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, shape));
  if (options.num_threads < 0) return invalid_argument("num_threads: expected >= 0, got " + std::to_string(options.num_threads));
  const detail::BackendImpl* backend = nullptr;
  SP_RETURN_IF_ERROR(find_backend(resolve_backend(options.backend, shape), &backend));
  SP_RETURN_IF_ERROR(backend->can_run(shape, policy));
  Decisions local;
  local.policy = policy_name(policy);
  if (std::holds_alternative<DenseParams>(policy)) {
    // Dense has no block size: report it in the policies' default (policy.h) of 128 x 128.
    constexpr int kDenseSelectBlock = 128;
    local.kept = BlockMask::all_visible(shape, kDenseSelectBlock, kDenseSelectBlock, false);
  } else if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    if (bs->in_place() && shape.device.kind != DeviceKind::kCPU) {
      return unsupported("block_sparse: select() of a mask already on the device has nothing to select; read it "
                         "where it is (DeviceBlockMask)");
    }
    Policy host;
    SP_RETURN_IF_ERROR(policy_for_backend(policy, shape, Backend::kCPU, &host));
    local.kept = std::get<BlockSparseParams>(host).mask;
  } else if (std::holds_alternative<EstimateSelectParams>(policy)) {
    SP_RETURN_IF_ERROR(backend->select(problem, shape, policy, options, &local));
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

Status select_into(const AttentionProblem& problem, const Policy& policy, const RunOptions& options,
                   const DeviceBlockMask& out) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, shape));
  const auto* es = std::get_if<EstimateSelectParams>(&policy);
  if (es == nullptr) {
    return unsupported(std::string(policy_name(policy)) +
                       ": select_into has estimate_select's selection only (dense and block_sparse need none; the "
                       "gates and permute_stop decide inside attention)");
  }
  if (out.is_csr() || out.block_q != 128 || out.block_k != es->block || out.per_kv_head != es->pack_gqa ||
      !out.full_count.defined()) {
    return invalid_argument("out: expected FlexAttention's four tensors (kv_num_blocks, kv_indices, full_kv_num_blocks, "
                            "full_kv_indices) with block_q 128, block_k = the policy's block and per_kv_head = pack_gqa");
  }
  const detail::BackendImpl* backend = nullptr;
  SP_RETURN_IF_ERROR(find_backend(resolve_backend(options.backend, shape), &backend));
  SP_RETURN_IF_ERROR(backend->can_run(shape, policy));
  return backend->select_into(problem, shape, policy, options, out);
}

struct Plan::State {
  ProblemShape shape;
  Policy policy;
  Backend backend = Backend::kAuto;
  const detail::BackendImpl* impl = nullptr;
  std::unique_ptr<const detail::PreparedRun> prepared;
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
const ExecutionInfo& Plan::execution() const { return state_->prepared->info; }

Status make_plan(const AttentionProblem& problem, const Policy& policy, const RunOptions& options, Plan* plan) {
  if (plan == nullptr) return invalid_argument("plan: expected non-null");
  auto state = std::make_shared<Plan::State>();
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &state->shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, state->shape));
  state->backend = resolve_backend(options.backend, state->shape);
  SP_RETURN_IF_ERROR(find_backend(state->backend, &state->impl));
  SP_RETURN_IF_ERROR(policy_for_backend(policy, state->shape, state->backend, &state->policy));
  std::unique_ptr<detail::PreparedRun> prepared;
  SP_RETURN_IF_ERROR(
      state->impl->plan(problem, state->shape, state->policy, options, /*persistent=*/true, &prepared));
  state->prepared = std::move(prepared);
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
  return run_prepared(*state.impl, *state.prepared, problem, shape, state.policy, output, options, stats, decisions);
}

Status can_run(const AttentionProblem& problem, const Policy& policy, Backend backend) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(validate_problem(problem, nullptr, &shape));
  SP_RETURN_IF_ERROR(validate_policy_for(policy, shape));
  const detail::BackendImpl* impl = nullptr;
  SP_RETURN_IF_ERROR(find_backend(resolve_backend(backend, shape), &impl));
  return impl->can_run(shape, policy);
}

Status check_device_errors(int device) {
  const detail::BackendImpl* cuda = detail::backend_impl(Backend::kCUDA);
  return cuda != nullptr ? cuda->check_errors(device) : Status{};
}

std::string build_info() {
  std::ostringstream os;
  os << "sparseprefill " << SPARSEPREFILL_VERSION_STRING << "\n";
  for (Backend b : {Backend::kReference, Backend::kCPU, Backend::kCUDA}) {
    const detail::BackendImpl* impl = detail::backend_impl(b);
    os << (impl != nullptr ? impl->build_info() : std::string("backend ") + backend_name(b) + ": not compiled\n");
  }
  return os.str();
}

}  // namespace sparseprefill
