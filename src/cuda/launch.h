// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's host files and what they share: one file per launch sequence (the
// forward call, estimate_select's means + selector + attention, exact_gate's two passes,
// permute_stop's ranking + sorts + attention, paged K/V staging, calibration statistics).
// Internal to src/cuda; no kernel header.
#pragma once

#include <memory>
#include <vector>

#include "cuda/execution_plan.h"
#include "cuda/plan.h"
#include "cuda/registry.h"
#include "cuda/runtime.h"

namespace sparseprefill::cuda {

// What a Plan keeps on the device (make_plan): a block_sparse mask compacted and uploaded
// once, and the per-sequence table of the plan's problem with a contiguous output. Owns its
// device memory (freed when the last reference goes).
struct PlanState {
  int device = 0;
  std::vector<void*> owned;  // cudaMalloc'd, freed with the state
  bool has_mask = false;     // block_sparse: the compacted mask below
  const std::int32_t* full_count = nullptr;
  const std::int32_t* partial_count = nullptr;
  const std::int64_t* full_start = nullptr;
  const std::int64_t* partial_start = nullptr;
  const std::int32_t* full_index = nullptr;
  const std::int32_t* partial_index = nullptr;
  std::vector<SeqInfo> seqs_host;  // the table of a contiguous output ...
  const SeqInfo* seqs = nullptr;   // ... and its device copy

  PlanState() = default;
  PlanState(const PlanState&) = delete;
  PlanState& operator=(const PlanState&) = delete;
  ~PlanState();

  // A device copy of host[0, count) owned by the state; null for an empty vector.
  template <class T>
  Status copy(const std::vector<T>& host, cudaStream_t stream, const T** out) {
    const void* dev = nullptr;
    SP_RETURN_IF_ERROR(copy_bytes(host.data(), host.size() * sizeof(T), stream, &dev));
    *out = static_cast<const T*>(dev);
    return {};
  }
  Status copy_bytes(const void* host, std::size_t bytes, cudaStream_t stream, const void** out);
};

// Builds the device state of a plan (uploads enqueued on `stream`, complete on return).
Status make_plan_state(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                       const ExecutionPlan& plan, cudaStream_t stream, std::shared_ptr<const PlanState>* out);

// One call on the device, after its checks: the call's stream, scratch, and plan.
struct Call {
  const ExecutionPlan& plan;
  Scratch& scratch;
  cudaStream_t stream;
  const PlanState* state;  // a Plan's device state, or null
};

// The forward call of a checked problem with K/V as the kernels read them (staged K/V: varlen
// rows in transient buffers whose addresses need not repeat, so `cache_maps` false keeps their
// Hopper tensor maps out of the metadata cache). Fills `decisions` when non-null (that
// synchronises the stream); `ran` receives the instance that ran.
Status run_forward(const Call& call, const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                   const AttentionOutput& output, bool cache_maps, Decisions* decisions, ExecutionInfo* ran);

// The sequence table and, for paged K/V, the compact block table of a call on the device
// (`planned`: a plan's copy of the same table, used instead). *table: the block table's host
// copy (the Hopper kernel's tensor maps need it).
Status upload_metadata(const AttentionProblem& problem, const ProblemShape& shape, const std::vector<SeqInfo>& seqs,
                       const SeqInfo* planned, Scratch* scratch, FwdParams* p, std::vector<std::int32_t>* table);

// The Hopper instance's tensor maps of (problem, seqs) put into the metadata cache now, so that
// a captured first run of a plan finds them there (large batches only: small ones pass their
// maps as kernel parameters).
Status cache_hopper_maps(const AttentionProblem& problem, const ProblemShape& shape, const ExecutionPlan& plan,
                         const std::vector<SeqInfo>& seqs, cudaStream_t stream);

// ---- estimate_select (estimate_select.cpp)

// The selector's device outputs for one call (SelectParams' output fields).
struct Selection {
  SelectParams sp{};
  std::size_t rows = 0;  // batch * units * num_q_blocks, units = h_kv with pack_gqa, else h_q
};
// The selector's block means in scratch: sp->k_mean [batch, h_kv, num_k_blocks, d] and sp->v_mean
// [.., d_v], in the input dtype (16-bit; bf16 for e4m3 inputs); sp->num_k_blocks must be set.
Status alloc_block_means(const ProblemShape& shape, Scratch* scratch, SelectParams* sp);
// Fills sel->sp from the call's parameters `p` (tensors, strides, sequence table) and `pol`,
// allocates the selector's outputs and launches the block means then the selector.
// `into`: the caller's tensors receive the mask (select_into) instead of scratch.
Status launch_selection(const Call& call, const ProblemShape& shape, const FwdParams& p,
                        const EstimateSelectParams& pol, Selection* sel, const DeviceBlockMask* into);
// Copies a launched selection back into `out` (kept, and corrected with mean correction);
// synchronises the stream.
Status read_selection(const Call& call, const ProblemShape& shape, const EstimateSelectParams& es, const Selection& sel,
                      Decisions* out);
// select_into() on CUDA: the selector alone, writing the caller's tensors (no synchronisation).
Status select_into_cuda(const AttentionProblem& problem, const ProblemShape& shape, const EstimateSelectParams& params,
                        const ExecutionPlan& plan, void* cuda_stream, const DeviceBlockMask& out);
// select() on CUDA: the selector alone, its mask copied back.
Status select_cuda(const AttentionProblem& problem, const ProblemShape& shape, const EstimateSelectParams& params,
                   const ExecutionPlan& plan, void* cuda_stream, Decisions* decisions);

// ---- block_sparse with a mask read in place (block_sparse.cpp)

// Launches the check of `mask` (kernel/mask_check.cuh) for the forward call `p` and turns `p`
// into the block-mask call over the rows it accepts. kept_bits non-null: the accepted blocks
// also go to a zeroed bitmap [rows, words] (*kept_bits, *kept_words entries) for decisions.
Status launch_mask_check(const Call& call, const ProblemShape& shape, const DeviceBlockMask& mask, FwdParams* p,
                         std::uint32_t** kept_bits, std::size_t* kept_words);

// ---- exact_gate (exact_gate.cpp)

// exact_gate's first pass: launches the plan's decision kernel for the forward call `p`
// (mode kExactGate; it writes the kept bitmap if p->kept_bits is set) and turns `p` into the
// block-mask call over the rows it writes.
Status launch_gate_decisions(const Call& call, const ProblemShape& shape, FwdParams* p);

// ---- permute_stop (permute_stop.cpp)

// Ranking, sorts and attention enqueued on the call's stream (no synchronisation); decisions
// copied back only when requested.
Status run_permute_stop(const Call& call, const ProblemShape& shape, const PermuteStopParams& pol, const FwdParams& fwd,
                        Decisions* decisions, ExecutionInfo* ran);

// ---- paged K/V (paged.cpp)

// Paged K/V copied into contiguous varlen rows from `buffers` (kernel/stage_kv.cuh): *staged
// is `problem` with k and v viewing them, [staging.rows, h_kv, d].
Status stage_kv_rows(const AttentionProblem& problem, const ProblemShape& shape, const KvStaging& staging,
                     const AttentionOutput& output, Scratch* buffers, cudaStream_t stream, AttentionProblem* staged);

// ---- calibration statistics (statistics.cpp)

Status block_statistics_cuda(const AttentionProblem& sample, const ProblemShape& shape, int block_q, int block_k,
                             bool want_max, bool want_g, void* cuda_stream, std::vector<BlockStatistics>* out);
// `select`: the selector instance calls of this shape run (choose_selector).
Status select_statistics_cuda(const AttentionProblem& sample, const ProblemShape& shape,
                              const EstimateSelectParams& base, const SelectVariant* select, void* cuda_stream,
                              std::vector<SelectStatistics>* out);

}  // namespace sparseprefill::cuda
