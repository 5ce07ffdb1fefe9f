// SPDX-License-Identifier: Apache-2.0
// Learned sinks (docs/semantics.md §1): a row's last softmax step with its head's sink, as the
// forward kernels take it (SP_HD; tested on the host). The row arrives as the kernels keep it:
// m its running maximum and l its denominator relative to m, both in the log2 domain (scores
// times log2 e), and the sink as σ · log2 e.
#pragma once

#include <cmath>

#include "core/geometry.h"
#include "core/rules/nan_max.h"

namespace sparseprefill::rules {

// The factor the row's numerator (relative to m) is multiplied by, and its LSE (natural log),
// with the sink as one more term of the denominator and the maximum, none of the numerator:
// M = max(m, σ), den = l · 2^(m - M) + 2^(σ - M), o_scale = 2^(m - M) / den,
// LSE = (M + log2 den) · ln 2. For σ > -inf (a -inf sink is none: the plain finalisation). A row
// that saw no key (l = 0, m = -inf) gets o_scale 0 and LSE σ; a NaN or +inf σ, or a NaN m,
// makes both NaN (nan_max; +inf - +inf). T is float or double.
template <class T>
SP_HD void finalize_with_sink(T m, T l, T sink, T* o_scale, T* lse) {
  const T top = nan_max(m, sink);
  const T keys = std::exp2(m - top);  // 0 for a row that saw no key
  const T den = l * keys + std::exp2(sink - top);
  *o_scale = keys / den;
  *lse = (top + std::log2(den)) * T(0.69314718055994530942);
}

}  // namespace sparseprefill::rules
