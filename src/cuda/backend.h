// SPDX-License-Identifier: Apache-2.0
// The CUDA backend (core/backend.h) as the dispatch layer sees it: no CUDA or kernel headers.
#pragma once

#include "core/backend.h"

namespace sparseprefill::cuda {

const detail::BackendImpl& cuda_backend();
// CUDA devices present (0 when none, or no driver).
int device_count();

}  // namespace sparseprefill::cuda
