// SPDX-License-Identifier: Apache-2.0
// estimate_select on the CPU backend split into its two kernel launches (plan: block means,
// tile scoring, selection; attend: kept blocks plus mean-correction pseudo-tokens) so tests can
// run the second on inputs the first never saw. The decision rules themselves are
// core/rules/*.h. Internal to src/cpu and its tests.
#pragma once

#include <vector>

#include "sparseprefill/attention.h"

namespace sparseprefill::cpu {

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
