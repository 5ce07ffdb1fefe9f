// SPDX-License-Identifier: Apache-2.0
// Select, plan, run: the three steps of run() (attention.h) as separate calls, for callers that
// want a policy's selection on its own, or that run one problem shape many times (serving: a
// block_sparse mask validated and compacted once, not on every call).
#pragma once

#include <memory>

#include "sparseprefill/attention.h"

namespace sparseprefill {

// Runs the policy's selector alone (no attention) and returns what it selected in
// `decisions` (kept, and corrected with mean correction) and, when `stats` is non-null, the
// work that attending with it would do (RunStats::density() is kept / visible blocks):
//   dense            every visible block, as a 128 x 128 BlockMask
//   block_sparse     its own mask (validated against the problem)
//   estimate_select  the selector's mask: the oracle's (reference), the CPU backend's, or the
//                    GPU selector's device mask copied back (cuda; synchronises the stream)
// exact_gate and softmax_skip decide inside the attention kernel, and permute_stop stops its
// ranked walk where attention says so: no selection exists before attention, so select()
// returns kUnsupported for them; their decisions come from run(..., decisions).
// estimate_select with a cache of block means attached writes the means of the blocks the call
// completes into it, as run() does: this is also how a caller (re)computes the means of blocks
// valid .. s_k / block - 1 from K/V it filled otherwise (set block_means_valid to the first
// block to compute; one query row per sequence suffices).
Status select(const AttentionProblem& problem, const Policy& policy, const RunOptions& options,
              Decisions* decisions, RunStats* stats = nullptr);

// select() into the caller's tensors on the device, in FlexAttention's form, enqueued on
// options.cuda_stream with no synchronisation (capturable): estimate_select's selection — the
// blocks attention with it would visit — lands in out.partial_* (Flex's kv_num_blocks /
// kv_indices: the blocks the causal mask cuts) and out.full_* (full_kv_*), int32 and contiguous,
// counts [batch, units, q_blocks] and indices [batch, units, q_blocks, k_blocks] (units = h_q,
// or h_kv with pack_gqa = out.per_kv_head; blocks of 128: q_blocks = ceil(max s_q / 128),
// k_blocks = ceil(max s_k / 128)); entries past a row's count are left undefined. `out` can then
// be run as block_sparse (BlockSparseParams::device_mask) or handed to FlexAttention. CUDA
// tensors only; a cache of block means is updated as select() updates it.
Status select_into(const AttentionProblem& problem, const Policy& policy, const RunOptions& options,
                   const DeviceBlockMask& out);

// A problem shape and a policy checked once, for many run() calls: the policy is validated
// against the shape (a block_sparse mask: O(rows + selected blocks)), the backend resolved,
// and on CUDA a block_sparse mask is compacted and uploaded into device memory the plan owns,
// with the per-sequence table of contiguous outputs. Immutable once made; copies share the
// same state, and several threads may run with one plan at once. Attachments the policy only
// views (exact_gate's threshold table) must outlive the plan.
class Plan {
 public:
  struct State;  // internal (src/core/attention.cpp)

  Plan();
  ~Plan();
  Plan(const Plan&);
  Plan& operator=(const Plan&);
  Plan(Plan&&) noexcept;
  Plan& operator=(Plan&&) noexcept;

  bool valid() const { return state_ != nullptr; }
  const ProblemShape& shape() const;  // requires valid()
  const Policy& policy() const;       // requires valid()
  Backend backend() const;            // resolved (never kAuto); requires valid()
  // What each run of the plan executes (path, kernel instances, passes, packing, staging,
  // scratch, grid), decided once when the plan was made; requires valid().
  const ExecutionInfo& execution() const;

 private:
  friend Status make_plan(const AttentionProblem&, const Policy&, const RunOptions&, Plan*);
  friend Status run(const Plan&, const AttentionProblem&, const AttentionOutput&, const RunOptions&,
                    RunStats*, Decisions*);
  std::shared_ptr<const State> state_;
};

// Builds a plan for problems shaped like `problem` (its tensors' shapes, layout, sequence
// lengths, dtype and device; their data is not read). options.backend picks the backend,
// options.cuda_stream orders the uploads (the plan is ready when make_plan returns).
Status make_plan(const AttentionProblem& problem, const Policy& policy, const RunOptions& options,
                 Plan* plan);

// run() with a plan: the problem must have the plan's shape (every field of ProblemShape
// except the scale; an error names the first difference), options.backend must be kAuto or the
// plan's backend. Skips the policy's validation and, on CUDA, the mask's compaction and upload;
// a captured CUDA graph may contain the call without an earlier warm-up call of its shape when
// its output is contiguous in q's layout and the path is the portable one (the Hopper dense
// path still caches its tensor maps on a first uncaptured call: docs/cuda.md).
Status run(const Plan& plan, const AttentionProblem& problem, const AttentionOutput& output,
           const RunOptions& options = {}, RunStats* stats = nullptr, Decisions* decisions = nullptr);

}  // namespace sparseprefill
