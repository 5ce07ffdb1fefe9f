// SPDX-License-Identifier: Apache-2.0
// Thin wrappers over the sm_80 PTX the portable kernels are built from: cp.async, ldmatrix,
// mma.sync m16n8k16 (bf16/fp16 in, fp32 accumulate), packing, exp2 and NaN-propagating max.
// Device-only; included by kernel headers, never by host code.
#pragma once

#include <cstdint>

namespace sparseprefill::cuda::ptx {

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses L1. src_bytes = 0 writes 16 zero bytes and reads
// nothing (used for rows past a sequence's end, so no out-of-range address is dereferenced).
__device__ __forceinline__ void cp_async_16(std::uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
// base + 16·units bytes as one wide multiply-add (written out so that the compiler does not
// re-associate it with how base was formed into a 64-bit add chain per use).
__device__ __forceinline__ const void* offset_16b(const void* base, std::uint32_t units) {
  std::uint64_t r;
  asm("mad.wide.u32 %0, %1, 16, %2;\n" : "=l"(r) : "r"(units), "l"(reinterpret_cast<std::uint64_t>(base)));
  return reinterpret_cast<const void*>(r);
}
// 16 bytes from src, or 16 zero bytes without reading src when !read (ignore-src).
__device__ __forceinline__ void cp_async_16_or_zero(std::uint32_t dst, const void* src, bool read) {
  asm volatile(
      "{\n .reg .pred ignore;\n setp.eq.u32 ignore, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, ignore;\n}\n" ::"r"(dst),
      "l"(src), "r"(static_cast<std::uint32_t>(read)));
}
// 4-byte global -> shared copy (through L1: .cg takes only 16 bytes).
__device__ __forceinline__ void cp_async_4(std::uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most n of this thread's committed groups are still in flight.
template <int n>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(n));
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t addr, std::uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a·b for one m16n8k16 tile. a: 4 regs (16×16 row-major), b: 2 regs (16×8 col-major),
// d: 4 fp32 (rows g and g+8, columns 2t and 2t+1 with g = lane / 4, t = lane % 4).
template <bool kBf16>
__device__ __forceinline__ void mma_16816(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                          std::uint32_t b1) {
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two fp32 -> one register of two 16-bit values (lo in the low half), round to nearest even.
template <bool kBf16>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  std::uint32_t r;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}

// One 16-bit value (bf16 or fp16 bits) -> fp32.
template <bool kBf16>
__device__ __forceinline__ float to_float(std::uint16_t bits) {
  if constexpr (kBf16) {
    return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
  } else {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(bits));
    return f;
  }
}

// fp32 -> 16-bit bits, round to nearest even (NaN stays NaN).
template <bool kBf16>
__device__ __forceinline__ std::uint16_t from_float(float x) {
  std::uint16_t r;
  if constexpr (kBf16) {
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
  } else {
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(r) : "f"(x));
  }
  return r;
}

// One OCP E4M3 "fn" byte -> fp32, exactly (bias 7, 3 mantissa bits, subnormals m · 2^-9, NaN
// only at S.1111.111): integer operations, so that every architecture decodes it as the host's
// e4m3_to_float does.
__device__ __forceinline__ float e4m3_to_float(std::uint32_t byte) {
  const std::uint32_t e = (byte >> 3) & 15u, m = byte & 7u;
  float mag = e == 0 ? static_cast<float>(m) * 0x1p-9f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  if (e == 15u && m == 7u) mag = __uint_as_float(0x7fc00000u);
  return (byte & 0x80u) != 0 ? -mag : mag;
}

// FP8 descale `which` (0: q, 1: k, 2: v) of (batch b, kv head hk) of a parameter block with
// FwdParams' descale fields (FwdParams, SelectParams); 1 when not given.
template <class Params>
__device__ __forceinline__ float descale_of(const Params& p, int which, int b, int hk) {
  const float* d = p.descale[which];
  return d == nullptr ? 1.f : d[b * p.descale_stride[which][0] + hk * p.descale_stride[which][1]];
}

// 2^x with the MUFU approximation (relative error ~2^-22); exp2(-inf) = 0, exp2(NaN) = NaN.
__device__ __forceinline__ float exp2f_fast(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
  return r;
}

// max that returns NaN when either operand is NaN (the oracle's nan_max): a NaN score must
// reach the keep tests and the output, never be dropped by fmaxf.
__device__ __forceinline__ float max_nan(float a, float b) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

}  // namespace sparseprefill::cuda::ptx
