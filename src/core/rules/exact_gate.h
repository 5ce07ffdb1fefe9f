// SPDX-License-Identifier: Apache-2.0
// exact_gate's (BSFA's) rules (docs/semantics.md §3.3), shared by the oracle, the CPU backend,
// the test support and the forward kernels' gate (kernel/policy.cuh, SP_HD): which blocks are
// gated, the threshold a query block reads, and the keep test.
#pragma once

#include <cstdint>

#include "core/geometry.h"

namespace sparseprefill::rules {

// Whether key block kb (visible to query block qb) is gated, i.e. decided by the threshold: the
// full blocks (the partial ones, the diagonal band and a local window's edges, are always
// computed); without causal, when every visible block is full (no window, or one that hides
// nothing), every block but the last (always computed so that no row is empty).
SP_HD bool gate_gated(const geom::BlockGeometry& g, int qb, int kb) {
  return kb >= g.gated_begin(qb) && kb < g.gated_end(qb);
}

// T of query head h and query block qb: an fp32 [h_q, positions] table with element strides
// head_stride and pos_stride, read at the absolute threshold position of qb's first row
// (geom::BlockGeometry::threshold_position: clamped to the table).
SP_HD float gate_threshold(const float* table, std::int64_t head_stride, std::int64_t pos_stride, int positions,
                           const geom::BlockGeometry& g, int h, int qb) {
  return table[h * head_stride + static_cast<std::int64_t>(g.threshold_position(qb, positions)) * pos_stride];
}

// A gated block is kept iff !(m < T), m the maximum score over the query block's valid rows
// and the block's keys: ties keep, T = -inf keeps everything, a NaN maximum keeps.
template <class T>
SP_HD bool gate_keeps(T block_max, T threshold) {
  return !(block_max < threshold);
}

}  // namespace sparseprefill::rules
