// SPDX-License-Identifier: Apache-2.0
// The CPU backend's inner loop (see tile_kernel.h): register-blocked Q·Kᵀ and P·V over 16-lane
// fp32 vectors, compiled per instruction set (SP_CPU_CLONES). No allocation, no virtual calls.
#include "cpu/tile_kernel.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/rules/nan_max.h"
#include "cpu/simd.h"

#pragma GCC diagnostic ignored "-Wpsabi"

namespace sparseprefill::cpu {

using simd::VecF;
using simd::VecI;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

}  // namespace

void TileState::reset() {
  std::fill(o, o + static_cast<std::int64_t>(rows_pad) * ld, 0.0f);
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
}

SP_CPU_CLONES
void tile_row_max(const float* s, int ld_s, int rows, const int* limit, float* out) {
  const VecI lane = simd::iota();
  const VecF neg_inf = simd::splat(-kInf);
  for (int i = 0; i < rows; ++i) {
    const float* row = s + static_cast<std::int64_t>(i) * ld_s;
    const int lim = limit[i];
    VecF mx = neg_inf;
    VecI nan = {};  // NaN is tracked apart so the max itself stays a plain compare-select
    for (int j0 = 0; j0 < lim; j0 += kKeyAlign) {
      VecF x = simd::load(row + j0);
      x = (lane + j0) < lim ? x : neg_inf;
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
void tile_update(TileState& t, float* s, int ld_s, const int* limit, int n, const float* row_max, const float* v, std::int64_t ld_v, float* dl) {
  const VecI lane = simd::iota();
  for (int i = 0; i < t.rows; ++i) {
    float* p = s + static_cast<std::int64_t>(i) * ld_s;
    const int lim = limit[i];
    if (lim == 0) {
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
    for (int j0 = 0; j0 < round_up(lim, kKeyAlign); j0 += kKeyAlign) {
      VecF e = simd::exp(simd::load(p + j0) - b);
      e = (lane + j0) < lim ? e : VecF{};
      simd::store(p + j0, e);
      sum += e;
    }
    std::fill(p + round_up(lim, kKeyAlign), p + round_up(n, kKeyAlign), 0.0f);
    const float added = simd::reduce_add(sum);
    const float corr = std::exp(t.m[i] - base);
    t.l[i] = t.l[i] * corr + added;
    t.m[i] = m_new;
    if (dl != nullptr) dl[i] = added;
    float* o = t.o + static_cast<std::int64_t>(i) * t.ld;
    const VecF cv = simd::splat(corr);
    for (int c0 = 0; c0 < t.ld; c0 += kKeyAlign) simd::store(o + c0, simd::load(o + c0) * cv);
  }
  // Padding rows carry P = 0 so the blocked loop below may include them.
  for (int i = t.rows; i < t.rows_pad; ++i) {
    std::fill(s + static_cast<std::int64_t>(i) * ld_s, s + static_cast<std::int64_t>(i) * ld_s + n, 0.0f);
  }
  // P·V per group of kRowGroup rows: keys every row of the group sees run register-blocked
  // (o rows in registers, one V row load per key); each row's remaining keys run alone. No row
  // ever multiplies a value it cannot see.
  for (int i0 = 0; i0 < t.rows_pad; i0 += kRowGroup) {
    int common = n;
    for (int i = i0; i < std::min(i0 + kRowGroup, t.rows); ++i) common = std::min(common, limit[i]);
    const float* p0 = s + static_cast<std::int64_t>(i0) * ld_s;
    float* o0 = t.o + static_cast<std::int64_t>(i0) * t.ld;
    if (common > 0) {
      for (int c0 = 0; c0 < t.ld; c0 += kKeyAlign) {
        VecF acc[kRowGroup];
        for (int r = 0; r < kRowGroup; ++r) acc[r] = simd::load(o0 + r * t.ld + c0);
        for (int j = 0; j < common; ++j) {
          const VecF vv = simd::load(v + j * ld_v + c0);
          for (int r = 0; r < kRowGroup; ++r) acc[r] += p0[r * ld_s + j] * vv;
        }
        for (int r = 0; r < kRowGroup; ++r) simd::store(o0 + r * t.ld + c0, acc[r]);
      }
    }
    for (int i = i0; i < std::min(i0 + kRowGroup, t.rows); ++i) {
      if (limit[i] <= common) continue;
      const float* p = s + static_cast<std::int64_t>(i) * ld_s;
      float* o = t.o + static_cast<std::int64_t>(i) * t.ld;
      for (int c0 = 0; c0 < t.ld; c0 += kKeyAlign) {
        VecF acc = simd::load(o + c0);
        for (int j = common; j < limit[i]; ++j) acc += p[j] * simd::load(v + j * ld_v + c0);
        simd::store(o + c0, acc);
      }
    }
  }
}

void tile_finish_row(const TileState& t, int i, float* o_row, float* lse) {
  const float* o = t.o + static_cast<std::int64_t>(i) * t.ld;
  if (t.m[i] == -kInf) {
    std::fill(o_row, o_row + t.d, 0.0f);
    *lse = -kInf;
    return;
  }
  const float l = t.l[i];
  for (int c = 0; c < t.d; ++c) o_row[c] = o[c] / l;
  *lse = t.m[i] + std::log(l);
}

}  // namespace sparseprefill::cpu
