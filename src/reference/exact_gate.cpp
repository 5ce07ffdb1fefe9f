// SPDX-License-Identifier: Apache-2.0
// exact_gate (BSFA) decision rule of the oracle: a full block is kept iff the exact maximum of
// its scores over the valid rows of the query block reaches the threshold.
#include <cmath>
#include <limits>

#include "reference/decide.h"

namespace sparseprefill::ref {
namespace {

// T[h][pos] of an fp32 [h_q, positions] table with any strides.
double threshold_at(const TensorView& table, int h, int pos) {
  const auto* t = static_cast<const float*>(table.data);
  return static_cast<double>(t[h * table.stride[0] + pos * table.stride[1]]);
}

}  // namespace

Status decide_exact_gate(const Sequence& seq, const ProblemShape& shape, const ExactGateParams& p,
                         Decisions* decisions) {
  const geom::BlockGeometry g{seq.geo, p.block_q, p.block_k};
  const int positions = static_cast<int>(p.thresholds.shape[1]);
  for (int h = 0; h < seq.h_q; ++h) {
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
      const double threshold = threshold_at(p.thresholds, h, g.threshold_position(qb, positions));
      for (int kb = 0; kb < g.visible_end(qb); ++kb) {
        // Causal: the partial blocks (the diagonal band) are always computed. Non-causal: every
        // block is full, and the sequence's last key block is always computed so that no row
        // is left empty.
        const bool forced = seq.geo.causal ? !g.is_full(qb, kb) : kb == g.num_k_blocks() - 1;
        bool keep = forced;
        if (!forced) {
          // Every valid row of a full block sees all of its keys, so no element mask here.
          double m = -std::numeric_limits<double>::infinity();
          for (std::int64_t r = g.row_begin(qb); r < g.row_end(qb); ++r) {
            for (std::int64_t t = g.key_begin(kb); t < g.key_end(kb); ++t) {
              m = nan_max(m, seq.score(r, h, t));
            }
          }
          keep = !(m < threshold);  // ties keep, T = -inf keeps, a NaN maximum keeps
        }
        if (keep) SP_RETURN_IF_ERROR(decisions->kept.add(shape, seq.batch, h, qb, kb));
      }
    }
  }
  return {};
}

}  // namespace sparseprefill::ref
