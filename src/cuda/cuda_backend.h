// SPDX-License-Identifier: Apache-2.0
// The CUDA backend as the host dispatcher sees it: plain declarations, no CUDA or kernel
// headers (src/core/attention.cpp includes this file only when built with SP_WITH_CUDA).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "sparseprefill/attention.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill::cuda {

// What a Plan (plan.h) keeps on the device: a block_sparse mask compacted and uploaded once,
// and the per-sequence table of the plan's problem with a contiguous output. Owns its device
// memory (freed when the last reference goes). Defined in cuda_backend.cu.
struct PlanState;

// Builds the device state of a plan for (problem, shape, policy); enqueues its uploads on
// options.cuda_stream and waits for them.
Status make_plan_state(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                       const RunOptions& options, std::shared_ptr<const PlanState>* out);

// `shape` is validate_problem's result (index tensors already read on the host). Enqueues on
// options.cuda_stream; fills `decisions` only when it is non-null (that synchronises). With a
// plan's state, its device mask and sequence table replace the per-call uploads.
Status run_cuda(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
                const AttentionOutput& output, const RunOptions& options, Decisions* decisions,
                const PlanState* plan = nullptr);

// estimate_select's GPU selector alone: launches it on options.cuda_stream, copies the device
// mask (and the mean-correction bitmap) back into `decisions` and synchronises.
Status select_cuda(const AttentionProblem& problem, const ProblemShape& shape,
                   const EstimateSelectParams& params, const RunOptions& options, Decisions* decisions);

// Whether a compiled kernel serves this combination; the message lists what is compiled.
Status can_run_cuda(const ProblemShape& shape, const Policy& policy);

// Calibration statistics of a CUDA sample (compute_block_statistics /
// compute_select_statistics, calibration.h); `shape` is validate_problem's result. Enqueues on
// cuda_stream, copies the statistics back and synchronises it.
Status block_statistics_cuda(const AttentionProblem& sample, const ProblemShape& shape, int block_q, int block_k,
                             bool want_max, bool want_g, void* cuda_stream, std::vector<BlockStatistics>* out);
Status select_statistics_cuda(const AttentionProblem& sample, const ProblemShape& shape,
                              const EstimateSelectParams& base, void* cuda_stream, std::vector<SelectStatistics>* out);

// Compiled architectures and kernel variants, one per line.
std::string cuda_build_info();

// Test hooks (tests/cuda), per calling thread: the forward instance the last successful
// run_cuda launched (e.g. "fwd_sm90_bf16_hd128"; "" before any), and a switch that sends every
// call to the portable kernel where the Hopper one would serve it, so that both stay tested on
// an H100/H200 (the GPU suite runs each case on both). Not an option for users: the plan
// (choose_fwd_path) decides.
std::string last_fwd_instance_for_testing();
void set_portable_only_for_testing(bool portable_only);
// The estimate_select selector instance last chosen (e.g. "select_sm90_bf16_hd128"; "" before any).
std::string last_select_instance_for_testing();
// Likewise for paged K/V: whether calls stage it into contiguous rows as plan_kv_staging
// decides (kAuto), always (outside graph capture) or never, and whether the last successful
// run_cuda staged.
enum class KvStagingForTesting { kAuto, kAlways, kNever };
void set_kv_staging_for_testing(KvStagingForTesting mode);
bool last_call_staged_kv_for_testing();
// Query heads per tile of the last forward launch (FwdParams::q_pack: 1, or the group when the
// Hopper kernel packed it).
int last_q_pack_for_testing();
// Passes of the last exact_gate call (choose_gate_passes: 1 or 2; 0 before any), and a
// per-thread override of SPARSEPREFILL_EXACT_GATE_PASSES (1 or 2; 0: the variable, or the plan,
// decides), so that the GPU suite runs both executions on an H100/H200.
int last_gate_passes_for_testing();
void set_gate_passes_for_testing(int passes);

}  // namespace sparseprefill::cuda
