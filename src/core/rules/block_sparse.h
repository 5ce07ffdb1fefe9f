// SPDX-License-Identifier: Apache-2.0
// block_sparse's rule for masks read in place (DeviceBlockMask, block_mask.h): what makes an
// entry of a row's list acceptable. Shared by the host conversion (the host backends) and the
// CUDA check kernel (kernel/mask_check.cuh), so both cut a row at the same entry.
#pragma once

#include <cstdint>

#include "core/geometry.h"

namespace sparseprefill::rules {

// Why an entry of a device mask's list is refused (0: it is accepted).
enum MaskFault : std::int32_t {
  kMaskOk = 0,
  kMaskCount = 1,     // the row's count is negative or exceeds the index tensor's capacity
  kMaskRange = 2,     // the key block is not visible to the query block (causal mask and window)
  kMaskOrder = 3,     // not strictly above the list's previous entry
  kMaskBoth = 4,      // also in the row's other list
  kMaskIndptr = 5,    // CSR: indptr decreases or points past the indices
};

// Entry kb of a list, after `prev` (-1 for the first), of a query block that sees key blocks
// visible_begin .. visible_end - 1 (geom::BlockGeometry; visible_begin is 0, the default,
// without a left window bound). The host conversion and the device check pass both.
SP_HD MaskFault mask_entry_fault(std::int64_t kb, std::int64_t prev, int visible_end, int visible_begin = 0) {
  if (kb < visible_begin || kb < 0 || kb >= visible_end) return kMaskRange;
  if (kb <= prev) return kMaskOrder;
  return kMaskOk;
}

// The first offence a device check records (FwdParams' mask fault record, on the host after a
// synchronisation): which list, row (b, h, qb) and entry, the value and the bound it broke.
struct MaskFaultRecord {
  std::int32_t fault;  // MaskFault; 0: none
  std::int32_t list;   // 0 partial (Flex kv_*), 1 full (full_kv_*), 2 CSR
  std::int32_t b, h, qb;
  std::int32_t entry;
  std::int64_t value;
  std::int64_t limit;
};

}  // namespace sparseprefill::rules
