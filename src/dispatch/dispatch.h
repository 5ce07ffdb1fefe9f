// SPDX-License-Identifier: Apache-2.0
// The dispatch layer's internal interface (src/dispatch, and the calibrators above it): the
// compiled backends and the calibration statistics routed to the backend of a sample's device.
#pragma once

#include <vector>

#include "core/backend.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill::detail {

// The backend behind `kind` (kReference, kCPU, kCUDA), or null when this build lacks it.
const BackendImpl* backend_impl(Backend kind);

// Validates a calibration sample and resolves its shape: causal, bf16/fp16/fp32, host or CUDA
// tensors. Messages start with `who`.
Status check_sample(const char* who, const AttentionProblem& sample, ProblemShape* shape);

// compute_block_statistics / compute_select_statistics with messages starting with `who`:
// host samples on the reference backend (fp64, the oracle's order), CUDA samples on the GPU.
Status block_statistics(const char* who, const AttentionProblem& sample, int block_q, int block_k, bool want_max,
                        bool want_g, void* cuda_stream, std::vector<BlockStatistics>* out);
Status select_statistics(const char* who, const AttentionProblem& sample, const EstimateSelectParams& base,
                         void* cuda_stream, std::vector<SelectStatistics>* out);

}  // namespace sparseprefill::detail
