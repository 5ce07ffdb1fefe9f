// SPDX-License-Identifier: Apache-2.0
// Calibration statistics of a host sample (calibration.h), computed in fp64 in the oracle's
// order: one record per sequence. `shape` is the sample's validated shape; errors start with
// `who`.
#pragma once

#include <vector>

#include "sparseprefill/calibration.h"

namespace sparseprefill::ref {

Status block_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape, int block_q,
                        int block_k, bool want_max, bool want_g, std::vector<BlockStatistics>* out);
Status select_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                         const EstimateSelectParams& base, std::vector<SelectStatistics>* out);

}  // namespace sparseprefill::ref
