// SPDX-License-Identifier: Apache-2.0
// The CPU backend's inner loop, shaped like a GPU kernel's main loop: scores of a query tile
// against one key tile, row maxima for the in-loop gates, and the online-softmax update with
// P·V. fp32 throughout; vectorised (src/cpu/simd.h). Internal to src/cpu.
#pragma once

#include <cstdint>

namespace sparseprefill::cpu {

// Query tiles are processed kRowGroup rows at a time and key tiles kKeyAlign keys at a time:
// callers pad row counts to a multiple of kRowGroup and key/feature strides to a multiple of
// kKeyAlign, filling the padding with zeros (never NaN: padded lanes are computed).
constexpr int kRowGroup = 4;
constexpr int kKeyAlign = 16;

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Online-softmax state of one query tile, in caller-owned scratch (no allocation here).
//   q [rows_pad, ld]     the tile's queries, features padded with zeros to ld
//   o [rows_pad, ld_v]   unnormalised output accumulator
//   m, l [rows_pad]      running max (natural-log domain) and running sum
// Invariant: a row that has seen no key has m = -inf, l = 0, o = 0.
struct TileState {
  int rows = 0;      // valid rows
  int rows_pad = 0;  // round_up(rows, kRowGroup)
  int d = 0;         // head dim of q and k
  int ld = 0;        // round_up(d, kKeyAlign)
  int d_v = 0;       // head dim of v and O
  int ld_v = 0;      // round_up(d_v, kKeyAlign)
  float scale = 1.0f;
  float softcap = 0.0f;  // 0: none (rules::capped_score)
  float* q = nullptr;
  float* o = nullptr;
  float* m = nullptr;
  float* l = nullptr;

  // Clears o, m, l (q is left as loaded).
  void reset();
};

// s[i][j] = capped(scale · Σ_c q[i][c] · kt[c][j]) for i < rows_pad, j < ld_k (fp32
// accumulation; rules::capped_score with t.softcap). kt [d, ld_k] is the key tile transposed;
// s [rows_pad, ld_k]; ld_k % kKeyAlign == 0.
void tile_scores(const TileState& t, const float* kt, int ld_k, float* s);

// The keys row i reads of a tile are its columns begin[i] <= j < limit[i] (causal mask and local
// window); the row reads none when limit[i] <= begin[i].

// out[i] = max_{begin[i] <= j < limit[i]} s[i][j] for i < rows; -inf when the row reads none.
// NaN propagates (a NaN score makes the row max NaN), so NaN inputs reach the output and every
// gate keeps.
void tile_row_max(const float* s, int ld_s, int rows, const int* begin, const int* limit, float* out);

// Online-softmax update of every valid row with the keys begin[i] <= j < limit[i] of the tile:
//   m' = max(m, row_max);  base = (m' == -inf ? 0 : m')  (avoids -inf - -inf = NaN)
//   p_j = e^{s_j - base};  l' = l·e^{m - base} + Σ_j p_j;  o' = o·e^{m - base} + Σ_j p_j·v_j
// s [rows_pad, ld_s] is overwritten with P. v [n, ld_v] holds the tile's values (features
// padded to t.ld_v); only rows begin[i] <= j < limit[i] of v are read for row i, so a key a row
// cannot see never reaches it (not even as 0·NaN). When dl is given, dl[i] = Σ_j p_j: the
// tile's mass relative to the new running max (permute_stop's Δl); 0 for a row that reads no key
// of the tile.
void tile_update(TileState& t, float* s, int ld_s, const int* begin, const int* limit, int n, const float* row_max,
                 const float* v, std::int64_t ld_v, float* dl);

// Writes the normalised result of row i with the sink logit `sink` as one more term of the
// denominator and the maximum (docs/semantics.md §1; -inf: no sink): M = max(m[i], sink),
// L = l[i]·e^{m[i] - M} + e^{sink - M}, o_row[c] = o[i][c]·e^{m[i] - M} / L for c < d_v and
// *lse = M + ln L. A row that saw no key gets O = 0 and LSE = sink (-inf without a sink); a NaN
// or +inf sink gives NaN.
void tile_finish_row(const TileState& t, int i, float sink, float* o_row, float* lse);

}  // namespace sparseprefill::cpu
