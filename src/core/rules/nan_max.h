// SPDX-License-Identifier: Apache-2.0
// The maximum every decision rule takes (docs/semantics.md §1, "NaN"): NaN when either
// operand is NaN, so that a NaN score reaches the rule's comparison, whose outcome on NaN each
// rule states. Shared by the oracle, the CPU backend and the other rules (SP_HD).
#pragma once

#include "core/geometry.h"

namespace sparseprefill::rules {

// max(a, b) for float or double; NaN if either is NaN (std::max drops a NaN second operand).
template <class T>
SP_HD T nan_max(T a, T b) {
  return (b > a || b != b) ? b : a;
}

}  // namespace sparseprefill::rules
