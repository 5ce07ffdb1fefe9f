// SPDX-License-Identifier: Apache-2.0
// softmax_skip's (BLASST's) rules (docs/semantics.md §3.4), shared by the oracle, the CPU
// backend and the calibration statistics; kernels include it too (SP_HD).
#pragma once

#include <vector>

#include "core/geometry.h"

namespace sparseprefill::rules {

// The block of query block qb visited `visit`-th (0 <= visit < g.visible_end(qb)): the partial
// blocks first, then the full blocks, each group in descending index.
SP_HD int blasst_block(const geom::BlockGeometry& g, int qb, int visit) {
  const int partial = g.visible_end(qb) - g.full_end(qb);
  return visit < partial ? g.visible_end(qb) - 1 - visit : g.full_end(qb) - 1 - (visit - partial);
}

// Every visible block of qb in visit order (host).
inline std::vector<int> blasst_order(const geom::BlockGeometry& g, int qb) {
  std::vector<int> order(static_cast<std::size_t>(g.visible_end(qb)));
  for (int v = 0; v < g.visible_end(qb); ++v) order[static_cast<std::size_t>(v)] = blasst_block(g, qb, v);
  return order;
}

}  // namespace sparseprefill::rules
