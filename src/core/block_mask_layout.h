// SPDX-License-Identifier: Apache-2.0
// A BlockMask's geometry without its arrays, for a caller that moves arrays of that layout in
// (the CUDA selector's read-back): BlockMask::empty is this plus the allocation. Host-only.
#pragma once

#include "sparseprefill/block_mask.h"

namespace sparseprefill::detail {

// batch, heads, per_kv_head, block sizes and the block counts (max over the batch) of `shape`'s
// mask; the count and index vectors are left empty.
BlockMask block_mask_layout(const ProblemShape& shape, int block_q, int block_k, bool per_kv_head);

}  // namespace sparseprefill::detail
