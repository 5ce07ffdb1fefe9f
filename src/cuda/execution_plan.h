// SPDX-License-Identifier: Apache-2.0
// The execution plan of a CUDA call as a value: a pure function from (problem shape, policy,
// device capabilities, overrides) to everything a run executes (path, kernel instances,
// passes, packing, staging, grid, scratch). Host-tested without a GPU; a Plan keeps one, and a
// run re-decides nothing. docs/cuda.md, "Path selection", states the rules.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/plan.h"
#include "cuda/registry.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::cuda {

// What a device is, read once per device (cudaDeviceGetAttribute).
struct DeviceCaps {
  int cc_major = 0;
  int cc_minor = 0;
  std::int64_t l2_bytes = 0;
  int sm_count = 0;
  int smem_optin = 0;  // shared memory a CTA may opt into (bytes); 0: not known, not checked
  bool hopper() const { return cc_major == 9 && cc_minor == 0; }
};

// The environment variables behind ExecutionOverrides (attention.h), each null when unset.
struct OverrideEnv {
  const char* cuda_path = nullptr;    // SPARSEPREFILL_CUDA_PATH: auto | portable | hopper
  const char* pack_gqa = nullptr;     // SPARSEPREFILL_PACK_GQA: auto | always | never
  const char* kv_staging = nullptr;   // SPARSEPREFILL_KV_STAGING: auto | always | never
  const char* gate_passes = nullptr;  // SPARSEPREFILL_EXACT_GATE_PASSES: auto | 1 | 2
};
constexpr const char* kKvStagingEnv = "SPARSEPREFILL_KV_STAGING";

// Parses the variables (unset or empty: auto); an invalid value is an error naming the
// variable and the values it takes.
Status parse_overrides(const OverrideEnv& env, ExecutionOverrides* out);
// `call` over `env`: every field `call` sets (not auto) wins.
ExecutionOverrides merge_overrides(const ExecutionOverrides& env, const ExecutionOverrides& call);

struct ExecutionPlan {
  int block_k = 0;                     // the forward kernel's key block (check_support)
  FwdPath path = FwdPath::kPortable;   // of the forward kernel
  PolicyMode mode = PolicyMode::kDense;  // the forward kernel's mode (exact_gate in two passes: kBlockMask)
  const Fwd90Variant* fwd90 = nullptr;   // path kHopper
  const FwdVariant* fwd = nullptr;       // the portable instance: path kPortable, and the Hopper launch's
                                         // fallback where the driver cannot encode its tensor maps (16-bit)
  const GateVariant* gate = nullptr;         // exact_gate's decision kernel (passes == 2)
  const SelectVariant* select = nullptr;     // estimate_select's selector
  const PermuteVariant* permute = nullptr;   // permute_stop's ranking, sorts and portable attention
  const Permute90Variant* permute90 = nullptr;  // its attention on the Hopper path
  int passes = 1;                      // exact_gate: 2 with a decision kernel ahead of attention
  int gate_heads_per_cta = 1;          // query heads the decision kernel scores per CTA (its Hopper one: >= 1)
  int q_pack = 1;                      // query heads per Hopper tile (choose_q_pack)
  bool kv_major = false;               // kv_major_grid
  bool hopper_forced = false;          // cuda_path = hopper: no fallback at launch
  KvStaging staging;                   // paged K/V copied into rows first (plan_kv_staging)
  std::int64_t grid = 0;               // CTAs of the forward launch
};

// Whether TMA tensor maps can describe the call's tensors (tma_describable, plan.h): q, and
// k and v. Staged K/V are contiguous rows, describable whatever the cache's strides.
struct TmaFacts {
  bool q = false;
  bool kv = false;
};
TmaFacts tma_facts(const AttentionProblem& problem);

// The plan of a call (check_support's errors for what no kernel serves). `free_bytes`: the
// device's free memory, read only for paged K/V (staging). kUnsupported when an override
// forces a path the call cannot take; the other overrides apply where they can (docs/cuda.md).
Status plan_execution(const ProblemShape& shape, const Policy& policy, const TmaFacts& tma, const DeviceCaps& caps,
                      const ExecutionOverrides& overrides, std::size_t free_bytes, ExecutionPlan* out);

// estimate_select's selector instance (its scoring on wgmma on a 9.0 device unless the
// portable path is forced), for calls and for calibration statistics alike.
const SelectVariant* choose_selector(const ProblemShape& shape, const DeviceCaps& caps,
                                     const ExecutionOverrides& overrides);
// kUnsupported when the selector's CTA (a Q tile, two chunks of k̄, λ per key block of `block`
// keys) needs more shared memory than the device offers (d = 256 on sm_86 / sm_89, or very long
// calls there); caps.smem_optin 0: not checked.
Status check_selector_smem(const SelectVariant& select, const ProblemShape& shape, int block, const DeviceCaps& caps);

// Its summary for users (Plan::execution, RunStats::execution). `scratch_bytes` is the run's.
ExecutionInfo execution_info(const ExecutionPlan& plan, std::size_t scratch_bytes);

// CTAs of the forward launches (the launch functions compute the same from FwdParams): the
// portable kernel one per (query block, batch, query head); the Hopper kernel one per
// (tile of 128 / q_pack positions, batch, unit of q_pack heads) over the longest sequence.
std::int64_t portable_grid(const ProblemShape& shape);
std::int64_t hopper_grid(const ProblemShape& shape, int q_pack);

}  // namespace sparseprefill::cuda
