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
// positions 0 .. s_k-1; row r sits at absolute position a = r + (s_k - s_q) (bottom-right).
// Row r sees the keys [first_key(r), last_key(r)]: causal ends them at a; the local window
// (FlashAttention's window_size, docs/semantics.md §1) keeps a - window_left .. a + window_right
// (-1: no bound on that side); chunked attention (FlashAttention's attention_chunk C > 0,
// Llama 4) keeps the C positions of a's chunk, chunk_begin(a) .. chunk_begin(a) + C - 1; causal,
// window and chunk intersect. Kernels without windows construct this as {s_q, s_k, causal}: the
// window then defaults to unbounded and the chunk to none, i.e. plain causal or full.
struct SeqGeometry {
  std::int64_t s_q = 0;
  std::int64_t s_k = 0;
  bool causal = true;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  std::int64_t chunk = 0;  // attention_chunk: 0 none, else > 0 positions per chunk

  SP_HD std::int64_t offset() const { return s_k - s_q; }
  SP_HD std::int64_t position(std::int64_t row) const { return row + offset(); }
  // Whether rows' ranges can start after key 0: a left window bound or chunks.
  SP_HD bool left_bounded() const { return window_left >= 0 || chunk > 0; }
  // The first position of a's chunk (floor(a / chunk) · chunk; a may be negative). chunk > 0.
  // On the device in 32 bits: the kernels' positions fit (s_k is int32 there), and the 64-bit
  // division's call spilled the kFeatures kernels (sm_90 build of the portable d = 128 one:
  // 24 -> 72 bytes) even for calls without chunks.
  SP_HD std::int64_t chunk_begin(std::int64_t a) const {
#if defined(__CUDA_ARCH__)
    const int ai = static_cast<int>(a), c = static_cast<int>(chunk);
    return static_cast<std::int64_t>(ai >= 0 ? ai / c : -((-ai + c - 1) / c)) * c;
#else
    return floor_div(a, chunk) * chunk;
#endif
  }
  // The kernels' form, without a 64-bit division per row: a - chunk_begin(a) in [0, chunk) (the
  // phase, once per tile), then chunk_begin(a + i) - a for i >= 0 in 32 bits (phase + i < s_k +
  // i: phase <= a < s_k whenever it matters, a < 0 giving a chunk of negative positions). chunk > 0.
  SP_HD int chunk_phase(std::int64_t a) const { return static_cast<int>(a - chunk_begin(a)); }
  SP_HD int chunk_begin_after(int phase, int i) const {
    const int rel = phase + i;
    return rel - rel % static_cast<int>(chunk) - phase;
  }
  // The window's part of first_key_at: a - window_left, clamped at 0 (0 without a left bound).
  SP_HD std::int64_t window_first_at(std::int64_t a) const { return window_left < 0 ? 0 : max64(a - window_left, 0); }
  // first_key_at(a0 + i) for i >= 0 in that form: phase = chunk_phase(a0) (ignored without chunks).
  SP_HD std::int64_t first_key_after(std::int64_t a0, int phase, int i) const {
    const std::int64_t first = window_first_at(a0 + i);
    return chunk > 0 ? max64(first, a0 + chunk_begin_after(phase, i)) : first;
  }
  // The first key position a row at absolute position a may see: a - window_left and its
  // chunk's first position, clamped at 0. It is at most last_key_at(a) + 1 (the row's range
  // [first, last] may be empty). Both bounds grow with a.
  SP_HD std::int64_t first_key_at(std::int64_t a) const {
    const std::int64_t first = window_first_at(a);
    return chunk > 0 ? max64(first, chunk_begin(a)) : first;
  }
  // How far past its own position a row's range may end: 0 under causal (which a right window
  // bound >= 0 cannot widen), window_right without causal, -1 when unbounded (the range then
  // ends at s_k - 1). The kernels' element masks bound a row's keys by a + reach() directly.
  SP_HD std::int64_t reach() const { return causal ? 0 : window_right; }
  // The last key a row at absolute position a sees (inclusive), min(s_k - 1, a + reach());
  // -1 when it sees none.
  SP_HD std::int64_t last_key_at(std::int64_t a) const {
    if (s_k <= 0) return -1;
    std::int64_t last = s_k - 1;
    // reach()'s bound, written as before windows ran (the window-free kernels' SASS).
    if (causal) last = min64(last, a);
    if (window_right >= 0) last = min64(last, a + window_right);
    if (chunk > 0) last = min64(last, chunk_begin(a) + chunk - 1);
    if (last < first_key_at(a)) return -1;
    return last;
  }
  SP_HD std::int64_t first_key(std::int64_t row) const { return first_key_at(position(row)); }
  SP_HD std::int64_t last_key(std::int64_t row) const { return last_key_at(position(row)); }
  // One past the last key row r sees (0 when it sees none): the end of its range. Without a
  // left bound the range starts at 0 and this is the number of keys the row sees.
  SP_HD std::int64_t keys_seen(std::int64_t row) const { return last_key(row) + 1; }
  // Whether row r sees key t.
  SP_HD bool sees(std::int64_t row, std::int64_t t) const { return t >= first_key(row) && t <= last_key(row); }
  // Keys of [begin, end) the row at absolute position a sees.
  SP_HD std::int64_t keys_in(std::int64_t a, std::int64_t begin, std::int64_t end) const {
    const std::int64_t lo = max64(begin, first_key_at(a)), hi = min64(end, last_key_at(a) + 1);
    return hi > lo ? hi - lo : 0;
  }
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

  // Key blocks visible_begin .. visible_end-1 are visible to query block qb: some valid row sees
  // some key of them. Every row's range moves forward with its position and consecutive rows'
  // ranges touch, so the union over the block's rows is one range of keys: from the first row's
  // first key to the last row's last key (a row that sees nothing starts at key 0, so it never
  // raises the lower end above a row that does see keys). Chunks keep this: the last row of a
  // chunk ends at its own position, the next row starts there + 1.
  SP_HD int visible_end(int qb) const {
    return static_cast<int>(ceil_div(seq.keys_seen(row_end(qb) - 1), block_k));
  }
  SP_HD int visible_begin(int qb) const {
    // Without a left bound every range starts at key 0 (and the kernels' per-CTA setup skips
    // the 64-bit division).
    if (!seq.left_bounded()) return 0;
    const int b = static_cast<int>(seq.first_key(row_begin(qb)) / block_k);
    return b < visible_end(qb) ? b : visible_end(qb);
  }
  // Key blocks full_begin .. full_end-1 are full for qb: every valid row sees every key of
  // them (the first row's range ends lowest, the last row's starts highest). visible_begin <=
  // full_begin <= full_end <= visible_end; the partial blocks are the two bands between.
  SP_HD int full_end(int qb) const {
    const std::int64_t seen = seq.keys_seen(row_begin(qb));
    if (seen >= seq.s_k) return num_k_blocks();
    return static_cast<int>(seen / block_k);
  }
  SP_HD int full_begin(int qb) const {
    if (!seq.left_bounded()) return 0;  // as visible_begin
    const std::int64_t last = row_end(qb) - 1;
    // A last row that sees nothing leaves no full block (full_end is then 0 as well).
    const int b = seq.keys_seen(last) == 0 ? 0 : static_cast<int>(ceil_div(seq.first_key(last), block_k));
    return b < full_end(qb) ? b : full_end(qb);
  }
  // exact_gate's gated key blocks of query block qb, gated_begin .. gated_end - 1
  // (docs/semantics.md §3.3): its full blocks; without causal, a query block with no partial
  // block (every block full: no window, or one that hides nothing) keeps its last visible block
  // out of the gate, which is always computed so that no row is left empty. The others, the
  // partial bands (and that block), are at most ungated_room() blocks.
  SP_HD int gated_begin(int qb) const { return full_begin(qb); }
  SP_HD int gated_end(int qb) const {
    const bool all_full = full_begin(qb) == visible_begin(qb) && full_end(qb) == visible_end(qb);
    const int end = !seq.causal && all_full ? visible_end(qb) - 1 : full_end(qb);
    return end > gated_begin(qb) ? end : gated_begin(qb);
  }
  // Each partial band spans the block_q - 1 positions between the first and the last row; a
  // left window bound adds a second band below the full blocks. Chunks' first keys jump by a
  // chunk within one query block: there every visible block may be partial.
  SP_HD int ungated_room() const {
    if (seq.chunk > 0) return num_k_blocks();
    const int bands = seq.window_left >= 0 ? 2 : 1;
    return bands * (static_cast<int>(ceil_div(block_q, block_k)) + 1);
  }
  // Whether key block kb, one below full_end(qb), is full: it starts at or after the last row's
  // first key (before it lies a left bound's lower band). is_full's form for kernels
  // that test blocks one by one: no division, unlike full_begin; phase =
  // seq.chunk_phase(seq.position(row_begin(qb))) under chunks (else ignored).
  SP_HD bool full_below_end(int qb, int kb, int phase) const {
    return key_begin(kb) >= seq.first_key_after(seq.position(row_begin(qb)), phase,
                                                static_cast<int>(row_end(qb) - 1 - row_begin(qb)));
  }
  SP_HD bool is_visible(int qb, int kb) const { return kb >= visible_begin(qb) && kb < visible_end(qb); }
  SP_HD bool is_full(int qb, int kb) const { return kb >= full_begin(qb) && kb < full_end(qb); }
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

  // (query, key) pairs of query block qb and key block kb that the causal mask and the window
  // allow.
  SP_HD std::int64_t visible_pairs(int qb, int kb) const {
    std::int64_t n = 0;
    for (std::int64_t r = row_begin(qb); r < row_end(qb); ++r) {
      n += seq.keys_in(seq.position(r), key_begin(kb), key_end(kb));
    }
    return n;
  }
};

// permute_stop's segments of one causal sequence (docs/semantics.md §3.6): segment s holds the
// rows at absolute positions [s·len, (s+1)·len). Rows before first_row() sit at negative
// positions, see no key and join no segment; the others fall in segments first() .. last()
// (count() of them, 0 when no row sees a key).
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
  // Keys t < prefix(s) precede the segment; keys prefix(s) .. key_end(s)-1 are its own (pass 1).
  SP_HD std::int64_t prefix(std::int64_t s) const { return min64(s * len, seq.s_k); }
  // The ranked keys (pass 2): ranked_begin(s) .. prefix(s)-1, the preceding keys the segment's
  // first row in the call sees (every one without a left bound; the later rows see a
  // suffix of them).
  SP_HD std::int64_t ranked_begin(std::int64_t s) const { return min64(seq.first_key(row_begin(s)), prefix(s)); }
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
