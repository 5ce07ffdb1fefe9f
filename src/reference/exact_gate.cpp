// SPDX-License-Identifier: Apache-2.0
// exact_gate (BSFA) decision rule of the oracle: a gated block is kept iff the exact maximum of
// its scores over the valid rows of the query block reaches the threshold (core/rules/exact_gate.h).
#include <limits>

#include "core/rules/exact_gate.h"
#include "core/rules/nan_max.h"
#include "reference/decide.h"

namespace sparseprefill::ref {

Status decide_exact_gate(const Sequence& seq, const ProblemShape& shape, const ExactGateParams& p,
                         Decisions* decisions) {
  const geom::BlockGeometry g{seq.geo, p.block_q, p.block_k};
  const int positions = static_cast<int>(p.thresholds.shape[1]);
  const auto* table = static_cast<const float*>(p.thresholds.data);
  for (int h = 0; h < seq.h_q; ++h) {
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
      const double threshold = rules::gate_threshold(table, p.thresholds.stride[0], p.thresholds.stride[1], positions, g, h, qb);
      for (int kb = g.visible_begin(qb); kb < g.visible_end(qb); ++kb) {
        bool keep = true;  // the blocks that are not gated are always computed
        if (rules::gate_gated(g, qb, kb)) {
          // Every valid row of a gated block sees all of its keys, so no element mask here.
          double m = -std::numeric_limits<double>::infinity();
          for (std::int64_t r = g.row_begin(qb); r < g.row_end(qb); ++r) {
            for (std::int64_t t = g.key_begin(kb); t < g.key_end(kb); ++t) {
              m = rules::nan_max(m, seq.score(r, h, t));
            }
          }
          keep = rules::gate_keeps(m, threshold);
        }
        if (keep) SP_RETURN_IF_ERROR(decisions->kept.add(shape, seq.batch, h, qb, kb));
      }
    }
  }
  return {};
}

}  // namespace sparseprefill::ref
