// SPDX-License-Identifier: Apache-2.0
// plan_execution (execution_plan.h): the rules of plan.h combined once per plan.
#include "cuda/execution_plan.h"

#include <string>
#include <variant>

#include "core/geometry.h"

namespace sparseprefill::cuda {
namespace {

// The staging choice's own variable: auto, always or never.
Status kv_staging_mode(const char* env_value, ExecutionOverrides::Choice* mode) {
  const std::string v = env_value == nullptr ? std::string() : std::string(env_value);
  if (v.empty() || v == "auto") {
    *mode = ExecutionOverrides::Choice::kAuto;
  } else if (v == "always") {
    *mode = ExecutionOverrides::Choice::kAlways;
  } else if (v == "never") {
    *mode = ExecutionOverrides::Choice::kNever;
  } else {
    return invalid_argument(std::string(kKvStagingEnv) + ": expected \"auto\", \"always\" or \"never\" (or unset), got \"" +
                            v + "\"");
  }
  return {};
}

GatePasses gate_passes_of(int passes) {
  return passes == 1 ? GatePasses::kOne : passes == 2 ? GatePasses::kTwo : GatePasses::kAuto;
}

const char* path_name(FwdPath path) { return path == FwdPath::kHopper ? "cuda-hopper" : "cuda-portable"; }

// Why the Hopper forward kernel cannot serve a call that choose_fwd_path sends to the portable
// one (for the error of a forced cuda_path = hopper).
std::string not_hopper_reason(const ProblemShape& shape, const Policy& policy, bool tma_ok, const DeviceCaps& caps) {
  if (!caps.hopper()) {
    return "the device has compute capability " + std::to_string(caps.cc_major) + "." + std::to_string(caps.cc_minor) +
           " (the Hopper kernels need 9.0)";
  }
  if (!tma_ok) return "q, k or v has strides that TMA cannot describe (multiples of 16 bytes below 2^40)";
  if (find_fwd90(shape.dtype, shape.d, shape.d_v, shape.kv_layout == KvLayout::kPaged) == nullptr) {
    return std::string("no Hopper instance is compiled for ") + dtype_name(shape.dtype) + " head_dim " +
           std::to_string(shape.d) + (shape.d_v != shape.d ? " head_dim_v " + std::to_string(shape.d_v) : "") +
           (shape.kv_layout == KvLayout::kPaged ? " with paged K/V" : "");
  }
  if (std::holds_alternative<PermuteStopParams>(policy) && find_permute90(shape.dtype, shape.d) == nullptr) {
    return std::string("no Hopper permute_stop instance is compiled for ") + dtype_name(shape.dtype) + " head_dim " +
           std::to_string(shape.d);
  }
  return "the policy's key blocks are not the Hopper kernel's 128 keys (or permute_stop over paged K/V)";
}

}  // namespace

Status parse_overrides(const OverrideEnv& env, ExecutionOverrides* out) {
  ExecutionOverrides o;
  SP_RETURN_IF_ERROR(cuda_path_mode(env.cuda_path, &o.cuda_path));
  SP_RETURN_IF_ERROR(pack_gqa_mode(env.pack_gqa, &o.pack_gqa));
  SP_RETURN_IF_ERROR(kv_staging_mode(env.kv_staging, &o.kv_staging));
  GatePasses passes = GatePasses::kAuto;
  SP_RETURN_IF_ERROR(gate_passes_mode(env.gate_passes, &passes));
  o.gate_passes = passes == GatePasses::kOne ? 1 : passes == GatePasses::kTwo ? 2 : 0;
  *out = o;
  return {};
}

ExecutionOverrides merge_overrides(const ExecutionOverrides& env, const ExecutionOverrides& call) {
  ExecutionOverrides o = env;
  if (call.cuda_path != ExecutionOverrides::CudaPath::kAuto) o.cuda_path = call.cuda_path;
  if (call.pack_gqa != ExecutionOverrides::Choice::kAuto) o.pack_gqa = call.pack_gqa;
  if (call.kv_staging != ExecutionOverrides::Choice::kAuto) o.kv_staging = call.kv_staging;
  if (call.gate_passes != 0) o.gate_passes = call.gate_passes;
  return o;
}

const SelectVariant* choose_selector(const ProblemShape& shape, const DeviceCaps& caps,
                                     const ExecutionOverrides& overrides) {
  const bool hopper = caps.hopper() && overrides.cuda_path != ExecutionOverrides::CudaPath::kPortable;
  const SelectVariant* s90 = hopper && shape.d_v == shape.d ? find_select90(shape.dtype, shape.d) : nullptr;
  return s90 != nullptr ? s90 : find_select(shape.dtype, shape.d, shape.d_v);
}

namespace {

// "" when a CTA of `bytes` shared memory fits the device (or its limit is not known: 0), else
// "NAME needs BYTES bytes of shared memory per CTA<at>; this device (compute capability X.Y)
// offers LIMIT" for a refusal.
std::string smem_shortfall(const char* name, std::size_t bytes, const std::string& at, const DeviceCaps& caps) {
  if (caps.smem_optin <= 0 || bytes <= static_cast<std::size_t>(caps.smem_optin)) return {};
  return std::string(name) + " needs " + std::to_string(bytes) + " bytes of shared memory per CTA" + at +
         "; this device (compute capability " + std::to_string(caps.cc_major) + "." + std::to_string(caps.cc_minor) +
         ") offers " + std::to_string(caps.smem_optin);
}

}  // namespace

Status check_selector_smem(const SelectVariant& select, const ProblemShape& shape, int block, const DeviceCaps& caps) {
  const int num_k_blocks = static_cast<int>(geom::ceil_div(shape.max_seq_k(), block));
  const std::string shortfall = smem_shortfall(select.name, select.smem_bytes(num_k_blocks),
                                               " at " + std::to_string(num_k_blocks) + " key blocks", caps);
  if (shortfall.empty()) return {};
  return unsupported("estimate_select: " + shortfall + "; the reference and cpu backends run it");
}

TmaFacts tma_facts(const AttentionProblem& problem) {
  return {tma_describable(problem.q), tma_describable(problem.k) && tma_describable(problem.v)};
}

std::int64_t portable_grid(const ProblemShape& shape) {
  return geom::ceil_div(shape.max_seq_q(), kBlockQ) * shape.batch * shape.h_q;
}

std::int64_t hopper_grid(const ProblemShape& shape, int q_pack) {
  return geom::ceil_div(shape.max_seq_q(), kBlockQ / q_pack) * shape.batch * (shape.h_q / q_pack);
}

Status plan_execution(const ProblemShape& shape, const Policy& policy, const TmaFacts& tma, const DeviceCaps& caps,
                      const ExecutionOverrides& overrides, std::size_t free_bytes, ExecutionPlan* out) {
  if (overrides.gate_passes < 0 || overrides.gate_passes > 2) {
    return invalid_argument("overrides.gate_passes: expected 0 (auto), 1 or 2, got " +
                            std::to_string(overrides.gate_passes));
  }
  ExecutionPlan plan;
  SP_RETURN_IF_ERROR(check_support(shape, policy, &plan.block_k));
  using CudaPath = ExecutionOverrides::CudaPath;
  using Choice = ExecutionOverrides::Choice;

  // Staging first: a staged call reads contiguous rows ([Σ s_k, h_kv, d], TMA-describable),
  // and every choice below is the staged call's.
  if (shape.kv_layout == KvLayout::kPaged && overrides.kv_staging != Choice::kNever) {
    plan.staging = plan_kv_staging(shape, policy, free_bytes);
    if (overrides.kv_staging == Choice::kAlways) plan.staging.stage = plan.staging.rows > 0 && shape.batch <= 65535;
  }
  const ProblemShape read = plan.staging.stage ? staged_shape(shape, plan.staging) : shape;
  const bool tma_ok = tma.q && (plan.staging.stage || tma.kv);
  const bool reads_pages = read.kv_layout == KvLayout::kPaged;

  const FwdPath natural = choose_fwd_path(read, policy, tma_ok, caps.cc_major, caps.cc_minor);
  plan.hopper_forced = overrides.cuda_path == CudaPath::kHopper;
  if (plan.hopper_forced && natural != FwdPath::kHopper) {
    return unsupported(std::string(kPathEnv) + " (or overrides.cuda_path) = hopper, but the Hopper kernels cannot serve " +
                       "this call: " + not_hopper_reason(read, policy, tma_ok, caps));
  }
  plan.path = overrides.cuda_path == CudaPath::kPortable ? FwdPath::kPortable : natural;
  const bool hopper = plan.path == FwdPath::kHopper;
  const bool fp8 = shape.dtype == DType::kFP8E4M3;
  if (fp8 && !hopper) {
    return unsupported("q: fp8_e4m3 inputs run on the Hopper kernel only: a compute capability 9.0 device (this one is " +
                       std::to_string(caps.cc_major) + "." + std::to_string(caps.cc_minor) +
                       ") and q, k, v whose rows and strides are multiples of 16 bytes" +
                       (overrides.cuda_path == CudaPath::kPortable
                            ? std::string(", and ") + kPathEnv + " (or overrides.cuda_path) = portable sends every "
                              "call to the portable kernels"
                            : std::string()));
  }

  bool mask_per_kv_head = false, mean_correction = false;
  if (const auto* es = std::get_if<EstimateSelectParams>(&policy)) {
    mask_per_kv_head = es->pack_gqa;
    mean_correction = es->mean_correction;
    plan.select = choose_selector(shape, caps, overrides);
    SP_RETURN_IF_ERROR(check_selector_smem(*plan.select, shape, es->block, caps));
    plan.mode = PolicyMode::kBlockMask;
  } else if (const auto* bs = std::get_if<BlockSparseParams>(&policy)) {
    mask_per_kv_head = bs->per_kv_head();
    plan.mode = PolicyMode::kBlockMask;
  } else if (std::holds_alternative<ExactGateParams>(policy)) {
    // The decision kernel of two passes: the Hopper one where compiled (head dims 64 and 128),
    // else the portable one; either writes the block mask both forward kernels read.
    const GateVariant* gate90 = hopper ? find_gate90(shape.dtype, shape.d) : nullptr;
    const GateVariant* gate = gate90 != nullptr ? gate90 : find_gate(shape.dtype, shape.d);
    const bool two = choose_gate_passes(read, gate != nullptr, gate_passes_of(overrides.gate_passes));
    plan.gate = two ? gate : nullptr;
    plan.gate_heads_per_cta = two && gate90 != nullptr ? gate_heads_per_cta(shape.group()) : 1;
    plan.passes = two ? 2 : 1;
    plan.mode = two ? PolicyMode::kBlockMask : PolicyMode::kExactGate;
  } else if (std::holds_alternative<SoftmaxSkipParams>(policy)) {
    plan.mode = PolicyMode::kSoftmaxSkip;
  } else if (const auto* ps = std::get_if<PermuteStopParams>(&policy)) {
    plan.permute = find_permute(shape.dtype, shape.d);
    plan.permute90 = hopper ? find_permute90(shape.dtype, shape.d) : nullptr;
    PermuteLayout layout;
    SP_RETURN_IF_ERROR(permute_layout(shape, *ps, &layout));
    plan.grid = std::int64_t{layout.max_segments} * layout.tiles_per_segment * shape.batch * shape.h_q;
    *out = std::move(plan);
    return {};
  }

  if (!fp8) {
    // The portable instance (also the Hopper launch's fallback): gated or not, plain or not.
    const bool gated = gated_mode(plan.mode);
    const bool plain = !gated && !reads_pages && !(plan.mode == PolicyMode::kBlockMask && mean_correction);
    plan.fwd = find_fwd(shape.dtype, shape.d, shape.d_v, gated, plain);
    if (plan.fwd == nullptr) {
      return unsupported(std::string("no compiled portable CUDA kernel for this call (") + support_summary() + ")");
    }
    const auto fwd_smem = static_cast<std::size_t>(*plan.fwd->smem_bytes);
    const std::string shortfall = hopper ? std::string() : smem_shortfall(plan.fwd->name, fwd_smem, "", caps);
    if (!shortfall.empty()) {
      return unsupported(shortfall + ": head_dim " + std::to_string(shape.d) +
                         " runs where a CTA may hold that much (A100: 166912 bytes, H100 and H200: 232448); the "
                         "reference and cpu backends run it");
    }
  }
  if (hopper) {
    plan.fwd90 = find_fwd90(shape.dtype, shape.d, shape.d_v, reads_pages);
    plan.q_pack = choose_q_pack(shape, plan.mode, mask_per_kv_head, overrides.pack_gqa);
  }
  plan.kv_major = kv_major_grid(shape, caps.l2_bytes);
  plan.grid = hopper ? hopper_grid(shape, plan.q_pack) : portable_grid(shape);
  // One launch holds at most 2^31 - 1 CTAs (and the portable fallback needs its own count).
  constexpr std::int64_t kMaxCtas = 2147483647;
  if (plan.grid > kMaxCtas || portable_grid(shape) > kMaxCtas) {
    return unsupported("q: the call needs " + std::to_string(portable_grid(shape)) +
                       " CTAs (query blocks x batch x query heads), more than one launch holds (2^31 - 1)");
  }
  *out = std::move(plan);
  return {};
}

ExecutionInfo execution_info(const ExecutionPlan& plan, std::size_t scratch_bytes) {
  ExecutionInfo info;
  info.backend = Backend::kCUDA;
  info.path = path_name(plan.path);
  if (plan.permute != nullptr) {
    info.instance = plan.permute90 != nullptr ? plan.permute90->name : plan.permute->name;
  } else if (plan.path == FwdPath::kHopper) {
    info.instance = plan.fwd90->name;
  } else {
    info.instance = plan.fwd->name;
  }
  if (plan.gate != nullptr) info.decision_instance = plan.gate->name;
  if (plan.select != nullptr) info.decision_instance = plan.select->name;
  info.passes = plan.passes;
  info.q_pack = plan.q_pack;
  info.kv_staged = plan.staging.stage;
  info.kv_major = plan.kv_major;
  info.scratch_bytes = scratch_bytes;
  info.grid = plan.grid;
  return info;
}

}  // namespace sparseprefill::cuda
