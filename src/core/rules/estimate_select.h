// SPDX-License-Identifier: Apache-2.0
// estimate_select's rules (docs/semantics.md §3.5), shared by the oracle, the CPU backend, the
// calibration statistics and the CUDA host code; kernels include it too (SP_HD).
#pragma once

#include <cstdint>

#include "core/geometry.h"

namespace sparseprefill::rules {

// The scored key blocks of query tile i: j < A = (a_l + 1) / block, a_l the absolute position
// of the tile's last row (A = 0 when that row sees no key). g.block_k is the pooling block.
SP_HD int estimate_scored_blocks(const geom::BlockGeometry& g, int i) {
  const std::int64_t a_l = g.seq.position(g.row_end(i) - 1);
  return a_l < 0 ? 0 : static_cast<int>((a_l + 1) / g.block_k);
}

}  // namespace sparseprefill::rules
