// SPDX-License-Identifier: Apache-2.0
// The CPU backend: fp32 arithmetic, multithreaded over (batch, head, query block), built like
// a kernel (block loop, online softmax, in-loop gates) so it exercises the structure the GPU
// kernels use. Makes the oracle's decisions; matches its outputs within the calibrated
// tolerance of docs/numerics.md.
#pragma once

#include "sparseprefill/attention.h"

namespace sparseprefill::cpu {

// `shape` is validate_problem's result for (problem, &output). Fills `decisions` always.
Status run_cpu(const AttentionProblem& problem, const ProblemShape& shape, const Policy& policy,
               const AttentionOutput& output, int num_threads, Decisions* decisions);

}  // namespace sparseprefill::cpu
