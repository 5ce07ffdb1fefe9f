// SPDX-License-Identifier: Apache-2.0
// Online softmax over one warp's rows of a score tile, in the exp2 domain, with the -inf and
// NaN rules of docs/numerics.md. Shared by every forward kernel (sm80 now, sm90 later): the
// running statistics and their edge cases are defined once. Device-only.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/rules/sinks.h"
#include "core/rules/softcap.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda {

// The statistics of the rows a thread holds in kM m16n8 accumulator fragments: rows g and
// g + 8 of each of its warp's kM 16-row groups, indexed r = 2·mi + (e / 2) for fragment mi and
// accumulator element e. Scores arrive raw (q·k, unscaled); m is kept in the log2 domain,
// m = max(q·k) · scale · log2(e), so exp2(q·k · scale_log2 - m) = e^{s - max s}.
template <int kM>
struct RowStats {
  float m[2 * kM];  // running max (log2 domain); -inf while the row has seen no key; NaN sticks
  float l[2 * kM];  // this thread's partial sum of p over its columns (quad-reduced at the end)
};

template <int kM>
__device__ __forceinline__ void init_row_stats(RowStats<kM>& st) {
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    st.m[r] = -INFINITY;
    st.l[r] = 0.f;
  }
}

// Row maxima of a raw score fragment s[kM][kN][4] (masked entries are -inf), reduced over the
// quad of threads that share the rows. NaN-propagating: a NaN score makes the row max NaN, so
// the gates keep the block and the output becomes NaN, as in the oracle.
template <int kM, int kN>
__device__ __forceinline__ void row_max(const float (&s)[kM][kN][4], float (&mx)[2 * kM]) {
  static_assert((kN & (kN - 1)) == 0, "tree reduction over a power-of-two fragment count");
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // A tree over the row's 2·kN values: short dependency chains (few warps per scheduler).
      float t[kN];
#pragma unroll
      for (int nf = 0; nf < kN; ++nf) t[nf] = ptx::max_nan(s[mi][nf][2 * half], s[mi][nf][2 * half + 1]);
#pragma unroll
      for (int w = kN / 2; w > 0; w /= 2) {
#pragma unroll
        for (int i = 0; i < w; ++i) t[i] = ptx::max_nan(t[i], t[i + w]);
      }
      mx[2 * mi + half] = t[0];
    }
  }
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    mx[r] = ptx::max_nan(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = ptx::max_nan(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
}

// Lazy rescaling (FlashAttention-4's conditional rescale): the max a tile's exponents subtract
// may lag the row's true running max by up to kLazyMaxLog2 (log2 domain), so p <= 2^8 = 256:
// no 16-bit or e4m3 P saturates, and each rounds p with the same relative error. A row keeps
// its running max m while the tile's scaled max stays within kLazyMaxLog2 of it, and then its
// l and O need no rescale; m, l and O describe the same sums at any reference max, so only
// roundings move. The decision is the row's own (a row's result never depends on which rows
// share its warp: pack_gqa's packed tiles equal the unpacked ones bitwise); the warp only
// skips the accumulator's multiply when none of its rows moves. Invariant: the true running
// max is at most m + kLazyMaxLog2 (a move sets m to max(m, tile max)). Not under
// softmax_skip, whose gate compares tile maxima with the running max itself.
constexpr float kLazyMaxLog2 = tuning::kLazyMaxLog2;

// Whether a row with running max m (log2 domain) must move it to include a tile whose raw row
// max is mx: the scaled max exceeds m by more than lazy_max (kLazyMaxLog2; the FP8 kernel's is
// its own), or m is -inf (no key seen yet: -inf - -inf is NaN too) or a NaN is involved, where
// rescale's exact rules apply. A row that keeps m has a finite m (or +inf, which only an
// infinite score gives, and then l is already NaN).
__device__ __forceinline__ bool row_must_move(float m, float mx, float scale_log2, float lazy_max = kLazyMaxLog2) {
  return !(mx * scale_log2 - m <= lazy_max);
}

// One row's running max m (log2 domain) moved to include a tile whose raw row max is mx: the
// max the tile's exponents subtract (m_use) and the factor of the row's l and O
// (alpha = exp2(m_old - m_use)). When the new max is -inf (the row has seen no key, this tile
// included) m_use is 0, so exp2(-inf - 0) = 0 and no -inf - (-inf) = NaN appears; alpha is then
// exp2(-inf) = 0 on an all-zero accumulator. kBias: m is kept kBias below the true max, so the
// exponents come out 2^kBias larger (the FP8 kernel's kFp8PLog2Offset; l and O carry the factor,
// and the LSE m + log2 l is unchanged).
template <int kBias = 0>
__device__ __forceinline__ void move_row(float& m, float mx, float scale_log2, float& m_use, float& alpha) {
  float tile_max = mx * scale_log2;
  if constexpr (kBias != 0) tile_max -= static_cast<float>(kBias);
  const float m_new = ptx::max_nan(m, tile_max);
  m_use = m_new == -INFINITY ? 0.f : m_new;
  alpha = ptx::exp2f_fast(m - m_use);
  m = m_new;
}

// Moves the running max of the rows marked in `move` to include a tile (or block) whose raw
// row maxima are mx (move_row): rescales their l and their rows of the output accumulator
// acc[kM][kD][4] by alpha, and returns in m_use the max the tile's exponents subtract (a row
// not moved keeps m: m_use = m, alpha = 1).
template <int kM, int kD>
__device__ __forceinline__ void move_rows(RowStats<kM>& st, const float (&mx)[2 * kM], float scale_log2,
                                          const bool (&move)[2 * kM], float (&acc)[kM][kD][4],
                                          float (&m_use)[2 * kM]) {
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    float alpha = 1.f;
    m_use[r] = st.m[r];
    if (move[r]) move_row(st.m[r], mx[r], scale_log2, m_use[r], alpha);
    st.l[r] *= alpha;
#pragma unroll
    for (int df = 0; df < kD; ++df) {
      acc[r / 2][df][2 * (r % 2)] *= alpha;
      acc[r / 2][df][2 * (r % 2) + 1] *= alpha;
    }
  }
}

// The exact update: every row moves.
template <int kM, int kD>
__device__ __forceinline__ void rescale(RowStats<kM>& st, const float (&mx)[2 * kM], float scale_log2,
                                        float (&acc)[kM][kD][4], float (&m_use)[2 * kM]) {
  bool all[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) all[r] = true;
  move_rows(st, mx, scale_log2, all, acc, m_use);
}

// The lazy update: the rows row_must_move names move; when no row of the warp moves, acc is
// not touched at all. Warp-uniform: every lane of the warp calls it.
template <int kM, int kD>
__device__ __forceinline__ void rescale_lazy(RowStats<kM>& st, const float (&mx)[2 * kM], float scale_log2,
                                             float (&acc)[kM][kD][4], float (&m_use)[2 * kM]) {
  bool move[2 * kM];
  bool any = false;
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    move[r] = row_must_move(st.m[r], mx[r], scale_log2);
    any |= move[r];
    m_use[r] = st.m[r];
  }
  if (__any_sync(0xffffffffu, any)) move_rows(st, mx, scale_log2, move, acc, m_use);
}

// p = exp2(s · scale_log2 - m_use) for a raw score tile, summed into l, and packed as the A
// fragments of P·V: [kM][kN / 2][4] 16-bit pairs, rounded to the input dtype (the P rounding
// the tolerance of docs/numerics.md allows for). A NaN max propagates into p and l.
template <bool kBf16, int kM, int kN>
__device__ __forceinline__ void exp_pack(const float (&s)[kM][kN][4], const float (&m_use)[2 * kM],
                                         float scale_log2, float (&l)[2 * kM],
                                         std::uint32_t (&p)[kM][kN / 2][4]) {
  // Accumulator fragments of key columns 16kk..16kk+15 are exactly the A fragment of k-step
  // kk; each pair of n8 fragments is exponentiated and packed at once (few live temporaries).
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int kk = 0; kk < kN / 2; ++kk) {
      float e[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int i = 0; i < 4; ++i) e[h][i] = ptx::exp2f_fast(fmaf(s[mi][2 * kk + h][i], scale_log2, -m_use[2 * mi + i / 2]));
      }
      // Pairwise partial sums: one dependent add on l per row and k-step.
      l[2 * mi] += (e[0][0] + e[0][1]) + (e[1][0] + e[1][1]);
      l[2 * mi + 1] += (e[0][2] + e[0][3]) + (e[1][2] + e[1][3]);
      p[mi][kk][0] = ptx::pack2<kBf16>(e[0][0], e[0][1]);
      p[mi][kk][1] = ptx::pack2<kBf16>(e[0][2], e[0][3]);
      p[mi][kk][2] = ptx::pack2<kBf16>(e[1][0], e[1][1]);
      p[mi][kk][3] = ptx::pack2<kBf16>(e[1][2], e[1][3]);
    }
  }
}

// Final normalisation of one row: the factor O is multiplied by and the natural-log LSE.
// l_part is this thread's part of the row sum, added here over the quad of threads that hold
// the row (every thread of the quad calls it). An empty row (l = 0: it saw no key) gets O = 0
// and LSE = -inf; a NaN row gets NaN for both.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ void finalize_row(float m, float l_part, float* o_scale, float* lse) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float l_sum = quad_sum(l_part);
  if (l_sum == 0.f) {
    *o_scale = 0.f;
    *lse = -INFINITY;
  } else {
    *o_scale = 1.f / l_sum;
    *lse = (m + __log2f(l_sum)) * kLn2;
  }
}

// The softcap on a raw score fragment s[kM][kN][4] (FwdParams::softcap, the kFeatures kernels):
// each q·k becomes rules::capped_score(cap_scale · q·k, softcap), the logit itself (the softmax
// then runs with scale 1). Before the element mask, which then writes -inf over capped values.
template <int kM, int kN>
__device__ __forceinline__ void cap_scores(float (&s)[kM][kN][4], float cap_scale, float softcap) {
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int nf = 0; nf < kN; ++nf) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[mi][nf][e] = rules::capped_score(s[mi][nf][e] * cap_scale, softcap);
    }
  }
}

// A head's learned sink in the log2 domain of m (σ · log2(e)), from FwdParams' sinks [h_q] with
// element stride `stride` (0 without sinks, so the address is formed either way); -inf (none)
// without sinks.
__device__ __forceinline__ float head_sink_log2(const float* sinks, std::int64_t stride, int head) {
  const float* sink = sinks + head * stride;
  return sinks != nullptr ? *sink * 1.4426950408889634f : -INFINITY;
}

// finalize_row with a learned sink: sink_log2 = σ · log2(e), -inf for none (finalize_row);
// else rules::finalize_with_sink over the quad's row sum (O = 0 and LSE = σ for a row that saw
// no key; a NaN or +inf sink makes the row NaN).
__device__ __forceinline__ void finalize_row_sink(float m, float l_part, float sink_log2, float* o_scale,
                                                  float* lse) {
  if (sink_log2 == -INFINITY) {
    finalize_row(m, l_part, o_scale, lse);
    return;
  }
  rules::finalize_with_sink(m, quad_sum(l_part), sink_log2, o_scale, lse);
}

}  // namespace sparseprefill::cuda
