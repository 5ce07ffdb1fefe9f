// SPDX-License-Identifier: Apache-2.0
// The policy side of the forward kernels, shared by the portable (sm80) and Hopper (sm90)
// paths so that both make the same decisions (DESIGN.md §3) with one copy of the rules: which
// key blocks a CTA visits and in which order, which of them are gated and the gates' per-row
// keep rules, the mean-correction tiles and their pseudo-token scores, and the kept bitmap.
// Device-only.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "core/rules/exact_gate.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/ptx.cuh"

namespace sparseprefill::cuda {

// Row (b, h_mask, qb) of the BlockMask arrays and of the correction bitmap.
__device__ __forceinline__ std::int64_t mask_row_of(const FwdParams& p, int b, int h, int qb) {
  const int h_mask = p.mask_per_kv_head ? h / p.group : h;
  return (static_cast<std::int64_t>(b) * p.mask_heads + h_mask) * p.mask_q_blocks + qb;
}

// The key blocks one CTA visits, in order: group A (never gated by exact_gate: the partial
// blocks, or non-causal the last key block), then group B (the full blocks), each descending,
// then the mean-correction tiles. Dense and the gates walk one descending range
// [visible_begin, a_hi); a block mask walks its partial list then its full list. (softmax_skip's
// visit order is part of its semantics: partial blocks then full ones, each descending — the
// same order.) A local window's lower partial band comes last in the range, inside group B:
// only dense walks a range under a window (check_support refuses windows for the gates).
struct VisitList {
  bool lists = false;    // mask mode (else range mode)
  int n_a = 0;           // group A entries
  int n_reg = 0;         // A + B entries (real key blocks)
  int a_hi = 0;          // range mode: first visited block + 1
  const std::int32_t* a_list = nullptr;  // mask mode: ascending partial indices
  const std::int32_t* b_list = nullptr;  // mask mode: ascending full indices

  __device__ __forceinline__ int block(int j) const {
    if (!lists) return a_hi - 1 - j;
    return j < n_a ? a_list[n_a - 1 - j] : b_list[n_reg - 1 - j];
  }
};

// The visit list of query block qb (geometry in blocks of p.block_k keys); mask_row as above.
__device__ __forceinline__ VisitList make_visit_list(const FwdParams& p, const geom::BlockGeometry& geo, int qb,
                                                     std::int64_t mask_row) {
  VisitList visit;
  if (p.mode == PolicyMode::kBlockMask) {
    visit.lists = true;
    visit.n_a = p.partial_count[mask_row];
    visit.n_reg = visit.n_a + p.full_count[mask_row];
    visit.a_list = p.partial_index + (p.partial_start != nullptr ? p.partial_start[mask_row] : mask_row * p.mask_k_blocks);
    visit.b_list = p.full_index + (p.full_start != nullptr ? p.full_start[mask_row] : mask_row * p.mask_k_blocks);
  } else {
    visit.a_hi = geo.visible_end(qb);
    // Causal: the partial blocks [full_end, visible_end). Non-causal: every block is full and
    // the last one is the forced one. (BlockGeometry::gated_end counts group B alike; written
    // out here, since that form changed the forward kernels' SASS.)
    const int a_lo = p.causal ? geo.full_end(qb) : geo.visible_end(qb) - 1;
    visit.n_a = visit.a_hi - (a_lo < 0 ? 0 : a_lo);
    visit.n_reg = visit.a_hi - geo.visible_begin(qb);  // visible_begin: 0 without a left window bound
  }
  return visit;
}

// The gates of one CTA (exact_gate, softmax_skip) and their per-row keep rules. A block is kept
// iff some thread of the CTA keeps one of its rows (the caller's vote).
struct Gate {
  bool exact = false;
  bool skip = false;
  float threshold = 0.f;    // exact_gate: T at the query block's absolute position
  float log2_lambda = 0.f;  // softmax_skip: log2(a / s_k), the BLASST test in the exp2 domain

  // Whether visit position j is gated: exact_gate gates group B, softmax_skip every block
  // after the first.
  __device__ __forceinline__ bool gated(int j, int n_a) const { return (exact && j >= n_a) || (skip && j > 0); }
  // The first gated position of a list whose group A has n_a entries (gated positions are a
  // suffix of the real blocks; mean tiles only occur with block masks, which are not gated).
  __device__ __forceinline__ int first_gated(int n_a) const { return exact ? n_a : 1; }

  // One row's vote from its raw block maximum mx (masked keys -inf) and its running max m_run
  // (log2 domain, before this block); rows past s_q (valid = false) have no say.
  __device__ __forceinline__ bool keeps_row(float mx, float m_run, bool valid, float scale, float scale_log2) const {
    if (!valid) return false;
    // exact_gate: keep iff !(max s < T) over the valid rows: ties keep, T = -inf keeps, NaN keeps.
    if (exact) return rules::gate_keeps(mx * scale, threshold);
    // BLASST per row: skip iff tile_max - m_run < ln λ. A row that sees no key of the block
    // (tile max -inf) skips, or has no say if it has seen none before either; a row seeing its
    // first keys keeps; NaN fails the strict test and keeps.
    const float tmax = mx * scale_log2;
    return tmax != -INFINITY && (m_run == -INFINITY || !(tmax - m_run < log2_lambda));
  }
};

__device__ __forceinline__ Gate make_gate(const FwdParams& p, const geom::BlockGeometry& geo, int qb, int h) {
  Gate g;
  g.exact = p.mode == PolicyMode::kExactGate;
  g.skip = p.mode == PolicyMode::kSoftmaxSkip && !(static_cast<float>(geo.seq.s_k) < p.skip_a);
  if (g.exact) {
    const int pos = geo.threshold_position(qb, p.thr_positions);
    g.threshold = p.thresholds[h * p.thr_head_stride + pos * p.thr_pos_stride];
  }
  if (g.skip) g.log2_lambda = __log2f(p.skip_a / static_cast<float>(geo.seq.s_k));
  return g;
}

// The kept bitmap row of (b, h, qb), or nullptr when decisions are not recorded.
__device__ __forceinline__ std::uint32_t* kept_row_of(const FwdParams& p, int b, int h, int qb) {
  if (p.kept_bits == nullptr) return nullptr;
  return p.kept_bits + ((static_cast<std::int64_t>(b) * p.h_q + h) * p.num_q_blocks + qb) * p.kept_words;
}
__device__ __forceinline__ void record_kept(std::uint32_t* kept_row, int kb) {
  if (kept_row != nullptr) atomicOr(kept_row + kb / 32, 1u << (kb % 32));
}

// ------------------------------------------------------------------ exact_gate in two passes
// The decision kernels' block-mask rows (b, h, qb) (GateParams): the partial list of a row at
// row · ungated_room(), the full list after the gated blocks (BlockGeometry::gated_end) of every
// earlier row, rows ordered (b, h, qb): what plan.h's gate_list_entries allocates.

// The work of one decision CTA: query block qb of sequence b for the query heads h0 ..
// h0 + heads - 1 of one KV group (units of `heads` heads), in the forward kernels' grid order
// (geom::grid_tile with FwdParams::kv_major). init is false when the query block lies past
// its sequence's end (the CTA has nothing to do).
struct GateTile {
  int h0, b, hk, qb;
  SeqInfo seq;
  geom::BlockGeometry geo;
  std::int64_t row0;
  int rows_valid;
  VisitList visit;  // range mode: p.mode is kExactGate
  int n_gated;      // group B: key blocks 0 .. n_gated - 1

  __device__ __forceinline__ bool init(const FwdParams& p, int heads) {
    const auto gt = geom::grid_tile(static_cast<int>(blockIdx.x), p.h_q / heads, p.group / heads, p.batch,
                                    p.num_q_blocks, p.kv_major);
    h0 = gt.unit * heads;
    b = gt.b;
    hk = h0 / p.group;
    seq = p.seqs[b];
    geo = geom::BlockGeometry{{seq.s_q, seq.s_k, p.causal}, kBlockQ, p.block_k};
    if (gt.tile_rev >= geo.num_q_blocks()) return false;
    qb = geo.num_q_blocks() - 1 - gt.tile_rev;
    row0 = geo.row_begin(qb);
    rows_valid = static_cast<int>(geo.row_end(qb) - row0);
    visit = make_visit_list(p, geo, qb, 0);
    n_gated = geo.gated_end(qb);
    return true;
  }
};

// The sum of f(i) over i in [0, n) for every thread of the CTA (all of whose threads call it;
// blockDim.x a multiple of 32); red: blockDim.x / 32 values of shared memory.
template <class F>
__device__ __forceinline__ std::int64_t cta_sum(int n, const F& f, std::int64_t* red) {
  std::int64_t v = 0;
  for (int i = static_cast<int>(threadIdx.x); i < n; i += static_cast<int>(blockDim.x)) v += f(i);
#pragma unroll
  for (int d = 16; d > 0; d /= 2) v += __shfl_xor_sync(0xffffffffu, v, d);
  __syncthreads();  // the previous call's readers are done with red
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  std::int64_t total = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += red[w];
  return total;
}

// The full-list start of rows (b, h, qb): first + h · per_head (plan.h, GateListEntries), geo
// being sequence b's geometry. Every thread of the CTA calls it.
struct GateRowStart {
  std::int64_t first;
  std::int64_t per_head;
};
__device__ __forceinline__ GateRowStart gate_row_start(const GateParams& gp, const geom::BlockGeometry& geo, int b,
                                                       int qb, std::int64_t* red) {
  const std::int64_t before = gp.seq_gated[b];
  return {gp.fwd.h_q * before + cta_sum(qb, [&](int q) { return geo.gated_end(q); }, red), gp.seq_gated[b + 1] - before};
}

// One warp writes the decisions of (b, h, qb), whose full list starts at full0: group A, the
// blocks n_gated .. n_reg - 1 of its range-mode visit list (n_gated = n_reg - n_a), as the
// partial list; the gated blocks whose bit is set in `kept` (the CTA's votes, words of 32
// blocks), ascending, as the full list; the starts of both; both in the kept bitmap when
// p.kept_bits is set.
__device__ __forceinline__ void write_gate_row(const GateParams& gp, const geom::BlockGeometry& geo, int b, int h,
                                               int qb, const VisitList& visit, std::int64_t full0,
                                               const std::uint32_t* kept, int lane) {
  const FwdParams& p = gp.fwd;
  const int n_gated = visit.n_reg - visit.n_a;
  const std::int64_t row = (static_cast<std::int64_t>(b) * p.h_q + h) * p.num_q_blocks + qb;
  const std::int64_t partial0 = row * geo.ungated_room();
  for (int i = lane; i < visit.n_a; i += 32) gp.partial_index[partial0 + i] = n_gated + i;
  int count = 0;
  const int used_words = (n_gated + 31) / 32;
  for (int w0 = 0; w0 < used_words; w0 += 32) {
    std::uint32_t word = w0 + lane < used_words ? kept[w0 + lane] : 0u;
    const int n = __popc(word);
    int upto = n;  // inclusive scan over the lanes
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int up = __shfl_up_sync(0xffffffffu, upto, d);
      if (lane >= d) upto += up;
    }
    int at = count + upto - n;
    while (word != 0u) {
      gp.full_index[full0 + at++] = 32 * (w0 + lane) + __ffs(static_cast<int>(word)) - 1;
      word &= word - 1u;
    }
    count += __shfl_sync(0xffffffffu, upto, 31);
  }
  if (lane == 0) {
    gp.partial_start[row] = partial0;
    gp.full_start[row] = full0;
    gp.partial_count[row] = visit.n_a;
    gp.full_count[row] = count;
  }
  if (p.kept_bits == nullptr) return;
  std::uint32_t* kept_row = p.kept_bits + row * p.kept_words;
  for (int w = lane; w < p.kept_words; w += 32) {
    std::uint32_t word = w < used_words ? kept[w] : 0u;
    // Group A's bits in this word: blocks max(n_gated, 32w) .. min(n_reg, 32w + 32) - 1.
    const int lo = n_gated > 32 * w ? n_gated - 32 * w : 0;
    const int hi = visit.n_reg < 32 * w + 32 ? visit.n_reg - 32 * w : 32;
    if (lo < hi) word |= (hi - lo == 32 ? 0xffffffffu : ((1u << (hi - lo)) - 1u) << lo);
    kept_row[w] = word;
  }
}

// ------------------------------------------------------------------ mean correction
// A mean tile is kTile consecutive pooled blocks (a multiple of 32: whole bitmap words); it is
// visited when its words of the row's bitmap hold a marked block.

// Pooled blocks of the sequence (the block axis of k̄/v̄ it uses).
__device__ __forceinline__ int mean_blocks_of(const FwdParams& p, std::int64_t s_k) {
  return static_cast<int>(geom::ceil_div(s_k, p.mean_block));
}

// One warp writes the indices of the tiles to visit, ascending, to out[] and returns their
// count (in every lane). bits: the row's bitmap. Index: out's element type; the host caps the
// tiles at kMaxMeanChunks · kMeanChunk / kTile (plan.cpp).
template <int kTile, class Index>
__device__ __forceinline__ int collect_mean_tiles(const FwdParams& p, const std::uint32_t* bits, int mean_blocks_seq,
                                                  int lane, Index* out) {
  static_assert(kTile % 32 == 0, "a mean tile covers whole bitmap words");
  constexpr int kWords = kTile / 32;
  const int tiles = (mean_blocks_seq + kTile - 1) / kTile;
  int count = 0;
  for (int c0 = 0; c0 < tiles; c0 += 32) {
    const int c = c0 + lane;
    bool any = false;
    if (c < tiles) {
#pragma unroll
      for (int w = 0; w < kWords; ++w) {
        const int word = c * kWords + w;
        any |= word < p.corrected_words && bits[word] != 0u;
      }
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, any);
    if (any) out[count + __popc(ballot & ((1u << lane) - 1u))] = static_cast<Index>(c);
    count += __popc(ballot);
  }
  return count;
}

// Scores of mean tile c as pseudo-tokens: a marked block adds one pseudo-token of weight n_j,
// i.e. score s̄ + ln n_j, stored as a raw score shifted by log2(n_j) / scale_log2 so that the
// softmax's exp2(raw · scale_log2 - m) yields n_j · e^{s̄ - max}; unmarked columns get -inf.
// s is kM m16 fragments of kN n8 column fragments (mma.sync and wgmma accumulators share the
// column layout: column 8·nf + 2·(lane % 4) + e % 2); kN · 8 = kTile. kDescaled (FP8): the
// softmax exponentiates raw scores with p.scale_log2 · score_descale (the q and k descales).
// The 16-bit form reads p.scale_log2 where it divides: passing it in as a value made ptxas spill
// the Hopper kernel's plain rounds (d 96: 0 -> 92 bytes of spill stores; record
// 2026-12-04-cpu-fp8-mean-tiles-sass).
template <int kM, int kN, bool kDescaled = false>
__device__ __forceinline__ void mask_mean_tile(const FwdParams& p, float (&s)[kM][kN][4], const std::uint32_t* bits, int c,
                                               std::int64_t s_k, int mean_blocks_seq, float score_descale = 1.f) {
  constexpr int kTile = kN * 8, kWords = kTile / 32;
  const int t4 = threadIdx.x % 4;
  const std::uint32_t* tile_bits = bits + c * kWords;
  // Every pooled block holds mean_block keys except the sequence's last one.
  const int last = mean_blocks_seq - 1 - c * kTile;
  const float shift_full =
      __log2f(static_cast<float>(p.mean_block)) / (kDescaled ? p.scale_log2 * score_descale : p.scale_log2);
  const float shift_last =
      __log2f(static_cast<float>(s_k - static_cast<std::int64_t>(mean_blocks_seq - 1) * p.mean_block)) /
      (kDescaled ? p.scale_log2 * score_descale : p.scale_log2);
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    const std::uint32_t word = c * kWords + w < p.corrected_words ? tile_bits[w] : 0u;
#pragma unroll
    for (int nf = 4 * w; nf < 4 * w + 4; ++nf) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nf * 8 + 2 * t4 + (e & 1);
        const bool marked = (word >> (col % 32)) & 1u;  // never set past the last block
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
          s[mi][nf][e] = marked ? s[mi][nf][e] + (col == last ? shift_last : shift_full) : -INFINITY;
        }
      }
    }
  }
}

}  // namespace sparseprefill::cuda
