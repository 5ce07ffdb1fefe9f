// SPDX-License-Identifier: Apache-2.0
// estimate_select's rules (docs/semantics.md §3.5), shared by the oracle, the CPU backend, the
// calibration (statistics and EstimateSelectCalibrator) and the selector kernels' selection
// (kernel/select_kernel.cuh, SP_HD): the block means, a query tile's positions and scored
// blocks, which pairs contribute to the energies and the energies themselves, the keep test
// with its forced blocks, and which pruned blocks mean correction adds back. Block size
// B = g.block_q = g.block_k.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "core/geometry.h"
#include "core/rules/nan_max.h"

namespace sparseprefill::rules {

// Block j's mean of one KV head's keys (or values): per feature i < d the block's valid keys
// summed in double in key order, divided by the block's valid length n_j, rounded to fp32 and
// then by `round` to the input dtype (what a kernel stores, so that every backend scores with
// the same means). row(t): key t's d features (float or double); sum: d doubles of scratch;
// out: d values (float or double) of the rounded mean. Host.
template <class Row, class Round, class Out>
inline void block_mean(const geom::BlockGeometry& g, int j, int d, const Row& row, const Round& round, double* sum,
                       Out* out) {
  for (int i = 0; i < d; ++i) sum[i] = 0.0;
  for (std::int64_t t = g.key_begin(j); t < g.key_end(j); ++t) {
    const auto* x = row(t);
    for (int i = 0; i < d; ++i) sum[i] += x[i];
  }
  const auto n = static_cast<double>(g.key_end(j) - g.key_begin(j));
  for (int i = 0; i < d; ++i) out[i] = round(static_cast<float>(sum[i] / n));
}

// The scored blocks of query tile i: j < A = (a_l + 1) / B, a_l the absolute position of the
// tile's last row (A = 0 when that row sees no key): the blocks the last row sees whole.
SP_HD int estimate_scored_blocks(const geom::BlockGeometry& g, int i) {
  const std::int64_t a_l = g.seq.position(g.row_end(i) - 1);
  return a_l < 0 ? 0 : static_cast<int>((a_l + 1) / g.block_k);
}

// Query tile i (call-relative rows [i·B, min((i+1)·B, s_q)) of one selection unit).
struct EstimateTile {
  std::int64_t a_first = 0;  // absolute position of the first row (negative when s_q > s_k)
  std::int64_t a_last = 0;   // of the last row; a tile with a_last < 0 selects nothing
  std::int64_t fqb = 0;      // floor(a_first / B): the first row's diagonal block
  std::int64_t lqb = 0;      // floor(a_last / B): blocks j > lqb are never kept
  int first = 0;             // the first visible block (geom::BlockGeometry::visible_begin: 0
                             // without a left window bound): blocks j < first are never kept
  int scored = 0;            // A (estimate_scored_blocks); blocks first <= j < A are scored
  bool tail = false;         // a tail tile keeps every visible block (geom::BlockGeometry::is_tail_block)

  SP_HD bool empty() const { return a_last < 0; }
};
// prompt_len <= 0: the tail counts the call's query tiles; else the prompt's last blocks.
SP_HD EstimateTile estimate_tile(const geom::BlockGeometry& g, int i, int tail, std::int64_t prompt_len) {
  EstimateTile t;
  t.a_first = g.seq.position(g.row_begin(i));
  t.a_last = g.seq.position(g.row_end(i) - 1);
  t.fqb = geom::floor_div(t.a_first, g.block_k);
  t.lqb = geom::floor_div(t.a_last, g.block_k);
  t.first = g.visible_begin(i);
  t.scored = estimate_scored_blocks(g, i);
  t.tail = g.is_tail_block(i, tail, prompt_len);
  return t;
}
// Row r (at absolute position a_r) contributes x[r, j] = cap(scale·q_r·k̄_j) (softcap applied as
// to every score) to block j's energy iff it sees some key of the block: without a window, the
// block's first key (j < A); under a left window bound, a row may have left a scored block
// behind.
SP_HD bool estimate_contributes(const geom::BlockGeometry& g, std::int64_t a_r, int j) {
  return g.seq.keys_in(a_r, g.key_begin(j), g.key_end(j)) > 0;
}

// The energies of a tile: x(j, n) is pair n's score against block j (n over the tile's rows,
// and with pack_gqa its heads, in the caller's order; -inf for a pair that does not
// contribute), for first <= j < scored (EstimateTile; each such block has a contributing pair).
// M = the maximum of x over every pair (NaN if any is NaN), energy[j] = E_j =
// Σ_n e^{x(j, n) - M} summed in n order, and the result is peak = max_j E_j (NaN-propagating;
// -inf when no block is scored). energy[j] for j < first is left as it is. T is float or
// double. Host.
template <class T, class Score>
inline T estimate_energies(int first, int scored, std::int64_t pairs, const Score& x, T* energy) {
  T m = -std::numeric_limits<T>::infinity();
  for (int j = first; j < scored; ++j) {
    for (std::int64_t n = 0; n < pairs; ++n) m = nan_max(m, static_cast<T>(x(j, n)));
  }
  T peak = -std::numeric_limits<T>::infinity();
  for (int j = first; j < scored; ++j) {
    T e = 0;
    for (std::int64_t n = 0; n < pairs; ++n) e += std::exp(static_cast<T>(x(j, n)) - m);
    energy[j] = e;
    peak = nan_max(peak, e);
  }
  return peak;
}

// Forced blocks, kept whatever their energy when visible (first <= j <= lqb): every block of a
// tail tile, j < sink, and the policy's window fqb - window + 1 <= j (the diagonal blocks and
// the window - 1 before the first row's); fqb = EstimateTile::fqb. A forced block that the local
// window hides is not kept (estimate_keeps).
SP_HD bool estimate_forced(bool tail_tile, std::int64_t fqb, std::int64_t j, int sink, int window) {
  return tail_tile || j < sink || fqb - window + 1 <= j;
}

// Block j of a tile is kept iff it is visible (first <= j <= lqb) and it is forced or
// first <= j < A with E_j >= alpha · peak, as written: ties keep, and a NaN energy or peak fails
// (a NaN score in the tile leaves only the forced blocks).
SP_HD bool estimate_keeps(const EstimateTile& t, std::int64_t j, double energy, double peak, double alpha, int sink,
                          int window) {
  if (j < t.first || j > t.lqb) return false;
  return (j < t.scored && energy >= alpha * peak) || estimate_forced(t.tail, t.fqb, j, sink, window);
}

// Mean correction adds back a pruned block j iff every row of the tile (positions a_first ..
// a_last) sees all of it: the first row sees its last valid key, min((j+1)·B, s_k) - 1 <=
// a_first, and the last row its first key (the local window's lower bound), so that no
// pseudo-token brings back a key outside a row's window: exactly the blocks full for the tile
// (geom::BlockGeometry::is_full). The tile's last row sits at min(a_first + B - 1, s_k - 1).
SP_HD bool estimate_correctable(const geom::BlockGeometry& g, std::int64_t a_first, int j) {
  const std::int64_t a_last = geom::min64(a_first + g.block_q - 1, g.seq.s_k - 1);
  return g.key_end(j) - 1 <= a_first && g.seq.first_key_at(a_last) <= g.key_begin(j);
}

}  // namespace sparseprefill::rules
