// SPDX-License-Identifier: Apache-2.0
// The calibrated comparison of docs/numerics.md. A backend's output is compared with the fp64
// oracle, and its error must be at most `factor` times that of a low-precision reference
// (same decisions, inputs in their dtype, fp32 accumulation, P rounded to the input dtype
// before P·V, O rounded to the dtype) plus a rounding epsilon. LSE gets its own fp32 check.
// NaN never passes, except where the oracle itself is NaN, which must then match.
#pragma once

#include <gtest/gtest.h>

#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {

struct Tolerance {
  double factor = 2.0;   // allowed multiple of the low-precision reference's max error
  double eps = -1.0;     // absolute slack on O; < 0: unit roundoff of the dtype × max|O| of the
                         // oracle (2^-8 bf16, 2^-11 fp16, 2^-20 fp32): about one ulp of the
                         // largest output, not a fixed absolute floor that small outputs would hide under
  double lse_eps = -1.0; // absolute slack on LSE; < 0: 1e-5 × max(1, max|LSE|)
};

// A host output (o, lse views of a validated problem) read back into the oracle's layout:
// o [rows, h_q, d], lse [h_q, rows], rows in batch order. `lse` may be undefined (then the
// result's lse is empty and LSE is not compared).
ref::Result read_output(const AttentionOutput& out, const ProblemShape& shape);

// The low-precision reference for (problem, policy) under `decisions` (from any backend;
// checked with ref::check_decisions): same key sets and mean-correction pseudo-tokens as the
// oracle, in fp32 arithmetic with P rounded to the input dtype (FP8: to e4m3, and the block
// means requantized to e4m3 as the Hopper kernel's mean tiles read them). result->decisions =
// decisions.
Status run_lowp_reference(const AttentionProblem& problem, const Policy& policy,
                          const Decisions& decisions, ref::Result* result);

// The calibrated check of `out` against the oracle `ref64` and the low-precision reference
// `lowp` (all in the oracle's layout; `dtype` is the inputs'). The failure message gives the
// max and mean errors, where the max error is, and the calibration numbers.
::testing::AssertionResult close_calibrated(DType dtype, const ref::Result& out,
                                            const ref::Result& ref64, const ref::Result& lowp,
                                            const Tolerance& tol = {});

// All in one for a backend's host output: runs the oracle on (problem, policy), the
// low-precision reference on the oracle's decisions, and close_calibrated. The oracle's result
// goes to *ref64 when given (e.g. to compare decisions afterwards).
::testing::AssertionResult matches_reference(const AttentionProblem& problem,
                                             const Policy& policy, const AttentionOutput& out,
                                             const Tolerance& tol = {},
                                             ref::Result* ref64 = nullptr);

}  // namespace sparseprefill::test
