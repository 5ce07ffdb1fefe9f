// SPDX-License-Identifier: Apache-2.0
// permute_stop (our definition of S2O, docs/semantics.md) in the oracle: per segment and query
// head, the prefix keys ranked by the segment's mean query, the segment's queries ordered by a
// guide vector, and per query tile the number of ranked key chunks visited before the
// early-stop rule fires.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "reference/decide.h"

namespace sparseprefill::ref {
namespace {

struct Ranked {
  double score;
  std::int64_t index;
};

// A ranking score: the fp64 dot product rounded to fp32 (round to nearest; NaN stays NaN,
// magnitudes past fp32 become ±inf). Ranking at fp32 resolution is the definition: the CUDA
// backend sorts 32-bit keys (half the radix passes of 64-bit ones), and scores that round to
// the same fp32 value tie, broken by the lower index as every tie.
double ranking_score(double dot_product) { return static_cast<double>(static_cast<float>(dot_product)); }

// Descending score, ties by lower index. A NaN score ranks after every number (and the
// comparison stays a strict weak order).
bool ranks_before(const Ranked& a, const Ranked& b) {
  const bool a_nan = std::isnan(a.score), b_nan = std::isnan(b.score);
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a.score != b.score) return a.score > b.score;
  return a.index < b.index;
}

std::vector<std::int64_t> rank(std::vector<Ranked> items) {
  std::sort(items.begin(), items.end(), ranks_before);
  std::vector<std::int64_t> out(items.size());
  for (std::size_t i = 0; i < items.size(); ++i) out[i] = items[i].index;
  return out;
}

}  // namespace

SegmentRows segment_rows(const geom::SeqGeometry& geo, int segment_len, std::int64_t segment) {
  const auto clamp_row = [&](std::int64_t position) {
    return geom::min64(geom::max64(position - geo.offset(), 0), geo.s_q);
  };
  return {clamp_row(segment * segment_len), clamp_row((segment + 1) * segment_len)};
}

void segment_range(const geom::SeqGeometry& geo, int segment_len, std::int64_t* first,
                   std::int64_t* last) {
  const std::int64_t r0 = geom::max64(0, -geo.offset());  // first row at a position >= 0
  if (r0 >= geo.s_q) {
    *first = 0;
    *last = -1;
    return;
  }
  *first = geo.position(r0) / segment_len;
  *last = geo.position(geo.s_q - 1) / segment_len;
}

SegmentOrder order_segment(const Sequence& seq, int h, std::int64_t segment,
                           const PermuteStopParams& p) {
  const SegmentRows rows = segment_rows(seq.geo, p.segment, segment);
  const int hk = seq.kv_head(h);
  const auto d = static_cast<std::size_t>(seq.d);
  SegmentOrder out;
  out.prefix = geom::min64(segment * p.segment, seq.geo.s_k);

  // q̄: the mean of the segment's queries present in the call (exact, not rounded).
  std::vector<double> q_bar(d, 0.0);
  for (std::int64_t r = rows.begin; r < rows.end; ++r) {
    for (std::size_t i = 0; i < d; ++i) q_bar[i] += seq.q_row(r, h)[i];
  }
  for (double& x : q_bar) x /= static_cast<double>(rows.end - rows.begin);

  std::vector<Ranked> keys;
  for (std::int64_t t = 0; t < out.prefix; ++t) keys.push_back({ranking_score(dot(q_bar.data(), seq.k_row(t, hk), seq.d)), t});
  out.ranked = rank(std::move(keys));

  if (out.prefix == 0) {  // no prefix, no guide vector: identity order
    for (std::int64_t r = rows.begin; r < rows.end; ++r) out.rows.push_back(r);
    return out;
  }
  // u: the mean of the top block_k ranked prefix keys (all of them when fewer).
  const std::int64_t top = geom::min64(p.block_k, out.prefix);
  std::vector<double> u(d, 0.0);
  for (std::int64_t n = 0; n < top; ++n) {
    const double* k = seq.k_row(out.ranked[static_cast<std::size_t>(n)], hk);
    for (std::size_t i = 0; i < d; ++i) u[i] += k[i];
  }
  for (double& x : u) x /= static_cast<double>(top);
  std::vector<Ranked> queries;
  for (std::int64_t r = rows.begin; r < rows.end; ++r) queries.push_back({ranking_score(dot(seq.q_row(r, h), u.data(), seq.d)), r});
  out.rows = rank(std::move(queries));
  return out;
}

Status decide_permute_stop(const Sequence& seq, const ProblemShape& shape,
                           const PermuteStopParams& p, Decisions* decisions) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  const std::int64_t slots = shape.max_seq_q();
  std::int64_t first = 0, last = -1;
  segment_range(seq.geo, p.segment, &first, &last);

  for (int h = 0; h < seq.h_q; ++h) {
    std::int32_t* order = decisions->query_order.data() +
                          (static_cast<std::int64_t>(seq.batch) * seq.h_q + h) * slots;
    // Rows at negative positions see no key and join no segment; they hold the first slots.
    const std::int64_t unsegmented = geom::min64(geom::max64(0, -seq.geo.offset()), seq.geo.s_q);
    for (std::int64_t r = 0; r < unsegmented; ++r) order[r] = static_cast<std::int32_t>(r);

    for (std::int64_t s = first; s <= last; ++s) {
      const SegmentRows rows = segment_rows(seq.geo, p.segment, s);
      const SegmentOrder ord = order_segment(seq, h, s, p);
      for (std::size_t i = 0; i < ord.rows.size(); ++i) {
        order[rows.begin + static_cast<std::int64_t>(i)] = static_cast<std::int32_t>(ord.rows[i]);
      }
      const std::int64_t seg_begin = s * p.segment;
      const std::int64_t chunks = geom::ceil_div(ord.prefix, p.block_k);
      const std::int64_t n_rows = rows.end - rows.begin;

      for (std::int64_t tile = 0; tile * p.block_q < n_rows; ++tile) {
        const std::int64_t e0 = tile * p.block_q, e1 = geom::min64(e0 + p.block_q, n_rows);
        // Pass 1: the online-softmax state (m, l) after the segment's own keys, causally.
        std::vector<double> m(static_cast<std::size_t>(e1 - e0), kNegInf);
        std::vector<double> l(static_cast<std::size_t>(e1 - e0), 0.0);
        for (std::int64_t e = e0; e < e1; ++e) {
          const std::int64_t r = ord.rows[static_cast<std::size_t>(e)];
          const auto u = static_cast<std::size_t>(e - e0);
          for (std::int64_t t = seg_begin; t < seq.geo.keys_seen(r); ++t) m[u] = nan_max(m[u], seq.score(r, h, t));
          for (std::int64_t t = seg_begin; t < seq.geo.keys_seen(r); ++t) l[u] += std::exp(seq.score(r, h, t) - m[u]);
        }
        // Pass 2: ranked prefix chunks; each visited chunk is kept, and the walk stops after
        // a chunk whose largest row gain Δl / l' is below tau (a NaN gain never stops it).
        std::int64_t visited = 0;
        while (visited < chunks) {
          const std::int64_t c0 = visited * p.block_k, c1 = geom::min64(c0 + p.block_k, ord.prefix);
          ++visited;
          double max_gain = kNegInf;
          for (std::int64_t e = e0; e < e1; ++e) {
            const std::int64_t r = ord.rows[static_cast<std::size_t>(e)];
            const auto u = static_cast<std::size_t>(e - e0);
            double m_new = m[u];
            for (std::int64_t c = c0; c < c1; ++c) m_new = nan_max(m_new, seq.score(r, h, ord.ranked[static_cast<std::size_t>(c)]));
            double dl = 0.0;
            for (std::int64_t c = c0; c < c1; ++c) dl += std::exp(seq.score(r, h, ord.ranked[static_cast<std::size_t>(c)]) - m_new);
            const double l_new = l[u] * std::exp(m[u] - m_new) + dl;
            max_gain = nan_max(max_gain, dl / l_new);
            m[u] = m_new;
            l[u] = l_new;
          }
          if (max_gain < p.tau) break;
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
