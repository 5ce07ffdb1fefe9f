// SPDX-License-Identifier: Apache-2.0
// Online softmax over one warp's rows of a score tile, in the exp2 domain, with the -inf and
// NaN rules of docs/numerics.md. Shared by every forward kernel (sm80 now, sm90 later): the
// running statistics and their edge cases are defined once. Device-only.
#pragma once

#include <cmath>
#include <cstdint>

#include "cuda/kernel/ptx.cuh"

namespace sparseprefill::cuda {

// The statistics of the two rows a thread holds in an m16n8 accumulator fragment (rows g and
// g + 8 of its warp's 16). Scores arrive raw (q·k, unscaled); m is kept in the log2 domain,
// m = max(q·k) · scale · log2(e), so exp2(q·k · scale_log2 - m) = e^{s - max s}.
struct RowStats {
  float m[2];  // running max (log2 domain); -inf while the row has seen no key; NaN is sticky
  float l[2];  // this thread's partial sum of p over its columns (quad-reduced at the end)
};

__device__ __forceinline__ void init_row_stats(RowStats& st) {
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;
}

// Row maxima of a raw score fragment s[kNFrags][4] (masked entries are -inf), reduced over the
// quad of threads that share the rows. NaN-propagating: a NaN score makes the row max NaN, so
// the gates keep the block and the output becomes NaN, as in the oracle.
template <int kNFrags>
__device__ __forceinline__ void row_max(const float (&s)[kNFrags][4], float (&mx)[2]) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int nf = 0; nf < kNFrags; ++nf) {
    mx[0] = ptx::max_nan(mx[0], ptx::max_nan(s[nf][0], s[nf][1]));
    mx[1] = ptx::max_nan(mx[1], ptx::max_nan(s[nf][2], s[nf][3]));
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = ptx::max_nan(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = ptx::max_nan(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
  }
}

// Folds one tile into the running statistics and produces P for the PV product.
//   s      raw scores [kNFrags][4] (masked = -inf), consumed
//   mx     their row maxima (row_max)
//   acc    the output accumulator [kDFrags][4], rescaled to the new max
//   p      P as A-operand fragments of m16n8k16: [kNFrags / 2][4] packed 16-bit pairs, rounded
//          to the input dtype (the P rounding the tolerance of docs/numerics.md allows for)
// Numerics: when the new max is -inf (the row has seen no key, this tile included) the
// exponent uses 0 instead, so exp2(-inf - 0) = 0 and no -inf - (-inf) = NaN appears; alpha is
// then exp2(-inf) = 0 on an all-zero accumulator. A NaN max propagates into p, l and acc.
template <bool kBf16, int kNFrags, int kDFrags>
__device__ __forceinline__ void online_softmax(float (&s)[kNFrags][4], const float (&mx)[2],
                                               float scale_log2, RowStats& st,
                                               float (&acc)[kDFrags][4],
                                               std::uint32_t (&p)[kNFrags / 2][4]) {
  float m_use[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float m_new = ptx::max_nan(st.m[i], mx[i] * scale_log2);
    m_use[i] = m_new == -INFINITY ? 0.f : m_new;
    const float alpha = ptx::exp2f_fast(st.m[i] - m_use[i]);
    st.m[i] = m_new;
    st.l[i] *= alpha;
#pragma unroll
    for (int df = 0; df < kDFrags; ++df) {
      acc[df][2 * i] *= alpha;
      acc[df][2 * i + 1] *= alpha;
    }
  }
#pragma unroll
  for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[nf][e] = ptx::exp2f_fast(fmaf(s[nf][e], scale_log2, -m_use[e / 2]));
      st.l[e / 2] += s[nf][e];
    }
  }
  // Accumulator fragments of key columns 16kk..16kk+15 are exactly the A fragment of k-step kk.
#pragma unroll
  for (int kk = 0; kk < kNFrags / 2; ++kk) {
    p[kk][0] = ptx::pack2<kBf16>(s[2 * kk][0], s[2 * kk][1]);
    p[kk][1] = ptx::pack2<kBf16>(s[2 * kk][2], s[2 * kk][3]);
    p[kk][2] = ptx::pack2<kBf16>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
    p[kk][3] = ptx::pack2<kBf16>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
  }
}

// Final normalisation of one row: the factor O is multiplied by and the natural-log LSE.
// l_sum is the quad-reduced sum. An empty row (l = 0: it saw no key) gets O = 0 and
// LSE = -inf; a NaN row gets NaN for both.
__device__ __forceinline__ void finalize_row(float m, float l_sum, float* o_scale, float* lse) {
  constexpr float kLn2 = 0.6931471805599453f;
  if (l_sum == 0.f) {
    *o_scale = 0.f;
    *lse = -INFINITY;
  } else {
    *o_scale = 1.f / l_sum;
    *lse = (m + __log2f(l_sum)) * kLn2;
  }
}

}  // namespace sparseprefill::cuda
