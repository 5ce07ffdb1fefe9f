// SPDX-License-Identifier: Apache-2.0
// The CPU backend (core/backend.h): host tensors, every policy, fp32, multithreaded.
#pragma once

#include "core/backend.h"

namespace sparseprefill::cpu {

const detail::BackendImpl& cpu_backend();

}  // namespace sparseprefill::cpu
