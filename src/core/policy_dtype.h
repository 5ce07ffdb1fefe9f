// SPDX-License-Identifier: Apache-2.0
// Which policies an input dtype runs, shared by the public entry points (core/attention.cpp)
// and the oracle's own checks (reference/reference.cpp). Host-only.
#pragma once

#include "sparseprefill/policy.h"
#include "sparseprefill/types.h"

namespace sparseprefill::detail {

// fp8_e4m3 inputs run dense and block_sparse (issue #4's FP8 scope): the other policies'
// selection rules (pooled means stored in the input dtype, thresholds calibrated on 16- and
// 32-bit activations) are not defined for them. kUnsupported naming the policy otherwise.
Status check_policy_dtype(const Policy& policy, DType dtype);

}  // namespace sparseprefill::detail
