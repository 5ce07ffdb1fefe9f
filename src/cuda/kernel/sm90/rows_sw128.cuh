// SPDX-License-Identifier: Apache-2.0
// Key or query rows into a 128B-swizzled shared-memory tile (cp.async, or widened from e4m3),
// the layout the Hopper forward kernel's TMA writes and wgmma's K-major descriptors read; for
// the sm90 kernels that load rows themselves (the selector, exact_gate's decision kernel).
// Device-only.
#pragma once

#include <cstdint>

#include "cuda/kernel/ptx.cuh"

namespace sparseprefill::cuda::sm90 {

// Rows 0 .. valid - 1 of a [kRows][kD] source (row r at base + r·row_stride elements) into the
// swizzled tile at `dst` (16-byte chunk c of row r at d-half c / 8, chunk (c % 8) ^ (r % 8)),
// rows past `valid` zero-filled without reading. kThreads threads, `t` this one's index; the
// caller commits the group. A thread's rows are kRowStep (a multiple of 8) apart: one swizzle.
// Rows wider than kThreads / 8 chunks (d 256 with 128 threads) go as two column halves, each
// its own d-halves of the tile.
template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void load_rows_sw128(std::uint32_t dst, const std::uint16_t* base, std::int64_t row_stride,
                                                int valid, int t) {
  if constexpr (kThreads / (kD / 8) < 8) {
    constexpr int kPart = kD / 2;
    static_assert(kPart % 64 == 0, "whole d-halves per column half");
    load_rows_sw128<kRows, kPart, kThreads>(dst, base, row_stride, valid, t);
    load_rows_sw128<kRows, kPart, kThreads>(dst + static_cast<std::uint32_t>((kPart / 64) * kRows * 128), base + kPart,
                                            row_stride, valid, t);
  } else {
    constexpr int kChunks = kD / 8;
    constexpr int kRowStep = kThreads / kChunks;
    static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
    const int c = t % kChunks, r0 = t / kChunks;
    const std::uint32_t to =
        dst + static_cast<std::uint32_t>((c / 8) * kRows * 128 + r0 * 128 + (((c % 8) ^ (r0 & 7)) << 4));
    const std::uint16_t* from = base + static_cast<std::int64_t>(r0) * row_stride + 8 * c;
#pragma unroll
    for (int i = 0; i < kRows / kRowStep; ++i) {
      // Rows past `valid` are not read (ignore-src), so their address need not be valid.
      ptx::cp_async_16_or_zero(to + static_cast<std::uint32_t>(i * kRowStep * 128),
                               from + static_cast<std::int64_t>(i * kRowStep) * row_stride, r0 + i * kRowStep < valid);
    }
  }
}

// load_rows_sw128 for e4m3 rows (8-byte chunks; row_stride in elements = bytes), widened to
// bf16 into the same layout: e4m3 is exactly a bf16 value (4 significant bits, exponents
// -9 .. 8), so a bf16 wgmma on the tile computes the e4m3 products exactly. Plain loads and
// shared stores, not cp.async: each thread orders its stores before wgmma's reads with
// fence.proxy.async, then the CTA barrier (as for cp.async tiles); rows past `valid` are zeros.
template <int kRows, int kD, int kThreads>
__device__ __forceinline__ void widen_rows_sw128_e4m3(std::uint32_t dst, const std::uint8_t* base,
                                                      std::int64_t row_stride, int valid, int t) {
  constexpr int kChunks = kD / 8;
  constexpr int kRowStep = kThreads / kChunks;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
  const int c = t % kChunks, r0 = t / kChunks;
  const std::uint32_t to = dst + static_cast<std::uint32_t>((c / 8) * kRows * 128 + r0 * 128 + (((c % 8) ^ (r0 & 7)) << 4));
  const std::uint8_t* from = base + static_cast<std::int64_t>(r0) * row_stride + 8 * c;
  constexpr int kN = kRows / kRowStep;
  uint2 raw[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {  // every load issued before the first store waits on one
    raw[i] = r0 + i * kRowStep < valid
                 ? *reinterpret_cast<const uint2*>(from + static_cast<std::int64_t>(i * kRowStep) * row_stride)
                 : make_uint2(0, 0);
  }
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    std::uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {  // bf16 pair e: bytes 2e, 2e + 1 (little-endian)
      const std::uint32_t word = e < 2 ? raw[i].x : raw[i].y, sh = 16 * (e % 2);
      w[e] = ptx::pack2<true>(ptx::e4m3_to_float((word >> sh) & 0xffu), ptx::e4m3_to_float((word >> (sh + 8)) & 0xffu));
    }
    asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(to + static_cast<std::uint32_t>(i * kRowStep * 128)),
                 "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
                 : "memory");
  }
}

}  // namespace sparseprefill::cuda::sm90
