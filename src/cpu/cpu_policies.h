// SPDX-License-Identifier: Apache-2.0
// The CPU backend's decision rules as pure functions (DESIGN.md §3), and estimate_select split
// into its two kernel launches (plan: block means, tile scoring, selection; attend: kept blocks
// plus mean-correction pseudo-tokens) so tests can run the second on inputs the first never saw.
// Internal to src/cpu and its tests.
#pragma once

#include <cstdint>
#include <vector>

#include "sparseprefill/attention.h"

namespace sparseprefill::cpu {

// exact_gate: keep a full block iff its tile max m is not below T. Ties keep, T = -inf keeps,
// a NaN m keeps (the comparison is written so that NaN fails "m < T").
inline bool gate_keeps(float tile_max, float threshold) { return !(tile_max < threshold); }

// softmax_skip, one row's vote on a block.
enum class RowVote : std::uint8_t {
  kIgnore,  // sees no key of the block and has seen none before
  kSkip,    // tile_rowmax - m_run < ln λ, or sees no key of the block after seeing some
  kKeep,    // anything else: first keys of the row, or a maximum close enough to m_run; NaN
};
RowVote skip_vote(bool sees_block, bool seen_before, float row_max, float m_run, double ln_lambda);

// estimate_select: the keep rule of one key block j for a query tile whose valid rows sit at
// absolute positions a_first .. a_last (possibly negative when s_q > s_k); `tail`: the tile is
// one of the tail tiles (geom::BlockGeometry::is_tail_block). `scored` = j < A
// (A = (a_last + 1) / B); energy/peak are E_j and max_{j' < A} E_j' (ignored when !scored).
struct EstimateTile {
  std::int64_t a_first = 0;
  std::int64_t a_last = 0;
  bool tail = false;
};
int estimate_scored_blocks(const EstimateTile& t, int block);  // A, clamped at 0
bool estimate_keeps(const EstimateSelectParams& p, const EstimateTile& t, int j, double energy,
                    double peak);

// Indices 0 .. n-1 by key descending, ties (and equal NaNs) by lower index first. NaN keys rank
// after every number: the order stays a strict weak order whatever the inputs.
std::vector<std::int32_t> order_descending(const std::vector<double>& key);

// estimate_select, first launch: everything the attention pass needs besides K/V of the kept
// blocks. Means are per sequence [h_kv, num_blocks, d] fp32, accumulated in fp64 then rounded to
// the input dtype (what the GPU stores).
struct EstimatePlan {
  BlockMask kept;       // per query head, or per KV head with pack_gqa
  BlockMask corrected;  // same geometry; filled only with mean_correction
  std::vector<std::vector<float>> k_mean;  // [b] -> [h_kv, nkb, d]
  std::vector<std::vector<float>> v_mean;  // [b] -> [h_kv, nkb, d]; with mean_correction or a cache
};
Status estimate_select_plan(const AttentionProblem& problem, const ProblemShape& shape,
                            const EstimateSelectParams& params, int num_threads,
                            EstimatePlan* plan);
// Second launch: reads K/V only of plan.kept's blocks (the means stand in for corrected ones).
Status estimate_select_attend(const AttentionProblem& problem, const ProblemShape& shape,
                              const EstimateSelectParams& params, const EstimatePlan& plan,
                              const AttentionOutput& output, int num_threads);

}  // namespace sparseprefill::cpu
