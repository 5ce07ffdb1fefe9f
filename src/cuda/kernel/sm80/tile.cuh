// SPDX-License-Identifier: Apache-2.0
// Shared-memory tiles of the portable kernels: [rows, head_dim] 16-bit tiles with an XOR
// swizzle, filled by cp.async with zero rows past a sequence's end from contiguous or paged
// rows (one addressor, KvRows) or gathered through an index list, and the ldmatrix addressing
// of mma.sync m16n8k16 fragments. Device-only; included by kernel headers.
#pragma once

#include <cstdint>

#include "cuda/kernel/ptx.cuh"

namespace sparseprefill::cuda::sm80 {

// Copy geometry of a [rows, kHeadDim] tile filled by kThreads threads. A row is stored in whole
// groups of 8 16-byte chunks (the XOR swizzle's span): d = 96's 12 chunks take a 16-chunk
// pitch, whose last 4 chunks are never written or read (every load and fragment loop stops at
// kDataChunks; at d = 64, 128 and 256 the two counts are equal).
template <int kHeadDim_, int kThreads_>
struct SmemTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kDataChunks = kHeadDim / 8;             // 16-byte chunks of a row's values
  static constexpr int kChunks = (kDataChunks + 7) / 8 * 8;    // chunks per row in smem (the pitch)
  static constexpr int kRowBytes = kChunks * 16;
  static_assert(kHeadDim % 16 == 0, "k16 steps of Q·Kᵀ and pairs of n8 output fragments");
};

// Byte offset of 16-byte chunk c of row r. Chunks are XOR-swizzled by r % 8 so that the 8 rows
// an ldmatrix phase reads (and the 8 chunks a cp.async phase writes) fall in 8 different
// 16-byte bank groups: conflict-free.
template <class Tile>
__device__ __forceinline__ std::uint32_t swizzle(int r, int c) {
  return static_cast<std::uint32_t>(r * Tile::kRowBytes + ((c ^ (r & 7)) << 4));
}

// The one row addressor of every tile load: where row t of a [rows, head_dim] source lives.
// Contiguous (pages == nullptr): base + t · row_stride. Paged K/V: row t % page_size of page
// pages[t / page_size], pages page_stride elements apart (base is page 0's row 0, head offset
// included). Rows are keys at absolute positions of one sequence and KV head for K/V, query
// rows or pooled blocks (always contiguous) otherwise.
struct KvRows {
  const std::uint16_t* base;
  std::int64_t row_stride;
  const std::int32_t* pages;  // the sequence's block-table row, or nullptr
  int page_size;
  std::int64_t page_stride;

  __device__ __forceinline__ const std::uint16_t* row(std::int64_t t) const {
    if (pages == nullptr) return base + t * row_stride;
    const int t32 = static_cast<int>(t);  // keys of a sequence fit int32 (seqused_k is int32)
    return base + static_cast<std::int64_t>(pages[t32 / page_size]) * page_stride +
           static_cast<std::int64_t>(t32 % page_size) * row_stride;
  }
};

__device__ __forceinline__ KvRows contiguous_rows(const std::uint16_t* base, std::int64_t row_stride) {
  return {base, row_stride, nullptr, 1, 0};
}

// Where one tile comes from: rows first .. first + valid - 1 of `rows` (the tile's rows past
// `valid` are zero-filled).
struct TileSrc {
  KvRows rows;
  std::int64_t first;
  int valid;
};

// The tile of rows first .. first + valid - 1 (valid <= the tile's rows). Rows inside one page
// are contiguous, so a tile within one page (every 64-key sub-tile when page_size is a multiple
// of 64) becomes a contiguous run with the page translated once here; only a tile that spans
// pages translates row by row in load_tile.
__device__ __forceinline__ TileSrc tile_src(const KvRows& rows, std::int64_t first, int valid) {
  if (rows.pages == nullptr || valid <= 0) return {rows, first, valid};
  const int p0 = static_cast<int>(first) / rows.page_size;
  if (p0 != static_cast<int>(first + valid - 1) / rows.page_size) return {rows, first, valid};
  return {contiguous_rows(rows.row(first), rows.row_stride), 0, valid};
}

// Whether the threads of a tile copy each chunk column in a row step that is a multiple of 8 (a
// constant swizzle per thread): kThreads a multiple of 8 rows' chunks. Not d = 192's 24 chunks
// with 128 threads, which copy element by element (load_rows_each).
template <class Tile>
constexpr bool kConstantSwizzle = Tile::kThreads % (8 * Tile::kChunks) == 0;

// load_rows without a constant swizzle: item i = tid + k·kThreads of the tile's data chunks is
// chunk i % kDataChunks of row i / kDataChunks.
template <class Tile, int kRows, class RowPtr>
__device__ __forceinline__ void load_rows_each(std::uint32_t smem, const RowPtr& row_ptr, int valid, const void* safe,
                                               int tid) {
  constexpr int kItems = kRows * Tile::kDataChunks;
  static_assert(kItems % Tile::kThreads == 0, "whole rounds of the tile's chunks");
#pragma unroll
  for (int k = 0; k < kItems / Tile::kThreads; ++k) {
    const int i = tid + k * Tile::kThreads;
    const int r = i / Tile::kDataChunks, c = i % Tile::kDataChunks;
    const bool ok = r < valid;
    ptx::cp_async_16(smem + swizzle<Tile>(r, c), ok ? row_ptr(r) + c * 8 : safe, ok ? 16 : 0);
  }
}

// Asynchronously copies a [kRows, kHeadDim] tile into swizzled smem, row r (< valid) from
// row_ptr(r); rows >= valid become zeros without reading global memory (`safe` is the address
// given to their zero-byte copies). The caller commits the group. Thread tid copies chunk
// tid % kChunks of rows tid / kChunks + i·kRowStep: the row step is a multiple of 8, so the
// swizzled chunk is the same for every i. Rows addressed one by one: paged and gathered tiles.
template <class Tile, int kRows, class RowPtr>
__device__ __forceinline__ void load_rows(std::uint32_t smem, const RowPtr& row_ptr, int valid, const void* safe, int tid) {
  if constexpr (!kConstantSwizzle<Tile>) {
    load_rows_each<Tile, kRows>(smem, row_ptr, valid, safe, tid);
  } else {
    constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
    static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
    const int r0 = tid / Tile::kChunks, c = tid % Tile::kChunks;
    if (Tile::kDataChunks < Tile::kChunks && c >= Tile::kDataChunks) return;  // the pitch's padding
    const std::uint32_t dst = smem + swizzle<Tile>(r0, c);
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      const int r = r0 + i * kRowStep;
      const bool ok = r < valid;
      ptx::cp_async_16(dst + i * kRowStep * Tile::kRowBytes, ok ? row_ptr(r) + c * 8 : safe, ok ? 16 : 0);
    }
  }
}

// The tile of `src` (as load_rows): addresses advance by a constant for contiguous rows and come
// from the addressor for rows spanning pages.
template <class Tile, int kRows>
__device__ __forceinline__ void load_tile(std::uint32_t smem, const TileSrc& src, int tid) {
  if constexpr (kConstantSwizzle<Tile>) {
    if (src.rows.pages == nullptr) {
      constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
      static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
      const int r0 = tid / Tile::kChunks, c = tid % Tile::kChunks;
      if (Tile::kDataChunks < Tile::kChunks && c >= Tile::kDataChunks) return;  // the pitch's padding
      const std::uint32_t dst = smem + swizzle<Tile>(r0, c);
      // One pointer stepped by a 64-bit add per row, and rows past `valid` not read (ignore-src,
      // so their address need not be valid): a multiply and a select per row made the two tile
      // loads of a dense sub-tile about 230 instructions per thread (SASS at sm_90), most of what
      // the kernel executed beyond FlashAttention-2 (Nsight: 3.04 against 2.60 G instructions,
      // Llama 16K; record 2026-11-30-h200-portable-dense-ncu-16k).
      const std::int64_t step = static_cast<std::int64_t>(kRowStep) * src.rows.row_stride;
      const std::uint16_t* g = src.rows.row(src.first + r0) + c * 8;
      // A whole tile at d = 128 takes no row predicates. With the forward kernel's single K
      // prefetch site, Llama dense ran 1.9% faster at 16K; at d = 64 this path made SmolLM2 dense
      // 1.3% slower, where the prefetch site alone left it within 0.3% (same-call A/Bs, records
      // 2026-11-30-h200-portable-dense-whole-tiles and -whole-tiles-every-head-dim).
      if (Tile::kHeadDim == 128 && src.valid >= kRows) {
#pragma unroll
        for (int i = 0; i < kRows / kRowStep; ++i, g += step) {
          ptx::cp_async_16(dst + i * kRowStep * Tile::kRowBytes, g, 16);
        }
        return;
      }
#pragma unroll
      for (int i = 0; i < kRows / kRowStep; ++i, g += step) {
        ptx::cp_async_16_or_zero(dst + i * kRowStep * Tile::kRowBytes, g, r0 + i * kRowStep < src.valid);
      }
      return;
    }
  }
  load_rows<Tile, kRows>(smem, [&](int r) { return src.rows.row(src.first + r); }, src.valid, src.rows.base, tid);
}

// A gathered tile: row r (< valid) is row index[r] of `rows` (permute_stop's permuted queries
// and ranked keys); `index` may point to global or shared memory.
template <class Tile, int kRows>
__device__ __forceinline__ void load_tile_rows(std::uint32_t smem, const KvRows& rows, const std::int32_t* index, int valid,
                                               int tid) {
  load_rows<Tile, kRows>(smem, [&](int r) { return rows.row(index[r]); }, valid, rows.base, tid);
}

// Address of an ldmatrix lane's row: row row0 + r (row0 a multiple of 8, 0 <= r < 16) of a tile,
// 16-byte chunk 2·kk + h (h = 0 or 1). Since row0 % 8 = 0 and 2·kk + h = 2·kk ^ h, that is
// row0·kRowBytes + (swizzle(r, h) ^ (kk << 5)) (kk << 5 < kRowBytes, a power of two), and kXor
// forms it so: the lane's offset swizzle(r, h) once, the k-step as an XOR with a constant, the
// fragment's first row as an addend. The two forms give the same address; which one compiles
// better depends on the kernel's register pressure (FwdConfig::kXorFragments).
template <class Tile, bool kXor>
__device__ __forceinline__ std::uint32_t frag_addr(std::uint32_t tile, int row0, int r, int kk, int h) {
  if constexpr (kXor) {
    return tile + row0 * Tile::kRowBytes + (swizzle<Tile>(r, h) ^ (kk << 5));
  } else {
    return tile + swizzle<Tile>(row0 + r, kk * 2 + h);
  }
}

// A fragment of 16 rows starting at row0 (a multiple of 8), head dims kk·16 .. kk·16 + 15
// (ldmatrix.x4: lanes 0-15 address rows 0-15 of the left 8 columns, lanes 16-31 the right 8).
template <class Tile, bool kXor = false>
__device__ __forceinline__ void load_a_frag(std::uint32_t tile, int row0, int kk, int lane, std::uint32_t (&a)[4]) {
  ptx::ldmatrix_x4(frag_addr<Tile, kXor>(tile, row0, lane & 15, kk, lane >> 4), a);
}

// B fragments of two n8 column groups for S = Q·Kᵀ: keys key0 (a multiple of 8) .. key0 + 15
// of a K tile [keys, head_dim], head dims kk·16 .. +15. b[0], b[1]: keys key0..+7; b[2], b[3]:
// key0+8..+15.
template <class Tile, bool kXor = false>
__device__ __forceinline__ void load_k_frags(std::uint32_t tile, int key0, int kk, int lane, std::uint32_t (&b)[4]) {
  ptx::ldmatrix_x4(frag_addr<Tile, kXor>(tile, key0, (lane >> 4) * 8 + (lane & 7), kk, (lane >> 3) & 1), b);
}

// B fragments of two n8 column groups for O += P·V: keys kk·16 .. +15 of a V tile
// [keys, head_dim], head dims dp·16 .. +15 (transposed load). b[0], b[1]: dims dp·16..+7;
// b[2], b[3]: dims dp·16+8..+15.
template <class Tile, bool kXor = false>
__device__ __forceinline__ void load_v_frags(std::uint32_t tile, int kk, int dp, int lane, std::uint32_t (&b)[4]) {
  ptx::ldmatrix_x4_trans(frag_addr<Tile, kXor>(tile, kk * 16, (lane & 7) + ((lane >> 3) & 1) * 8, dp, lane >> 4), b);
}

}  // namespace sparseprefill::cuda::sm80
