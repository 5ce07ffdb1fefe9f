// SPDX-License-Identifier: Apache-2.0
// softmax_skip's (BLASST's) rules (docs/semantics.md §3.4), shared by the oracle, the CPU
// backend and the calibration (statistics and SoftmaxSkipCalibrator); SP_HD, so that kernels
// may include it: the visit order, λ and when skipping is on, and each row's vote on a block.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "core/geometry.h"

namespace sparseprefill::rules {

// The blocks query block qb visits: its visible blocks.
SP_HD int blasst_visits(const geom::BlockGeometry& g, int qb) { return g.visible_end(qb) - g.visible_begin(qb); }

// The block of query block qb visited `visit`-th (0 <= visit < blasst_visits): the partial
// blocks first, then the full blocks, each group in descending index. The partial blocks are
// the band above the full blocks (the diagonal) and, under a left window bound, the band below
// them (the window's edge): the upper band, the lower band, then the full blocks, each
// descending. Without a window this is every visible block in descending order.
SP_HD int blasst_block(const geom::BlockGeometry& g, int qb, int visit) {
  const int upper = g.visible_end(qb) - g.full_end(qb);
  const int lower = g.full_begin(qb) - g.visible_begin(qb);
  if (visit < upper) return g.visible_end(qb) - 1 - visit;
  if (visit < upper + lower) return g.full_begin(qb) - 1 - (visit - upper);
  return g.full_end(qb) - 1 - (visit - upper - lower);
}

// Every visible block of qb in visit order (host).
inline std::vector<int> blasst_order(const geom::BlockGeometry& g, int qb) {
  std::vector<int> order(static_cast<std::size_t>(blasst_visits(g, qb)));
  for (int v = 0; v < blasst_visits(g, qb); ++v) order[static_cast<std::size_t>(v)] = blasst_block(g, qb, v);
  return order;
}

// λ = a / s_k of one sequence (s_k its keys, whatever a local window shows a row). With s_k < a,
// λ > 1 and the rule would skip blocks that raise the running maximum: skipping is off there
// (TensorRT-LLM's XQA reference). When on, the first visited block is never skipped.
struct SkipRule {
  bool on = false;
  double ln_lambda = 0.0;
  // Whether the visit-th visited block is decided by the rows' votes (otherwise kept).
  SP_HD bool gates(int visit) const { return on && visit > 0; }
};
SP_HD SkipRule skip_rule(std::int64_t s_k, double a) {
  const double n = static_cast<double>(s_k);
  return {!(n < a), std::log(a / n)};
}

// One row's say on the current block, from whether it sees a key of the block, whether it has
// seen a key of a kept block before, the maximum score over the block's keys it sees
// (row_max) and over the kept blocks' keys so far (m_run):
//   +inf when its first keys are here (never skipped); -inf when it sees none of the block
//   after seeing some (it skips); otherwise row_max - m_run (NaN when either is NaN).
// A row that sees nothing here and has seen nothing has no say (skip_vote: kIgnore).
SP_HD double skip_margin(bool sees_block, bool seen_before, double row_max, double m_run) {
  if (!seen_before) return std::numeric_limits<double>::infinity();
  if (!sees_block) return -std::numeric_limits<double>::infinity();
  return row_max - m_run;
}

enum class RowVote : std::uint8_t {
  kIgnore,  // sees no key of the block and has seen none before
  kSkip,    // margin < ln λ (strict)
  kKeep,    // anything else: first keys of the row, a maximum close enough to m_run, NaN
};
// The block is skipped iff every row that is not ignored votes kSkip.
SP_HD RowVote skip_vote(bool sees_block, bool seen_before, double row_max, double m_run, double ln_lambda) {
  if (!sees_block && !seen_before) return RowVote::kIgnore;
  // NaN fails the strict comparison: the row keeps.
  return skip_margin(sees_block, seen_before, row_max, m_run) < ln_lambda ? RowVote::kSkip : RowVote::kKeep;
}

}  // namespace sparseprefill::rules
