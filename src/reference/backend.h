// SPDX-License-Identifier: Apache-2.0
// The oracle as a backend (core/backend.h): host tensors, every policy, fp64.
#pragma once

#include "core/backend.h"

namespace sparseprefill::ref {

const detail::BackendImpl& reference_backend();

}  // namespace sparseprefill::ref
