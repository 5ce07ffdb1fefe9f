// SPDX-License-Identifier: Apache-2.0
// permute_stop's rules (docs/semantics.md §3.6, our definition of S2O), shared by the oracle
// and the CPU backend; SP_HD, so that kernels may include it. The segments themselves are
// geom::SegmentGeometry; here: a row's segment, a segment's tiles and ranked chunks, the
// ranking order, the guide vector's size and the stop rule.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "core/geometry.h"

namespace sparseprefill::rules {

// The segment of call row r: floor(a_r / len); -1 for a row at a negative position (s_q > s_k),
// which belongs to no segment and sees no key.
SP_HD std::int64_t segment_of(const geom::SegmentGeometry& sg, std::int64_t r) {
  const std::int64_t a = sg.seq.position(r);
  return a < 0 ? -1 : a / sg.len;
}

// Query tiles of segment s: consecutive block_q entries of its query order (the last shorter).
SP_HD std::int64_t permute_tiles(const geom::SegmentGeometry& sg, std::int64_t s, int block_q) {
  return geom::ceil_div(sg.row_end(s) - sg.row_begin(s), block_q);
}
// Chunks of block_k keys of segment s's ranked keys, ranked_begin(s) .. prefix(s) - 1
// (PermuteTile::chunks_total).
SP_HD std::int64_t permute_chunks(const geom::SegmentGeometry& sg, std::int64_t s, int block_k) {
  return geom::ceil_div(sg.prefix(s) - sg.ranked_begin(s), block_k);
}
// The top-ranked keys whose mean is the guide vector u: min(block_k, ranked keys).
SP_HD std::int64_t permute_guide_keys(std::int64_t ranked, int block_k) { return geom::min64(block_k, ranked); }

// A ranking score: the fp64 dot product rounded to fp32 (round to nearest; NaN stays NaN,
// magnitudes past fp32 become ±inf). Ranking at fp32 resolution is the definition: the CUDA
// backend sorts 32-bit keys (cuda/kernel/rank_key.h), and scores that round to the same fp32
// value tie, broken by the lower index as every tie.
SP_HD float ranking_score(double dot_product) { return static_cast<float>(dot_product); }

// Whether (score a, index ia) ranks before (b, ib): descending score, ties by lower index; a NaN
// score ranks after every number (and the order stays a strict weak order).
SP_HD bool ranks_before(double a, std::int64_t ia, double b, std::int64_t ib) {
  const bool a_nan = a != a, b_nan = b != b;
  if (a_nan != b_nan) return b_nan;
  if (!a_nan && a != b) return a > b;
  return ia < ib;
}

// Indices 0 .. n-1 of dot_products in ranking order of their ranking scores. Host. The scores
// are kept as floats: GCC 12's SLP vectorizer at -O3 drops the round trip of a loop storing
// double(float(x)) into doubles (tests/cpu/rules_test.cpp, Rules.Ranking*, fails then).
inline std::vector<std::int64_t> rank_descending(const std::vector<double>& dot_products) {
  std::vector<float> score(dot_products.size());
  for (std::size_t i = 0; i < score.size(); ++i) score[i] = ranking_score(dot_products[i]);
  std::vector<std::int64_t> order(score.size());
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::sort(order.begin(), order.end(), [&](std::int64_t x, std::int64_t y) {
    return ranks_before(score[static_cast<std::size_t>(x)], x, score[static_cast<std::size_t>(y)], y);
  });
  return order;
}

// After a visited chunk of pass 2, row r's gain is Δl_r / l'_r (the chunk's softmax mass over
// the row's new total). The walk stops after the chunk iff max_r gain_r < tau: gain = tau
// continues, and a NaN gain (the maximum is then NaN) never stops it.
SP_HD double permute_gain(double delta_l, double l_new) { return delta_l / l_new; }
SP_HD bool permute_stops(double max_gain, double tau) { return max_gain < tau; }

}  // namespace sparseprefill::rules
