// SPDX-License-Identifier: Apache-2.0
// Exact comparison of two backends' Decisions (DESIGN.md §3: GPU kernels and the CPU backend
// make the oracle's keep/skip decisions exactly, on inputs placed away from ties).
#pragma once

#include <gtest/gtest.h>

#include "sparseprefill/attention.h"

namespace sparseprefill::test {

// Equal policy names, masks (geometry and every selected block of `kept` and `corrected`),
// permute_stop tiles and query orders. The message lists the first differences.
::testing::AssertionResult same_decisions(const Decisions& expected, const Decisions& actual);

}  // namespace sparseprefill::test
