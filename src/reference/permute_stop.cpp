// SPDX-License-Identifier: Apache-2.0
// permute_stop (our definition of S2O, docs/semantics.md) in the oracle: per segment and query
// head, the prefix keys ranked by the segment's mean query, the segment's queries ordered by a
// guide vector, and per query tile the number of ranked key chunks visited before the
// early-stop rule fires.
#include <cmath>
#include <limits>
#include <vector>

#include "core/rules/nan_max.h"
#include "core/rules/permute_stop.h"
#include "reference/decide.h"

namespace sparseprefill::ref {

SegmentOrder order_segment(const Sequence& seq, int h, std::int64_t segment,
                           const PermuteStopParams& p) {
  const geom::SegmentGeometry sg{seq.geo, p.segment};
  const std::int64_t r0 = sg.row_begin(segment), r1 = sg.row_end(segment);
  const int hk = seq.kv_head(h);
  const auto d = static_cast<std::size_t>(seq.d);
  SegmentOrder out;
  out.prefix = sg.prefix(segment);
  out.ranked_begin = sg.ranked_begin(segment);

  // q̄: the mean of the segment's queries present in the call (exact, not rounded).
  std::vector<double> q_bar(d, 0.0);
  for (std::int64_t r = r0; r < r1; ++r) {
    for (std::size_t i = 0; i < d; ++i) q_bar[i] += seq.q_row(r, h)[i];
  }
  for (double& x : q_bar) x /= static_cast<double>(r1 - r0);

  const std::int64_t ranked = out.prefix - out.ranked_begin;
  std::vector<double> dots(static_cast<std::size_t>(ranked));
  for (std::int64_t n = 0; n < ranked; ++n) {
    dots[static_cast<std::size_t>(n)] = dot(q_bar.data(), seq.k_row(out.ranked_begin + n, hk), seq.d);
  }
  for (const std::int64_t n : rules::rank_descending(dots)) out.ranked.push_back(out.ranked_begin + n);

  if (ranked == 0) {  // nothing ranked, no guide vector: identity order
    for (std::int64_t r = r0; r < r1; ++r) out.rows.push_back(r);
    return out;
  }
  // u: the mean of the top-ranked keys.
  const std::int64_t top = rules::permute_guide_keys(ranked, p.block_k);
  std::vector<double> u(d, 0.0);
  for (std::int64_t n = 0; n < top; ++n) {
    const double* k = seq.k_row(out.ranked[static_cast<std::size_t>(n)], hk);
    for (std::size_t i = 0; i < d; ++i) u[i] += k[i];
  }
  for (double& x : u) x /= static_cast<double>(top);
  dots.assign(static_cast<std::size_t>(r1 - r0), 0.0);
  for (std::int64_t r = r0; r < r1; ++r) dots[static_cast<std::size_t>(r - r0)] = dot(seq.q_row(r, h), u.data(), seq.d);
  for (const std::int64_t i : rules::rank_descending(dots)) out.rows.push_back(r0 + i);
  return out;
}

Status decide_permute_stop(const Sequence& seq, const ProblemShape& shape,
                           const PermuteStopParams& p, Decisions* decisions) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const std::int64_t slots = shape.max_seq_q();
  const geom::SegmentGeometry sg{seq.geo, p.segment};

  for (int h = 0; h < seq.h_q; ++h) {
    std::int32_t* order = decisions->query_order.data() +
                          (static_cast<std::int64_t>(seq.batch) * seq.h_q + h) * slots;
    // Rows at negative positions see no key and join no segment; they hold the first slots.
    for (std::int64_t r = 0; r < sg.first_row(); ++r) order[r] = static_cast<std::int32_t>(r);

    for (std::int64_t s = sg.first(); s < sg.first() + sg.count(); ++s) {
      const std::int64_t row0 = sg.row_begin(s);
      const SegmentOrder ord = order_segment(seq, h, s, p);
      for (std::size_t i = 0; i < ord.rows.size(); ++i) {
        order[row0 + static_cast<std::int64_t>(i)] = static_cast<std::int32_t>(ord.rows[i]);
      }
      const std::int64_t seg_begin = ord.prefix;  // the segment's own keys start after its prefix
      const std::int64_t chunks = rules::permute_chunks(sg, s, p.block_k);
      const std::int64_t n_rows = sg.row_end(s) - row0;

      for (std::int64_t tile = 0; tile < rules::permute_tiles(sg, s, p.block_q); ++tile) {
        const std::int64_t e0 = tile * p.block_q, e1 = geom::min64(e0 + p.block_q, n_rows);
        // Pass 1: the online-softmax state (m, l) after the segment's own keys the row sees
        // (causal, within its window).
        std::vector<double> m(static_cast<std::size_t>(e1 - e0), kNegInf);
        std::vector<double> l(static_cast<std::size_t>(e1 - e0), 0.0);
        for (std::int64_t e = e0; e < e1; ++e) {
          const std::int64_t r = ord.rows[static_cast<std::size_t>(e)];
          const auto u = static_cast<std::size_t>(e - e0);
          const std::int64_t begin = geom::max64(seg_begin, seq.geo.first_key(r));
          for (std::int64_t t = begin; t < seq.geo.keys_seen(r); ++t) m[u] = rules::nan_max(m[u], seq.score(r, h, t));
          for (std::int64_t t = begin; t < seq.geo.keys_seen(r); ++t) l[u] += std::exp(seq.score(r, h, t) - m[u]);
        }
        // Pass 2: ranked chunks; each visited chunk is kept, and the walk stops after a chunk
        // whose largest row gain Δl / l' is below tau (a NaN gain never stops it). A row reads
        // the chunk's keys it sees (all of them without a left window bound).
        const auto ranked = static_cast<std::int64_t>(ord.ranked.size());
        std::int64_t visited = 0;
        while (visited < chunks) {
          const std::int64_t c0 = visited * p.block_k, c1 = geom::min64(c0 + p.block_k, ranked);
          ++visited;
          double max_gain = kNegInf;
          for (std::int64_t e = e0; e < e1; ++e) {
            const std::int64_t r = ord.rows[static_cast<std::size_t>(e)];
            const auto u = static_cast<std::size_t>(e - e0);
            const auto seen = [&](std::int64_t c) { return seq.geo.sees(r, ord.ranked[static_cast<std::size_t>(c)]); };
            double m_new = m[u];
            for (std::int64_t c = c0; c < c1; ++c) {
              if (seen(c)) m_new = rules::nan_max(m_new, seq.score(r, h, ord.ranked[static_cast<std::size_t>(c)]));
            }
            double dl = 0.0;
            for (std::int64_t c = c0; c < c1; ++c) {
              if (seen(c)) dl += std::exp(seq.score(r, h, ord.ranked[static_cast<std::size_t>(c)]) - m_new);
            }
            const double l_new = l[u] * std::exp(m[u] - m_new) + dl;
            max_gain = rules::nan_max(max_gain, rules::permute_gain(dl, l_new));
            m[u] = m_new;
            l[u] = l_new;
          }
          if (rules::permute_stops(max_gain, p.tau)) break;
        }
        PermuteTile pt;
        pt.batch = seq.batch;
        pt.head = h;
        pt.segment = static_cast<int>(s);
        pt.tile = static_cast<int>(tile);
        pt.chunks_visited = static_cast<int>(visited);
        pt.chunks_total = static_cast<int>(chunks);
        decisions->tiles.push_back(pt);
      }
    }
  }
  return {};
}

}  // namespace sparseprefill::ref
