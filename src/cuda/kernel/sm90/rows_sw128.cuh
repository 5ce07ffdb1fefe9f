// SPDX-License-Identifier: Apache-2.0
// Key or query rows into a 128B-swizzled shared-memory tile with cp.async, the layout the
// Hopper forward kernel's TMA writes and wgmma's K-major descriptors read; for the sm90
// kernels that load with cp.async (the selector, exact_gate's decision kernel). Device-only.
#pragma once

#include <cstdint>

#include "cuda/kernel/ptx.cuh"

namespace sparseprefill::cuda::sm90 {

// Rows 0 .. valid - 1 of a [kRows][kD] source (row r at base + r·row_stride elements) into the
// swizzled tile at `dst` (16-byte chunk c of row r at d-half c / 8, chunk (c % 8) ^ (r % 8)),
// rows past `valid` zero-filled without reading. kThreads threads, `t` this one's index; the
// caller commits the group. A thread's rows are kRowStep (a multiple of 8) apart: one swizzle.
template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_rows_sw128(std::uint32_t dst, const std::uint16_t* base, std::int64_t row_stride,
                                                int valid, int t) {
  constexpr int kChunks = kD / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
  const int c = t % kChunks, r0 = t / kChunks;
  const std::uint32_t to = dst + static_cast<std::uint32_t>((c / 8) * kRows * 128 + r0 * 128 + (((c % 8) ^ (r0 & 7)) << 4));
  const std::uint16_t* from = base + static_cast<std::int64_t>(r0) * row_stride + 8 * c;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    // Rows past `valid` are not read (ignore-src), so their address need not be valid.
    ptx::cp_async_16_or_zero(to + static_cast<std::uint32_t>(i * kRowStep * 128),
                             from + static_cast<std::int64_t>(i * kRowStep) * row_stride, r0 + i * kRowStep < valid);
  }
}

}  // namespace sparseprefill::cuda::sm90
