// SPDX-License-Identifier: Apache-2.0
// softmax_skip (BLASST) decision rule of the oracle. The rule depends on the visit order (the
// running max only sees blocks visited earlier), so the order is part of the semantics:
// partial blocks, then full blocks, each group in descending index (rules::blasst_block).
#include <limits>
#include <vector>

#include "core/rules/nan_max.h"
#include "core/rules/softmax_skip.h"
#include "reference/decide.h"

namespace sparseprefill::ref {

Status decide_softmax_skip(const Sequence& seq, const ProblemShape& shape,
                           const SoftmaxSkipParams& p, Decisions* decisions) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const geom::BlockGeometry g{seq.geo, p.block_q, p.block_k};
  const rules::SkipRule rule = rules::skip_rule(seq.geo.s_k, p.a);

  for (int h = 0; h < seq.h_q; ++h) {
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
      const std::vector<int> order = rules::blasst_order(g, qb);

      const std::int64_t r0 = g.row_begin(qb), rows = g.row_end(qb) - r0;
      // Running max over the kept blocks' keys; -inf while a row has seen no key.
      std::vector<double> m_run(static_cast<std::size_t>(rows), kNegInf);
      std::vector<char> seen(static_cast<std::size_t>(rows), 0);
      std::vector<double> tile_max(static_cast<std::size_t>(rows));
      std::vector<char> sees(static_cast<std::size_t>(rows));

      for (std::size_t visit = 0; visit < order.size(); ++visit) {
        const int kb = order[visit];
        for (std::int64_t i = 0; i < rows; ++i) {
          // The keys of the block row r0 + i sees (causal mask and window).
          const std::int64_t begin = geom::max64(g.key_begin(kb), seq.geo.first_key(r0 + i));
          const std::int64_t end = geom::min64(g.key_end(kb), seq.geo.keys_seen(r0 + i));
          double m = kNegInf;
          for (std::int64_t t = begin; t < end; ++t) m = rules::nan_max(m, seq.score(r0 + i, h, t));
          tile_max[static_cast<std::size_t>(i)] = m;
          sees[static_cast<std::size_t>(i)] = end > begin;
        }
        // Skipped iff every row with a say votes kSkip (rules::skip_vote).
        bool skip = rule.gates(static_cast<int>(visit));
        for (std::int64_t i = 0; i < rows && skip; ++i) {
          const auto u = static_cast<std::size_t>(i);
          skip = rules::skip_vote(sees[u] != 0, seen[u] != 0, tile_max[u], m_run[u], rule.ln_lambda) != rules::RowVote::kKeep;
        }
        if (skip) continue;
        SP_RETURN_IF_ERROR(decisions->kept.add(shape, seq.batch, h, qb, kb));
        for (std::int64_t i = 0; i < rows; ++i) {
          const auto u = static_cast<std::size_t>(i);
          if (!sees[u]) continue;
          m_run[u] = rules::nan_max(m_run[u], tile_max[u]);
          seen[u] = 1;
        }
      }
    }
  }
  return {};
}

}  // namespace sparseprefill::ref
