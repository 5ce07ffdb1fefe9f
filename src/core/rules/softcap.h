// SPDX-License-Identifier: Apache-2.0
// Softcap (docs/semantics.md §1): the score every softmax and every policy rule reads. Shared by
// the oracle, the CPU backend and the test support (SP_HD, so that kernels may include it).
#pragma once

#include <cmath>

#include "core/geometry.h"

namespace sparseprefill::rules {

// softcap · tanh(s / softcap), FlashAttention's definition (Gemma 2), or s itself when softcap
// is 0 (validate_problem admits only 0 and finite positive values). tanh maps ±inf to ±1, so an
// infinite score becomes ±softcap, and NaN stays NaN. T is float or double.
template <class T>
SP_HD T capped_score(T s, T softcap) {
  return softcap > T(0) ? softcap * std::tanh(s / softcap) : s;
}

}  // namespace sparseprefill::rules
