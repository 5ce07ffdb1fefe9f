// SPDX-License-Identifier: Apache-2.0
// The permuted query tile of a permute_stop attention CTA, on either path (sm80 and sm90
// permute kernels): decoded from the block index in their shared grid order.
#pragma once

#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"

namespace sparseprefill::cuda {

// Grid order: heads fastest (a KV group's heads share K/V through L2), then batch, the tile,
// and the segment from the last one down: the later a segment, the longer its prefix and the
// more chunks pass 2 can visit, so the longest expected work starts first.
struct PermuteTile {
  int h, b, hk, tile;
  SeqInfo seq;
  geom::SegmentGeometry sg;
  std::int64_t slot;    // segment slot of the (b, h) item
  std::int64_t seg;     // the segment's index
  std::int64_t first;   // the tile's first entry in the (b, h) order arrays
  int rows_valid;       // entries of the tile, at most tile_rows
  std::int64_t item;    // (b, h, slot): index of rank_offsets, q_mean and visited
  std::int64_t offset;  // s_k - s_q: row r sits at position r + offset
  std::int64_t seg_k0;  // the segment's first own key: keys before it are its ranked prefix

  // False when the block index names no rows (past the sequence's segments or the segment's
  // tiles of tile_rows entries).
  __device__ __forceinline__ bool init(const PermuteParams& pp, int block, int tile_rows) {
    const FwdParams& p = pp.fwd;
    h = block % p.h_q;
    block /= p.h_q;
    b = block % p.batch;
    block /= p.batch;
    tile = block % pp.tiles_per_segment;
    const int slot_rev = block / pp.tiles_per_segment;
    hk = h / p.group;
    seq = p.seqs[b];
    sg = geom::SegmentGeometry{{seq.s_q, seq.s_k, true}, pp.segment};
    if (slot_rev >= sg.count()) return false;
    slot = sg.count() - 1 - slot_rev;
    seg = sg.first() + slot;
    const std::int64_t r0 = sg.row_begin(seg), n_rows = sg.row_end(seg) - r0;
    const std::int64_t e0 = static_cast<std::int64_t>(tile) * tile_rows;
    if (e0 >= n_rows) return false;
    rows_valid = static_cast<int>(geom::min64(tile_rows, n_rows - e0));
    first = (static_cast<std::int64_t>(b) * p.h_q + h) * pp.max_s_q + r0 + e0;
    item = (static_cast<std::int64_t>(b) * p.h_q + h) * pp.max_segments + slot;
    offset = seq.s_k - seq.s_q;
    seg_k0 = sg.prefix(seg);
    return true;
  }
};

}  // namespace sparseprefill::cuda
