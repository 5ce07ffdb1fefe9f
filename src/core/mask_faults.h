// SPDX-License-Identifier: Apache-2.0
// The message of a device block mask's offence (core/rules/block_sparse.h's record), shared by
// the host check (DeviceBlockMask::to_block_mask) and the CUDA backend's report of a device
// check. Host-only.
#pragma once

#include <string>

#include "core/rules/block_sparse.h"

namespace sparseprefill::detail {

std::string mask_fault_message(const rules::MaskFaultRecord& f);

}  // namespace sparseprefill::detail
