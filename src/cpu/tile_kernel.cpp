// SPDX-License-Identifier: Apache-2.0
// The CPU backend's inner loop (see tile_kernel.h): register-blocked Q·Kᵀ and P·V over 16-lane
// fp32 vectors, compiled per instruction set (SP_CPU_CLONES). No allocation, no virtual calls.
#include "cpu/tile_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/rules/nan_max.h"
#include "core/rules/softcap.h"
#include "cpu/simd.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace sparseprefill::cpu {

using simd::VecF;
using simd::VecI;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

void TileState::reset() {
  std::fill(o, o + static_cast<std::int64_t>(rows_pad) * ld_v, 0.0f);
  std::fill(m, m + rows_pad, -kInf);
  std::fill(l, l + rows_pad, 0.0f);
}

// kRowGroup rows × kKeyAlign keys of S per step, accumulators in registers; the d loop reads
// one row of kt (contiguous) and broadcasts one q element per row.
SP_CPU_CLONES
void tile_scores(const TileState& t, const float* kt, int ld_k, float* s) {
  const float* __restrict q = t.q;
  for (int i0 = 0; i0 < t.rows_pad; i0 += kRowGroup) {
    const float* q0 = q + static_cast<std::int64_t>(i0) * t.ld;
    for (int j0 = 0; j0 < ld_k; j0 += kKeyAlign) {
      VecF acc[kRowGroup] = {};
      for (int c = 0; c < t.d; ++c) {
        const VecF k = simd::load(kt + static_cast<std::int64_t>(c) * ld_k + j0);
        for (int r = 0; r < kRowGroup; ++r) acc[r] += q0[r * t.ld + c] * k;
      }
      for (int r = 0; r < kRowGroup; ++r) {
        simd::store(s + static_cast<std::int64_t>(i0 + r) * ld_k + j0, acc[r] * t.scale);
      }
    }
  }
  if (t.softcap > 0.0f) {
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(t.rows_pad) * ld_k; ++i) s[i] = rules::capped_score(s[i], t.softcap);
  }
}

SP_CPU_CLONES
void tile_row_max(const float* s, int ld_s, int rows, const int* begin, const int* limit, float* out) {
  const VecI lane = simd::iota();
  const VecF neg_inf = simd::splat(-kInf);
  for (int i = 0; i < rows; ++i) {
    const float* row = s + static_cast<std::int64_t>(i) * ld_s;
    const int lo = begin[i], lim = limit[i];
    VecF mx = neg_inf;
    VecI nan = {};  // NaN is tracked apart so the max itself stays a plain compare-select
    for (int j0 = lo / kKeyAlign * kKeyAlign; j0 < lim; j0 += kKeyAlign) {
      VecF x = simd::load(row + j0);
      x = (lane + j0) < lim && (lane + j0) >= lo ? x : neg_inf;
      nan |= x != x;
      mx = x > mx ? x : mx;
    }
    float r = -kInf;
    int any_nan = 0;
    for (int k = 0; k < kKeyAlign; ++k) {
      r = mx[k] > r ? mx[k] : r;
      any_nan |= nan[k];
    }
    out[i] = any_nan != 0 ? std::numeric_limits<float>::quiet_NaN() : r;
  }
}

SP_CPU_CLONES
void tile_update(TileState& t, float* s, int ld_s, const int* begin, const int* limit, int n, const float* row_max,
                 const float* v, std::int64_t ld_v, float* dl) {
  const VecI lane = simd::iota();
  for (int i = 0; i < t.rows; ++i) {
    float* p = s + static_cast<std::int64_t>(i) * ld_s;
    const int lo = begin[i], lim = limit[i];
    if (lim <= lo) {
      std::fill(p, p + round_up(n, kKeyAlign), 0.0f);
      if (dl != nullptr) dl[i] = 0.0f;
      continue;
    }
    const float m_new = rules::nan_max(t.m[i], row_max[i]);
    // A row whose scores are all -inf so far keeps m = -inf; exponentiate against 0 instead so
    // that -inf - -inf never makes a NaN (every p is then exactly 0).
    const float base = m_new == -kInf ? 0.0f : m_new;
    const VecF b = simd::splat(base);
    VecF sum = {};
    const int j_lo = lo / kKeyAlign * kKeyAlign;
    std::fill(p, p + j_lo, 0.0f);
    for (int j0 = j_lo; j0 < round_up(lim, kKeyAlign); j0 += kKeyAlign) {
      VecF e = simd::exp(simd::load(p + j0) - b);
      e = (lane + j0) < lim && (lane + j0) >= lo ? e : VecF{};
      simd::store(p + j0, e);
      sum += e;
    }
    std::fill(p + round_up(lim, kKeyAlign), p + round_up(n, kKeyAlign), 0.0f);
    const float added = simd::reduce_add(sum);
    const float corr = std::exp(t.m[i] - base);
    t.l[i] = t.l[i] * corr + added;
    t.m[i] = m_new;
    if (dl != nullptr) dl[i] = added;
    float* o = t.o + static_cast<std::int64_t>(i) * t.ld_v;
    const VecF cv = simd::splat(corr);
    for (int c0 = 0; c0 < t.ld_v; c0 += kKeyAlign) simd::store(o + c0, simd::load(o + c0) * cv);
  }
  // Padding rows carry P = 0 so the blocked loop below may include them.
  for (int i = t.rows; i < t.rows_pad; ++i) {
    std::fill(s + static_cast<std::int64_t>(i) * ld_s, s + static_cast<std::int64_t>(i) * ld_s + n, 0.0f);
  }
  // P·V per group of kRowGroup rows: the keys every row of the group reads, [lo, hi), run
  // register-blocked (o rows in registers, one V row load per key); each row's remaining keys
  // run alone. No row ever multiplies a value it cannot see.
  for (int i0 = 0; i0 < t.rows_pad; i0 += kRowGroup) {
    int lo = 0, hi = n;
    for (int i = i0; i < std::min(i0 + kRowGroup, t.rows); ++i) {
      lo = std::max(lo, begin[i]);
      hi = std::min(hi, limit[i]);
    }
    const float* p0 = s + static_cast<std::int64_t>(i0) * ld_s;
    float* o0 = t.o + static_cast<std::int64_t>(i0) * t.ld_v;
    const bool common = hi > lo;
    if (common) {
      for (int c0 = 0; c0 < t.ld_v; c0 += kKeyAlign) {
        VecF acc[kRowGroup];
        for (int r = 0; r < kRowGroup; ++r) acc[r] = simd::load(o0 + r * t.ld_v + c0);
        for (int j = lo; j < hi; ++j) {
          const VecF vv = simd::load(v + j * ld_v + c0);
          for (int r = 0; r < kRowGroup; ++r) acc[r] += p0[r * ld_s + j] * vv;
        }
        for (int r = 0; r < kRowGroup; ++r) simd::store(o0 + r * t.ld_v + c0, acc[r]);
      }
    }
    for (int i = i0; i < std::min(i0 + kRowGroup, t.rows); ++i) {
      // The row's keys outside the common range: below it and above it.
      const int ranges[2][2] = {{begin[i], common ? lo : limit[i]}, {common ? hi : limit[i], limit[i]}};
      const float* p = s + static_cast<std::int64_t>(i) * ld_s;
      float* o = t.o + static_cast<std::int64_t>(i) * t.ld_v;
      for (const auto& range : ranges) {
        if (range[1] <= range[0]) continue;
        for (int c0 = 0; c0 < t.ld_v; c0 += kKeyAlign) {
          VecF acc = simd::load(o + c0);
          for (int j = range[0]; j < range[1]; ++j) acc += p[j] * simd::load(v + j * ld_v + c0);
          simd::store(o + c0, acc);
        }
      }
    }
  }
}

void tile_finish_row(const TileState& t, int i, float sink, float* o_row, float* lse) {
  const float* o = t.o + static_cast<std::int64_t>(i) * t.ld_v;
  const float m = t.m[i];
  if (m == -kInf && sink == -kInf) {
    std::fill(o_row, o_row + t.d_v, 0.0f);
    *lse = -kInf;
    return;
  }
  // Without a sink (-inf) M = m, the factor is e^0 = 1 and the sink's term e^{-inf} = 0: exactly
  // the plain normalisation o / l.
  const float mx = rules::nan_max(m, sink);
  const float corr = std::exp(m - mx);
  const float l = t.l[i] * corr + std::exp(sink - mx);
  for (int c = 0; c < t.d_v; ++c) o_row[c] = o[c] * corr / l;
  *lse = mx + std::log(l);
}

}  // namespace sparseprefill::cpu
