// SPDX-License-Identifier: Apache-2.0
// The fp64 oracle: every policy of docs/semantics.md in obvious loops, accumulating in double.
// It is the specification the CPU backend and the GPU kernels are tested against; it favours
// clarity over speed (test sizes up to a few thousand tokens).
#pragma once

#include <vector>

#include "sparseprefill/attention.h"

namespace sparseprefill::ref {

struct Result {
  // O as [rows, h_q, d_v] and LSE as [h_q, rows], rows = sequences' query rows in batch order
  // (for batched q, row = b·s_q + r). A row that sees no key: O = 0, LSE = -inf.
  std::vector<double> o;
  std::vector<double> lse;
  Decisions decisions;
};

// Validates and decides only (decide_reference then attend_decisions is run_reference): the
// oracle's Decisions for every policy, in the layout init_decisions sizes.
Status decide_reference(const AttentionProblem& problem, const Policy& policy, Decisions* decisions);

// Validates, decides and computes. Inputs are read exactly (bf16/fp16/fp32 -> double).
Status run_reference(const AttentionProblem& problem, const Policy& policy, Result* result);

}  // namespace sparseprefill::ref
