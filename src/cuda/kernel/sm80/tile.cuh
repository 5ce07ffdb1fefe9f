// SPDX-License-Identifier: Apache-2.0
// Shared-memory tiles of the portable kernels: [rows, head_dim] 16-bit tiles with an XOR
// swizzle, filled by cp.async with zero rows past a sequence's end, and the ldmatrix addressing
// of mma.sync m16n8k16 fragments. Device-only; included by kernel headers.
#pragma once

#include <cstdint>

#include "cuda/kernel/ptx.cuh"

namespace sparseprefill::cuda::sm80 {

// Copy geometry of a [rows, kHeadDim] tile filled by kThreads threads.
template <int kHeadDim_, int kThreads_>
struct SmemTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = kThreads_;
  static constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  static constexpr int kRowBytes = kHeadDim * 2;
  static_assert(kHeadDim % 64 == 0, "the XOR swizzle needs at least 8 chunks per row");
};

// Byte offset of 16-byte chunk c of row r. Chunks are XOR-swizzled by r % 8 so that the 8 rows
// an ldmatrix phase reads (and the 8 chunks a cp.async phase writes) fall in 8 different
// 16-byte bank groups: conflict-free.
template <class Tile>
__device__ __forceinline__ std::uint32_t swizzle(int r, int c) {
  return static_cast<std::uint32_t>(r * Tile::kRowBytes + ((c ^ (r & 7)) << 4));
}

// Where one tile comes from: rows of head_dim elements at `ptr`, `stride` elements apart, of
// which the first `valid` exist (the rest are zero-filled).
struct TileSrc {
  const std::uint16_t* ptr;
  std::int64_t stride;
  int valid;
};

// Asynchronously copies a [kRows, kHeadDim] tile into swizzled smem, row r (< valid) from
// row_ptr(r); rows >= valid become zeros without reading global memory (`safe` is the address
// given to their zero-byte copies). The caller commits the group. Thread tid copies chunk
// tid % kChunks of rows tid / kChunks + i·kRowStep: the row step is a multiple of 8, so the
// swizzled chunk is the same for every i.
template <class Tile, int kRows, class RowPtr>
__device__ __forceinline__ void load_rows(std::uint32_t smem, const RowPtr& row_ptr, int valid, const void* safe, int tid) {
  constexpr int kRowStep = Tile::kThreads / Tile::kChunks;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
  const int r0 = tid / Tile::kChunks, c = tid % Tile::kChunks;
  const std::uint32_t dst = smem + swizzle<Tile>(r0, c);
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const int r = r0 + i * kRowStep;
    const bool ok = r < valid;
    ptx::cp_async_16(dst + i * kRowStep * Tile::kRowBytes, ok ? row_ptr(r) + c * 8 : safe, ok ? 16 : 0);
  }
}

// A tile of consecutive rows (`src`): addresses advance by constants.
template <class Tile, int kRows>
__device__ __forceinline__ void load_tile(std::uint32_t smem, const TileSrc& src, int tid) {
  load_rows<Tile, kRows>(smem, [&](int r) { return src.ptr + r * src.stride; }, src.valid, src.ptr, tid);
}

// A gathered tile: row r is row index[r] of `base` (rows `stride` elements apart), for the
// first `valid` rows; `index` may point to global or shared memory.
template <class Tile, int kRows>
__device__ __forceinline__ void load_tile_rows(std::uint32_t smem, const std::uint16_t* base, std::int64_t stride,
                                               const std::int32_t* index, int valid, int tid) {
  load_rows<Tile, kRows>(smem, [&](int r) { return base + index[r] * stride; }, valid, base, tid);
}

// A fragment of 16 rows starting at row0, head dims kk·16 .. kk·16 + 15 (ldmatrix.x4: lanes
// 0-15 address rows 0-15 of the left 8 columns, lanes 16-31 the right 8).
template <class Tile>
__device__ __forceinline__ void load_a_frag(std::uint32_t tile, int row0, int kk, int lane, std::uint32_t (&a)[4]) {
  ptx::ldmatrix_x4(tile + swizzle<Tile>(row0 + (lane & 15), kk * 2 + (lane >> 4)), a);
}

// B fragments of two n8 column groups for S = Q·Kᵀ: keys key0 .. key0 + 15 of a K tile
// [keys, head_dim], head dims kk·16 .. +15. b[0], b[1]: keys key0..+7; b[2], b[3]: key0+8..+15.
template <class Tile>
__device__ __forceinline__ void load_k_frags(std::uint32_t tile, int key0, int kk, int lane, std::uint32_t (&b)[4]) {
  ptx::ldmatrix_x4(tile + swizzle<Tile>(key0 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)), b);
}

// B fragments of two n8 column groups for O += P·V: keys kk·16 .. +15 of a V tile
// [keys, head_dim], head dims dp·16 .. +15 (transposed load). b[0], b[1]: dims dp·16..+7;
// b[2], b[3]: dims dp·16+8..+15.
template <class Tile>
__device__ __forceinline__ void load_v_frags(std::uint32_t tile, int kk, int dp, int lane, std::uint32_t (&b)[4]) {
  ptx::ldmatrix_x4_trans(tile + swizzle<Tile>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4)), b);
}

}  // namespace sparseprefill::cuda::sm80
