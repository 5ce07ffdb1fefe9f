// SPDX-License-Identifier: Apache-2.0
// Thin wrappers over the sm_90a PTX the Hopper kernels are built from: mbarriers, TMA tensor
// loads (cp.async.bulk.tensor), setmaxnreg, named barriers, shared-memory matrix descriptors
// and wgmma (bf16/fp16 or e4m3 in, fp32 accumulate). Device-only; included by sm90 kernel headers.
#pragma once

#include <cuda.h>  // CUtensorMap only (a header type; nothing is linked from libcuda)

#include <cstdint>

namespace sparseprefill::cuda::sm90::hw {

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Makes initialised barriers visible to the async proxy (TMA) before their first use.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives once and adds `bytes` to the transaction count the current phase waits for.
__device__ __forceinline__ void mbar_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on `bar` when every cp.async this thread issued before has landed; the arrival is one
// of the barrier's expected count (.noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(std::uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
// Orders the shared memory this thread acquired through the generic proxy (cp.async writes,
// made visible by an mbarrier wait) before its async-proxy reads of it (wgmma operands).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Spins until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so a
// wait on parity 1 returns at once (the producer's first pass over the free barriers).
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "SP_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra SP_MBAR_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// The tensor maps live in global memory, written by a host copy before the launch: the
// tensormap proxy must acquire them before TMA reads them (CUDA programming guide, "tensor
// map in global memory"; scope .sys since the host wrote them).
__device__ __forceinline__ void fence_tensormap(const CUtensorMap* map) {
  asm volatile("fence.proxy.tensormap::generic.acquire.sys [%0], 128;\n" ::"l"(reinterpret_cast<std::uint64_t>(map))
               : "memory");
}

// One [rows][64] box of a 3-D tensor map (d, head, row) into 128B-swizzled shared memory;
// completes `bytes` of the barrier's transaction count (zero-filled out-of-range rows count).
__device__ __forceinline__ void tma_load_3d(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int c_d,
                                            int c_head, int c_row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(bar), "r"(c_d), "r"(c_head), "r"(c_row)
      : "memory");
}

// One [rows][64] box of a 4-D tensor map at coordinates (c_d, c1, c2, c3), innermost first: the
// block means k̄/v̄ (d, block, head, batch) and a paged cache (d, head, row in page, page).
__device__ __forceinline__ void tma_load_4d(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar, int c_d,
                                            int c1, int c2, int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(bar), "r"(c_d), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// Named barriers 1 and 2 order the consumer warpgroups' wgmma issue (ping-pong); 0 is
// __syncthreads. 256 threads = both consumer warpgroups (128 sync + 128 arrive).
__device__ __forceinline__ void named_sync(int id) { asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory"); }
__device__ __forceinline__ void named_arrive(int id) { asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory"); }

// Shared-memory matrix descriptor with 128-byte swizzle (PTX "matrix descriptor format"):
// start address, leading and stride byte offsets, all >> 4; layout type 1 = 128B swizzle.
__device__ __forceinline__ std::uint64_t desc_sw128(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<std::uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<std::uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

// A K-major operand with the 128-byte swizzle (rows of 128 B, 8-row groups 1024 B apart: SBO;
// LBO unused), stored as d-halves of kHalfBytes: the descriptor of the tile at `addr`, and the
// offset (16-byte units, added to the descriptor) of 32-byte K step kk, at +32·(kk % 4) bytes
// inside d-half kk / 4.
__device__ __forceinline__ std::uint64_t kmajor_desc_sw128(std::uint32_t addr) { return desc_sw128(addr, 16, 1024); }
template <int kHalfBytes>
__device__ __forceinline__ std::uint64_t kmajor_k_step(int kk) {
  return static_cast<std::uint64_t>(((kk / 4) * kHalfBytes + (kk % 4) * 32) >> 4);
}

// Four fp32 -> one register of four e4m3 (x0 in the low byte), round to nearest even,
// saturating finite values to ±448 (P is in [0, 1]: nothing saturates; NaN stays NaN).
__device__ __forceinline__ std::uint32_t pack4_e4m3(float x0, float x1, float x2, float x3) {
  std::uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(lo) : "f"(x1), "f"(x0));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(hi) : "f"(x3), "f"(x2));
  return static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most n of this warpgroup's committed wgmma groups are still in flight.
template <int n>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(n) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across a wgmma wait.
template <int kN>
__device__ __forceinline__ void fence_regs(float (&a)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(a[j][e])::"memory");
  }
}

#define SP_F4(a, j) "+f"(a[j][0]), "+f"(a[j][1]), "+f"(a[j][2]), "+f"(a[j][3])
#define SP_ACC32(a) \
  SP_F4(a, 0), SP_F4(a, 1), SP_F4(a, 2), SP_F4(a, 3), SP_F4(a, 4), SP_F4(a, 5), SP_F4(a, 6), SP_F4(a, 7)
#define SP_ACC64(a)                                                                                              \
  SP_ACC32(a), SP_F4(a, 8), SP_F4(a, 9), SP_F4(a, 10), SP_F4(a, 11), SP_F4(a, 12), SP_F4(a, 13), SP_F4(a, 14), \
      SP_F4(a, 15)
#define SP_D32                                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31}"
#define SP_D64                                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, "  \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define SP_WGMMA_SS_N128(TY)                                                                      \
  asm volatile(                                                                                   \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY " " SP_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n" \
      : SP_ACC64(d)                                                                               \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define SP_WGMMA_SS_N64(TY)                                                                     \
  asm volatile(                                                                                 \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                              \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY " " SP_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : SP_ACC32(d)                                                                             \
      : "l"(desc_a), "l"(desc_b), "r"(accumulate))
#define SP_WGMMA_RS_N128(TY)                                                                                \
  asm volatile(                                                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                          \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY " " SP_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n" \
      : SP_ACC64(d)                                                                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))
#define SP_WGMMA_RS_N64(TY)                                                                                \
  asm volatile(                                                                                            \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"                                                         \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." TY " " SP_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n" \
      : SP_ACC32(d)                                                                                        \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1))

#define SP_WGMMA_RS_KMAJOR_N128(TY)                                                                          \
  asm volatile(                                                                                             \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"                                                          \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." TY " " SP_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n" \
      : SP_ACC64(d)                                                                                         \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate))

// d[64 x 128] (+)= A[64 x 16] · B[16 x 128], both from shared memory, both K-major (Q·Kᵀ). The
// accumulator of thread (warp w, lane 4g + t) is d[j][e] = D[16w + g + 8(e / 2)][8j + 2t + e % 2].
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], std::uint64_t desc_a, std::uint64_t desc_b, int accumulate) {
  if constexpr (kBf16) {
    SP_WGMMA_SS_N128("bf16.bf16");
  } else {
    SP_WGMMA_SS_N128("f16.f16");
  }
}

// As wgmma_ss, N = 64 (the selector's split last chunk: half the query tile).
template <bool kBf16>
__device__ __forceinline__ void wgmma_ss_n64(float (&d)[8][4], std::uint64_t desc_a, std::uint64_t desc_b, int accumulate) {
  if constexpr (kBf16) {
    SP_WGMMA_SS_N64("bf16.bf16");
  } else {
    SP_WGMMA_SS_N64("f16.f16");
  }
}

// As wgmma_ss with A from registers (the m16n8k16 A fragment of the thread's warp rows), B
// K-major in shared memory (imm-trans-b = 0): Q·Kᵀ with Q held in registers.
template <bool kBf16>
__device__ __forceinline__ void wgmma_rs_kmajor(float (&d)[16][4], const std::uint32_t (&a)[4], std::uint64_t desc_b,
                                                int accumulate) {
  if constexpr (kBf16) {
    SP_WGMMA_RS_KMAJOR_N128("bf16.bf16");
  } else {
    SP_WGMMA_RS_KMAJOR_N128("f16.f16");
  }
}

// d[64 x 8·kN] += A[64 x 16] · B[16 x 8·kN] (P·V), A from registers (the m16n8k16 A fragment of
// the thread's warp rows), B N-major in shared memory (imm-trans-b = 1). kN = 16 or 8 (d = 128, 64).
template <bool kBf16, int kN>
__device__ __forceinline__ void wgmma_rs(float (&d)[kN][4], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
  static_assert(kN == 16 || kN == 8, "P·V tiles are d = 128 or 64 wide");
  if constexpr (kN == 16) {
    if constexpr (kBf16) {
      SP_WGMMA_RS_N128("bf16.bf16");
    } else {
      SP_WGMMA_RS_N128("f16.f16");
    }
  } else {
    if constexpr (kBf16) {
      SP_WGMMA_RS_N64("bf16.bf16");
    } else {
      SP_WGMMA_RS_N64("f16.f16");
    }
  }
}

// FP8: d[64 x 128] (+)= A[64 x 32] · B[32 x 128] in e4m3, both operands K-major (the only
// layout 8-bit wgmma reads: no transpose immediates), the accumulator laid out as wgmma_ss's.
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[16][4], std::uint64_t desc_a, std::uint64_t desc_b,
                                              int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " SP_D64 ", %64, %65, p, 1, 1;\n}\n"
      : SP_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// FP8: d[64 x 128] += A[64 x 32] · B[32 x 128], A from registers as wgmma_rs_e4m3 below, B
// K-major in shared memory (the forward kernel's Vᵀ).
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[16][4], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " SP_D64 ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : SP_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

#undef SP_WGMMA_SS_N128
#undef SP_WGMMA_SS_N64
#undef SP_WGMMA_RS_N128
#undef SP_WGMMA_RS_N64
#undef SP_WGMMA_RS_KMAJOR_N128
#undef SP_D64
#undef SP_D32
#undef SP_ACC64
#undef SP_ACC32
#undef SP_F4

}  // namespace sparseprefill::cuda::sm90::hw
