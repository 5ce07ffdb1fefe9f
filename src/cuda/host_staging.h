// SPDX-License-Identifier: Apache-2.0
// run() on the CUDA backend with host tensors (host_staging.cpp): copied to the current device,
// run there through `cuda`'s plan and run, copied back; synchronous. *ran also gets the device
// time of the call (ExecutionInfo::device_ms).
#pragma once

#include "core/backend.h"

namespace sparseprefill::cuda {

Status run_host_staged(const detail::BackendImpl& cuda, const AttentionProblem& problem, const Policy& policy,
                       const AttentionOutput& output, const RunOptions& options, Decisions* decisions,
                       ExecutionInfo* ran);

}  // namespace sparseprefill::cuda
