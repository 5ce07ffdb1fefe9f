// SPDX-License-Identifier: Apache-2.0
// Small comparisons for results that must agree (nearly) exactly: two fp64 computations of the
// same quantity, or a mask row read as a list.
#pragma once

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include "reference/reference.h"
#include "sparseprefill/block_mask.h"

namespace sparseprefill::test {

// O and LSE equal within `tol` (absolute); NaN must meet NaN and an infinity the same infinity.
// tol = 0 asks for bitwise-equal values.
::testing::AssertionResult same_result(const ref::Result& got, const ref::Result& want, double tol);

// The selected key blocks (full and partial) of mask row (b, h, qb), ascending.
std::vector<int> kept_blocks(const BlockMask& mask, int b, int h, int qb);

}  // namespace sparseprefill::test
