// SPDX-License-Identifier: Apache-2.0
// Block geometry of one sequence: which key blocks a query block sees, which of them are full
// and which partial, and the absolute positions policies index by. Pure functions, compiled
// by g++ for the host (and host-tested) and by nvcc for the kernels, so the CPU backends and
// the GPU kernels decide which blocks to visit with the same code. No includes beyond
// <cstdint>: kernel translation units include this file.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SP_HD __host__ __device__ __forceinline__
#else
#define SP_HD inline
#endif

namespace sparseprefill::geom {

// Floor division for a possibly negative numerator and a positive denominator.
SP_HD std::int64_t floor_div(std::int64_t a, std::int64_t b) {
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}
SP_HD std::int64_t ceil_div(std::int64_t a, std::int64_t b) { return (a + b - 1) / b; }
SP_HD std::int64_t min64(std::int64_t a, std::int64_t b) { return a < b ? a : b; }
SP_HD std::int64_t max64(std::int64_t a, std::int64_t b) { return a > b ? a : b; }

// One sequence of a call. Rows are call-relative query indices 0 .. s_q-1; keys are absolute
// positions 0 .. s_k-1; row r sits at absolute position r + (s_k - s_q) (bottom-right).
struct SeqGeometry {
  std::int64_t s_q = 0;
  std::int64_t s_k = 0;
  bool causal = true;

  SP_HD std::int64_t offset() const { return s_k - s_q; }
  SP_HD std::int64_t position(std::int64_t row) const { return row + offset(); }
  // The last key row r sees (inclusive); -1 when it sees none.
  SP_HD std::int64_t last_key(std::int64_t row) const {
    if (s_k <= 0) return -1;
    if (!causal) return s_k - 1;
    const std::int64_t p = position(row);
    return p < 0 ? -1 : min64(p, s_k - 1);
  }
  // Keys row r sees: last_key + 1.
  SP_HD std::int64_t keys_seen(std::int64_t row) const { return last_key(row) + 1; }
};

// Blocks of block_q rows (call-relative) by block_k keys (absolute) over one sequence.
struct BlockGeometry {
  SeqGeometry seq;
  int block_q = 128;
  int block_k = 128;

  SP_HD int num_q_blocks() const { return static_cast<int>(ceil_div(seq.s_q, block_q)); }
  SP_HD int num_k_blocks() const { return static_cast<int>(ceil_div(seq.s_k, block_k)); }
  SP_HD std::int64_t row_begin(int qb) const { return static_cast<std::int64_t>(qb) * block_q; }
  SP_HD std::int64_t row_end(int qb) const { return min64(row_begin(qb) + block_q, seq.s_q); }
  SP_HD std::int64_t key_begin(int kb) const { return static_cast<std::int64_t>(kb) * block_k; }
  SP_HD std::int64_t key_end(int kb) const { return min64(key_begin(kb) + block_k, seq.s_k); }

  // Key blocks 0 .. visible_end-1 are visible to query block qb: some valid row sees some key
  // of them (the last row sees the most).
  SP_HD int visible_end(int qb) const {
    return static_cast<int>(ceil_div(seq.keys_seen(row_end(qb) - 1), block_k));
  }
  // Key blocks 0 .. full_end-1 are full for qb: every valid row sees every key of them (the
  // first row sees the least). full_end <= visible_end.
  SP_HD int full_end(int qb) const {
    const std::int64_t seen = seq.keys_seen(row_begin(qb));
    if (seen >= seq.s_k) return num_k_blocks();
    return static_cast<int>(seen / block_k);
  }
  // exact_gate's gated key blocks of query block qb, 0 .. gated_end - 1 (docs/semantics.md: the
  // full blocks; non-causal every visible block but the last, which is always computed). The
  // others, gated_end .. visible_end - 1, are at most ungated_room() blocks.
  SP_HD int gated_end(int qb) const {
    const int end = seq.causal ? full_end(qb) : visible_end(qb) - 1;
    return end > 0 ? end : 0;
  }
  SP_HD int ungated_room() const { return static_cast<int>(ceil_div(block_q, block_k)) + 1; }
  SP_HD bool is_visible(int qb, int kb) const { return kb >= 0 && kb < visible_end(qb); }
  SP_HD bool is_full(int qb, int kb) const { return kb >= 0 && kb < full_end(qb); }
  SP_HD bool is_partial(int qb, int kb) const { return is_visible(qb, kb) && !is_full(qb, kb); }

  // The absolute query block of qb's first row, floor((qb·block_q + s_k - s_q) / block_q),
  // clamped to [0, positions - 1]: the row exact_gate's threshold table is read at.
  SP_HD int threshold_position(int qb, int positions) const {
    const std::int64_t p = floor_div(row_begin(qb) + seq.offset(), block_q);
    return static_cast<int>(min64(max64(p, 0), positions - 1));
  }

  // estimate_select's tail rule (block_q = block_k = B): query block qb is one of the last
  // `tail` tiles of the call when prompt_len <= 0, else one whose last row lies in one of the
  // last `tail` blocks of a prompt of prompt_len positions (>= s_k: chunked prefill). The two
  // agree when the call is the whole prompt (prompt_len = s_k = s_q).
  SP_HD bool is_tail_block(int qb, int tail, std::int64_t prompt_len) const {
    if (prompt_len <= 0) return qb >= num_q_blocks() - tail;
    return floor_div(seq.position(row_end(qb) - 1), block_q) >= ceil_div(prompt_len, block_q) - tail;
  }

  // (query, key) pairs of query block qb and key block kb that the causal mask allows.
  SP_HD std::int64_t visible_pairs(int qb, int kb) const {
    std::int64_t n = 0;
    const std::int64_t kb0 = key_begin(kb), kb1 = key_end(kb);
    for (std::int64_t r = row_begin(qb); r < row_end(qb); ++r) {
      n += max64(0, min64(seq.keys_seen(r), kb1) - kb0);
    }
    return n;
  }
};

// permute_stop's segments of one causal sequence (DESIGN.md §3): segment s holds the rows at
// absolute positions [s·len, (s+1)·len). Rows before first_row() sit at negative positions,
// see no key and join no segment; the others fall in segments first() .. last() (count() of
// them, 0 when no row sees a key).
struct SegmentGeometry {
  SeqGeometry seq;
  std::int64_t len = 2048;

  SP_HD std::int64_t first_row() const { return min64(max64(0, -seq.offset()), seq.s_q); }
  SP_HD std::int64_t first() const { return max64(seq.offset(), 0) / len; }
  SP_HD std::int64_t last() const { return (seq.s_k - 1) / len; }  // the last row's position is s_k - 1
  SP_HD std::int64_t count() const { return first_row() < seq.s_q ? last() - first() + 1 : 0; }
  // Call-relative rows [row_begin, row_end) of segment s.
  SP_HD std::int64_t row_begin(std::int64_t s) const { return min64(max64(s * len - seq.offset(), 0), seq.s_q); }
  SP_HD std::int64_t row_end(std::int64_t s) const { return min64(max64((s + 1) * len - seq.offset(), 0), seq.s_q); }
  // Keys t < prefix(s) are ranked (pass 2); keys prefix(s) .. key_end(s)-1 are the segment's own (pass 1).
  SP_HD std::int64_t prefix(std::int64_t s) const { return min64(s * len, seq.s_k); }
  SP_HD std::int64_t key_end(std::int64_t s) const { return min64((s + 1) * len, seq.s_k); }
};

// The work tile of CTA `index` in a forward grid of tiles · batch · units CTAs: `units` per row
// tile (query heads, or packed head groups), `units_per_kv` consecutive ones sharing a KV head;
// tile_rev counts row tiles from each sequence's last (the longest under causal), so both
// orders start the longest tiles first. Query heads fastest: unit, then batch, then tile_rev.
// KV-major: the unit within its KV head, batch, tile_rev, then the KV head.
struct GridTile {
  int unit;
  int b;
  int tile_rev;
};
SP_HD GridTile grid_tile(int index, int units, int units_per_kv, int batch, int tiles, bool kv_major) {
  if (!kv_major) return {index % units, index / units % batch, index / units / batch};
  const int in_kv = index % units_per_kv;
  const int rest = index / units_per_kv;
  return {rest / batch / tiles * units_per_kv + in_kv, rest % batch, rest / batch % tiles};
}

}  // namespace sparseprefill::geom
