// SPDX-License-Identifier: Apache-2.0
// Scratch (llm.c-style) Hopper forward attention, dense causal, d = 128, bf16, s_q = s_k: a TMA
// producer warp, two wgmma consumer warpgroups, online softmax; with its own check against a
// naive fp32 GPU attention and a benchmark. The core of issue #4; promoted into
// src/cuda/kernel/sm90/ and then deleted. Compiled by nvcc only; never included elsewhere.
//
// Build (from the repository root; no -lcuda: the tensor-map encoder comes from the runtime's
// driver entry point):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo -Xptxas=-v -I src \
//        -o build/dev/fwd_sm90_dense dev/fwd_sm90_dense.cu
// Run: build/dev/fwd_sm90_dense [check|quick|bench|all|info] [v1,v3,...] [8192,16384,...]
// (default: all, every version, 8K/16K/32K); quick = small checks only, for compute-sanitizer.
// python3 dev/sdpa_cudnn.py [sizes...] times the cuDNN peer on the same shape.
//
// Versions (H200, h_q = 32, h_kv = 8, d = 128, bf16, causal, batch 1; TFLOP/s counts
// 4·d·h_q·s(s+1)/2, the causal pairs; medians of 20 runs over 3 rotating input sets; cuDNN =
// torch SDPA's cuDNN backend in the same call; all four pass the check (O rel. Frobenius error
// 2.0e-3, LSE 4e-6 against fp32) and agree bit for bit with each other at s = 8K, 16K, 64K):
//                                                            TFLOP/s at s = 8K    16K    32K
//   v1 plain: per tile S = Q·Kᵀ, wait, softmax, O += P·V, wait.               575    566    558
//   v2 overlap: softmax of tile j runs while P·V of tile j-1 is in flight
//      (FA3 intra-warpgroup overlap).                                         665    619    607
//   v3 v2 + ping-pong: the two consumer warpgroups take turns issuing wgmma
//      (named barriers), so one's softmax overlaps the other's GEMMs.         680    626    619
//   v4 v3 with 3 K/V stages instead of 2 (224 KB smem).                       660    603    622
//   cuDNN (same run)                                                          616    575    591
// (bench/records/2026-11-29-h200-dev-sm90-dense-run1.log; v3/cuDNN = 1.10, 1.09, 1.05.) A second call on a fresh
// machine (bench/records/2026-11-29-h200-dev-sm90-dense-run2.log) gave at 16K v1 560, v2 644, v3 685, v4 645, cuDNN 658 (v3/cuDNN 1.04);
// at 64K v3 636, v4 624, cuDNN 607 (1.05); at 128K v3 615, v4 609, cuDNN 555 (1.11). Between
// calls the same kernel moved by up to 9% (626 -> 685 at 16K, cuDNN 575 -> 658): compare
// versions and peers only within one call. compute-sanitizer memcheck (v1-v4) and synccheck
// (v3): 0 errors on the quick check. Registers: 168 at entry, setmaxnreg 24 (producer) / 240
// (consumers), 0 spills, 0 stack; 112 HGMMA in the SASS (8 per Q·Kᵀ or P·V).
#include <cuda.h>  // CUtensorMap and its enums only (header; nothing is linked from libcuda)
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/softmax.cuh"

namespace sparseprefill::cuda::dev90 {

#define SP_DEV_CHECK(expr)                                                                       \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

// ------------------------------------------------------------------------------ configuration
constexpr int kHeadDim = 128;
constexpr int kTileM = 128;         // query rows per CTA: two consumer warpgroups of 64 rows
constexpr int kTileN = 128;         // keys per K/V tile
constexpr int kHalfDim = 64;        // d is loaded as two halves: one 128-byte swizzle row each
constexpr int kConsumers = 2;       // consumer warpgroups
constexpr int kThreads = 128 * (1 + kConsumers);  // warpgroup 0 produces
constexpr int kTileBytes = kTileN * kHeadDim * 2;  // one Q, K or V tile: 32 KB
constexpr int kHalfBytes = kTileBytes / 2;         // one d-half of a tile: [128 rows][64]
constexpr int kRowBytes = kHalfDim * 2;            // 128: one swizzle row
constexpr int kAtomBytes = 8 * kRowBytes;          // 1024: the 128B-swizzle pattern (8 rows)
// setmaxnreg budgets: 128·24 + 256·240 = 64512 <= 65536 registers of the SM.
constexpr int kProducerRegs = 24;
constexpr int kConsumerRegs = 240;
static_assert(kTileM == kConsumers * 64, "each consumer warpgroup owns one m64 slab of Q");
static_assert(kTileM == kTileN, "the diagonal is one tile: only the first visited tile is masked");

template <int kStages>
struct alignas(1024) Smem {
  // Tiles as TMA writes them with 128B swizzle: [d-half][row][64], rows of 128 bytes. The
  // swizzle is a function of the address bits, so each tile starts on a 1024-byte boundary.
  std::uint8_t q[kTileBytes];
  std::uint8_t k[kStages][kTileBytes];
  std::uint8_t v[kStages][kTileBytes];
  // mbarriers, named after the event they signal.
  std::uint64_t q_loaded;            // TMA -> consumers, once
  std::uint64_t k_loaded[kStages];   // TMA -> consumers (transaction bytes)
  std::uint64_t v_loaded[kStages];
  std::uint64_t k_free[kStages];     // consumers -> producer: 8 warp arrivals, S read done
  std::uint64_t v_free[kStages];     // consumers -> producer: 8 warp arrivals, P·V read done
};

// ------------------------------------------------------------------------------ PTX wrappers
namespace hw {

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(std::uint32_t bar, std::uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// Arrives once and adds `bytes` to the transaction count the phase waits for.
__device__ __forceinline__ void mbar_expect_tx(std::uint32_t bar, std::uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(std::uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Spins until the phase of parity `parity` has completed. A fresh barrier is in phase 0, so a
// wait on parity 1 returns at once (the producer's first pass over the free barriers).
__device__ __forceinline__ void mbar_wait(std::uint32_t bar, std::uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// One [rows][64] box of a 3-D tensor map (d, head, row) into swizzled shared memory; completes
// `bytes` of the barrier's transaction count (zero-filled out-of-range rows count too).
__device__ __forceinline__ void tma_load_3d(std::uint32_t dst, const CUtensorMap* map, std::uint32_t bar,
                                            int c_d, int c_head, int c_row) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, "
      "%5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<std::uint64_t>(map)), "r"(bar), "r"(c_d), "r"(c_head), "r"(c_row)
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
// __syncthreads. 256 = both consumer warpgroups (128 sync + 128 arrive).
__device__ __forceinline__ void named_sync(int id) {
  asm volatile("bar.sync %0, 256;\n" ::"r"(id) : "memory");
}
__device__ __forceinline__ void named_arrive(int id) {
  asm volatile("bar.arrive %0, 256;\n" ::"r"(id) : "memory");
}

// Shared-memory matrix descriptor with 128-byte swizzle (PTX "matrix descriptor format"):
// start address, leading and stride byte offsets, all >> 4; layout type 1 = 128B swizzle.
__device__ __forceinline__ std::uint64_t desc_sw128(std::uint32_t addr, std::uint32_t lbo, std::uint32_t sbo) {
  return static_cast<std::uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<std::uint64_t>((lbo & 0x3FFFF) >> 4) << 16) |
         (static_cast<std::uint64_t>((sbo & 0x3FFFF) >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most n of this warpgroup's committed wgmma groups are still in flight.
template <int n>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(n) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across a wgmma wait.
__device__ __forceinline__ void fence_regs(float (&a)[16][4]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(a[j][e])::"memory");
  }
}

#define SP_F4(a, j) "+f"(a[j][0]), "+f"(a[j][1]), "+f"(a[j][2]), "+f"(a[j][3])
#define SP_ACC64(a)                                                                                     \
  SP_F4(a, 0), SP_F4(a, 1), SP_F4(a, 2), SP_F4(a, 3), SP_F4(a, 4), SP_F4(a, 5), SP_F4(a, 6), SP_F4(a, 7), \
      SP_F4(a, 8), SP_F4(a, 9), SP_F4(a, 10), SP_F4(a, 11), SP_F4(a, 12), SP_F4(a, 13), SP_F4(a, 14),     \
      SP_F4(a, 15)
#define SP_D64                                                                                        \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, " \
  "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, "  \
  "%42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "  \
  "%62, %63}"

// d[64 x 128] (+)= A[64 x 16] · B[16 x 128], both from shared memory, both K-major. The
// accumulator of thread (warp w, lane 4g + t) is d[j][e] = D[16w + g + 8(e / 2)][8j + 2t + e % 2].
__device__ __forceinline__ void wgmma_ss(float (&d)[16][4], std::uint64_t desc_a, std::uint64_t desc_b,
                                         int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SP_D64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : SP_ACC64(d)
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// d[64 x 128] += A[64 x 16] · B[16 x 128], A from registers (the m16n8k16 A fragment of the
// thread's warp rows), B N-major in shared memory (imm-trans-b = 1).
__device__ __forceinline__ void wgmma_rs(float (&d)[16][4], const std::uint32_t (&a)[4], std::uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " SP_D64
      ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : SP_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

}  // namespace hw

// ------------------------------------------------------------------------------ softmax pieces
// Numerics follow docs/numerics.md and src/cuda/kernel/softmax.cuh (whose RowStats, row_max and
// finalize_row are used as they are): scores arrive raw, the max is kept in the log2 domain with
// scale·log2(e) folded into one FFMA, and a -inf running max is exponentiated against 0.

// Moves the running statistics to include a raw score tile s and turns s into
// p = exp2(s·scale_log2 - m_use) in place, adding p to l. The output accumulator is NOT touched:
// it may still be in flight (v2+), so its factor alpha = exp2(m_old - m_use) is returned for
// scale_acc once the previous P·V has completed.
__device__ __forceinline__ void softmax_tile(float (&s)[1][16][4], RowStats<1>& st, float scale_log2,
                                             float (&alpha)[2]) {
  float mx[2];
  row_max<1, 16>(s, mx);
  float m_use[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float m_new = ptx::max_nan(st.m[r], mx[r] * scale_log2);
    m_use[r] = m_new == -INFINITY ? 0.f : m_new;
    alpha[r] = ptx::exp2f_fast(st.m[r] - m_use[r]);
    st.m[r] = m_new;
    st.l[r] *= alpha[r];
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[0][j][e] = ptx::exp2f_fast(fmaf(s[0][j][e], scale_log2, -m_use[e / 2]));
      st.l[e / 2] += s[0][j][e];
    }
  }
}

__device__ __forceinline__ void scale_acc(float (&o)[1][16][4], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][j][e] *= alpha[e / 2];
  }
}

// p (fp32, in the accumulator layout) -> bf16 A fragments of P·V, one per k16 step of keys:
// accumulator columns 16kk..16kk+15 are exactly the A fragment of step kk. P is rounded to
// bf16 here (the rounding docs/numerics.md allows for).
__device__ __forceinline__ void pack_p(const float (&s)[1][16][4], std::uint32_t (&p)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    p[kk][0] = ptx::pack2<true>(s[0][2 * kk][0], s[0][2 * kk][1]);
    p[kk][1] = ptx::pack2<true>(s[0][2 * kk][2], s[0][2 * kk][3]);
    p[kk][2] = ptx::pack2<true>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
    p[kk][3] = ptx::pack2<true>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
  }
}

// Causal mask of the diagonal tile (s_q = s_k, so top-left and bottom-right alignment agree):
// key c is visible to row r iff c <= r; keys past s_k are invisible too (their K rows are
// TMA zero-fill). row0 is the thread's first row; it also holds row0 + 8.
__device__ __forceinline__ void mask_diagonal(float (&s)[1][16][4], int row0, int col0, int s_k) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = row0 + 8 * (e / 2);
      const int c = col0 + 8 * j + 2 * t + e % 2;
      if (c > r || c >= s_k) s[0][j][e] = -INFINITY;
    }
  }
}

// ------------------------------------------------------------------------------ the kernel
struct Args {
  std::uint16_t* o;  // [s, h_q, d] bf16 bits
  float* lse;        // [h_q, s] natural log
  int s;             // s_q = s_k
  int h_q;
  int h_kv;
  float scale_log2;  // softmax scale · log2(e)
};

// Grid (h_q, q tiles): blockIdx.x is the head so that the heads of a GQA group, which read the
// same K/V, run together and share them through L2; blockIdx.y counts q tiles from the last
// (longest causal row range) down, so the longest CTAs start first.
template <int kStages, bool kOverlap, bool kPingPong>
__global__ void __launch_bounds__(kThreads, 1)
    fwd_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
               const __grid_constant__ CUtensorMap tm_v, const Args args) {
  static_assert(!kPingPong || kOverlap, "ping-pong is built on the overlapped loop");
  using S = Smem<kStages>;
  extern __shared__ std::uint8_t smem_raw[];
  // Align the storage to 1024 bytes in the shared window (the swizzle pattern's period).
  const std::uint32_t raw = hw::smem_u32(smem_raw);
  S& sm = *reinterpret_cast<S*>(smem_raw + ((1024 - (raw & 1023)) & 1023));

  const int head = blockIdx.x;
  const int kv_head = head / (args.h_q / args.h_kv);
  const int q_tile = gridDim.y - 1 - blockIdx.y;
  const int n_tiles = q_tile + 1;  // causal, s_q = s_k: key tiles 0..q_tile, visited descending
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    hw::mbar_init(hw::smem_u32(&sm.q_loaded), 1);
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      hw::mbar_init(hw::smem_u32(&sm.k_loaded[st]), 1);
      hw::mbar_init(hw::smem_u32(&sm.v_loaded[st]), 1);
      hw::mbar_init(hw::smem_u32(&sm.k_free[st]), 4 * kConsumers);
      hw::mbar_init(hw::smem_u32(&sm.v_free[st]), 4 * kConsumers);
    }
    // Makes the initialised barriers visible to the async proxy (TMA) before any use.
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    hw::setmaxnreg_dec<kProducerRegs>();
    if (threadIdx.x == 0) {
      const std::uint32_t q_bar = hw::smem_u32(&sm.q_loaded);
      hw::mbar_expect_tx(q_bar, kTileBytes);
      for (int half = 0; half < 2; ++half)
        hw::tma_load_3d(hw::smem_u32(sm.q) + half * kHalfBytes, &tm_q, q_bar, half * kHalfDim, head,
                        q_tile * kTileM);
      for (int it = 0; it < n_tiles; ++it) {
        const int tile = q_tile - it;
        const int st = it % kStages;
        const std::uint32_t phase = (it / kStages) & 1;
        // Waits until both consumer warpgroups have finished reading this stage's previous K
        // (its S wgmma completed), then refills it.
        hw::mbar_wait(hw::smem_u32(&sm.k_free[st]), phase ^ 1);
        const std::uint32_t k_bar = hw::smem_u32(&sm.k_loaded[st]);
        hw::mbar_expect_tx(k_bar, kTileBytes);
        for (int half = 0; half < 2; ++half)
          hw::tma_load_3d(hw::smem_u32(sm.k[st]) + half * kHalfBytes, &tm_k, k_bar, half * kHalfDim, kv_head,
                          tile * kTileN);
        // Same for V, released after the P·V that read it.
        hw::mbar_wait(hw::smem_u32(&sm.v_free[st]), phase ^ 1);
        const std::uint32_t v_bar = hw::smem_u32(&sm.v_loaded[st]);
        hw::mbar_expect_tx(v_bar, kTileBytes);
        for (int half = 0; half < 2; ++half)
          hw::tma_load_3d(hw::smem_u32(sm.v[st]) + half * kHalfBytes, &tm_v, v_bar, half * kHalfDim, kv_head,
                          tile * kTileN);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  hw::setmaxnreg_inc<kConsumerRegs>();
  const int wg = warpgroup - 1;  // 0 or 1: query rows 64·wg .. 64·wg + 63 of the tile
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int row0 = q_tile * kTileM + wg * 64 + warp * 16 + lane / 4;  // also holds row0 + 8

  // Descriptors. Q and K are K-major: rows of 64 elements (128 B), 8-row groups 1024 B apart
  // (SBO), the k16 step kk at +32·(kk % 4) bytes inside d-half kk / 4. V is N-major for P·V:
  // d runs along the 128-byte rows, the two d-halves are one N chunk of 64 apart
  // (LBO = 16 KB), 8-key groups 1024 B apart (SBO); key step kk starts 16 rows = 2 KB further.
  const std::uint64_t q_desc = hw::desc_sw128(hw::smem_u32(sm.q) + wg * 64 * kRowBytes, 16, kAtomBytes);
  auto k_desc = [&](int st) { return hw::desc_sw128(hw::smem_u32(sm.k[st]), 16, kAtomBytes); };
  auto v_desc = [&](int st) { return hw::desc_sw128(hw::smem_u32(sm.v[st]), kHalfBytes, kAtomBytes); };
  // Descriptor address fields are in 16-byte units.
  auto k_step = [](int kk) { return static_cast<std::uint64_t>(((kk / 4) * kHalfBytes + (kk % 4) * 32) >> 4); };

  float s[1][16][4];   // scores, then p: [64 x 128] per warpgroup
  float o[1][16][4];   // output accumulator [64 x 128]
  std::uint32_t p[8][4];  // P as bf16 A fragments
  RowStats<1> stats;
  init_row_stats(stats);
  float alpha[2];
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[0][j][e] = 0.f;
  }

  auto issue_qk = [&](int st) {
    const std::uint64_t kd = k_desc(st);
    hw::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) hw::wgmma_ss(s[0], q_desc + k_step(kk), kd + k_step(kk), kk > 0);
    hw::wgmma_commit();
  };
  auto issue_pv = [&](int st) {
    const std::uint64_t vd = v_desc(st);
    hw::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) hw::wgmma_rs(o[0], p[kk], vd + ((kk * 16 * kRowBytes) >> 4));
    hw::wgmma_commit();
  };
  // One arrival per warp on a free barrier: the warp's wgmma wait above covered all its lanes.
  auto release = [&](std::uint64_t& bar) {
    if (lane == 0) hw::mbar_arrive(hw::smem_u32(&bar));
  };
  const int my_turn = 1 + wg, other_turn = 2 - wg;
  if constexpr (kPingPong) {
    if (wg == 1) hw::named_arrive(1);  // warpgroup 0 issues first
  }

  hw::mbar_wait(hw::smem_u32(&sm.q_loaded), 0);

  if constexpr (!kOverlap) {
    for (int it = 0; it < n_tiles; ++it) {
      const int tile = q_tile - it;
      const int st = it % kStages;
      const std::uint32_t phase = (it / kStages) & 1;
      hw::mbar_wait(hw::smem_u32(&sm.k_loaded[st]), phase);  // K tile landed (TMA tx)
      issue_qk(st);
      hw::wgmma_wait<0>();
      hw::fence_regs(s[0]);
      release(sm.k_free[st]);
      if (tile == q_tile) mask_diagonal(s, row0, tile * kTileN, args.s);
      softmax_tile(s, stats, args.scale_log2, alpha);
      scale_acc(o, alpha);  // nothing in flight
      pack_p(s, p);
      hw::mbar_wait(hw::smem_u32(&sm.v_loaded[st]), phase);
      issue_pv(st);
      hw::wgmma_wait<0>();
      hw::fence_regs(o[0]);
      release(sm.v_free[st]);
    }
  } else {
    // Prologue: the diagonal tile's S and P; its P·V is issued in the first loop round.
    hw::mbar_wait(hw::smem_u32(&sm.k_loaded[0]), 0);
    if constexpr (kPingPong) hw::named_sync(my_turn);
    issue_qk(0);
    if constexpr (kPingPong) {
      if (wg == 0 || n_tiles > 1) hw::named_arrive(other_turn);
    }
    hw::wgmma_wait<0>();
    hw::fence_regs(s[0]);
    release(sm.k_free[0]);
    mask_diagonal(s, row0, q_tile * kTileN, args.s);
    softmax_tile(s, stats, args.scale_log2, alpha);  // alpha = 0 on the zero accumulator
    pack_p(s, p);
    for (int it = 1; it < n_tiles; ++it) {
      const int st = it % kStages;
      const std::uint32_t phase = (it / kStages) & 1;
      const int st_prev = (it - 1) % kStages;
      const std::uint32_t phase_prev = ((it - 1) / kStages) & 1;
      hw::mbar_wait(hw::smem_u32(&sm.k_loaded[st]), phase);
      // Ping-pong: wait for the other warpgroup to have issued its GEMMs of this round, issue
      // ours, then let it go: its softmax overlaps our GEMMs and ours its next ones. The rounds
      // balance: warpgroup 1 skips its last arrive, which warpgroup 0 would never consume.
      if constexpr (kPingPong) hw::named_sync(my_turn);
      issue_qk(st);
      scale_acc(o, alpha);  // the previous P·V completed at the end of the last round
      hw::mbar_wait(hw::smem_u32(&sm.v_loaded[st_prev]), phase_prev);
      issue_pv(st_prev);
      if constexpr (kPingPong) {
        if (wg == 0 || it + 1 < n_tiles) hw::named_arrive(other_turn);
      }
      hw::wgmma_wait<1>();  // S of this tile done; P·V of the previous one may still run
      hw::fence_regs(s[0]);
      release(sm.k_free[st]);
      softmax_tile(s, stats, args.scale_log2, alpha);  // no mask: only the diagonal tile needs one
      hw::wgmma_wait<0>();  // P·V done: its P registers and V stage are free
      hw::fence_regs(o[0]);
      release(sm.v_free[st_prev]);
      pack_p(s, p);
    }
    // Epilogue: the last tile's P·V.
    const int st_last = (n_tiles - 1) % kStages;
    const std::uint32_t phase_last = ((n_tiles - 1) / kStages) & 1;
    scale_acc(o, alpha);
    hw::mbar_wait(hw::smem_u32(&sm.v_loaded[st_last]), phase_last);
    issue_pv(st_last);
    hw::wgmma_wait<0>();
    hw::fence_regs(o[0]);
    release(sm.v_free[st_last]);
  }

  // ---------------------------------------------------------------- epilogue: O and LSE
  // Each row's l is spread over the quad of threads that hold it.
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = stats.l[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    float o_scale, lse;
    finalize_row(stats.m[r], l, &o_scale, &lse);
    const int row = row0 + 8 * r;
    if (row >= args.s) continue;
    std::uint16_t* o_row = args.o + (static_cast<std::int64_t>(row) * args.h_q + head) * kHeadDim;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<std::uint32_t*>(o_row + col) =
          ptx::pack2<true>(o[0][j][2 * r] * o_scale, o[0][j][2 * r + 1] * o_scale);
    }
    if (lane % 4 == 0) args.lse[static_cast<std::int64_t>(head) * args.s + row] = lse;
  }
}

// ------------------------------------------------------------------------------ reference
// Naive fp32 attention, one thread per (row, head), single pass with an online max: O [s, h_q, d]
// and LSE [h_q, s] from the same bf16 inputs. Exact expf, no rounding of P: the kernel's error
// against it is its bf16 P rounding and fp32 summation order.
__global__ void reference_kernel(const std::uint16_t* q, const std::uint16_t* k, const std::uint16_t* v, float* o,
                                 float* lse, int s, int h_q, int h_kv, float scale) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= s * h_q) return;
  const int row = idx / h_q, head = idx % h_q, kv_head = head / (h_q / h_kv);
  float qf[kHeadDim], acc[kHeadDim];
  for (int c = 0; c < kHeadDim; ++c) {
    qf[c] = ptx::to_float<true>(q[(static_cast<std::int64_t>(row) * h_q + head) * kHeadDim + c]) * scale;
    acc[c] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int key = 0; key <= row; ++key) {
    const std::uint16_t* kr = k + (static_cast<std::int64_t>(key) * h_kv + kv_head) * kHeadDim;
    const std::uint16_t* vr = v + (static_cast<std::int64_t>(key) * h_kv + kv_head) * kHeadDim;
    float x = 0.f;
    for (int c = 0; c < kHeadDim; ++c) x += qf[c] * ptx::to_float<true>(kr[c]);
    const float m_new = fmaxf(m, x);
    const float a = expf(m - m_new), pk = expf(x - m_new);
    l = l * a + pk;
    for (int c = 0; c < kHeadDim; ++c) acc[c] = acc[c] * a + pk * ptx::to_float<true>(vr[c]);
    m = m_new;
  }
  for (int c = 0; c < kHeadDim; ++c) o[static_cast<std::int64_t>(idx) * kHeadDim + c] = acc[c] / l;
  lse[static_cast<std::int64_t>(head) * s + row] = m + logf(l);
}

// Values in (-2, 2) from a splitmix64 hash of (seed, index), as bf16 bits; never all zero.
__global__ void fill_kernel(std::uint16_t* x, std::int64_t n, std::uint64_t seed) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(i) + 1;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * (1.f / 16777216.f);  // [0, 1)
    x[i] = ptx::from_float<true>(4.f * u - 2.f);
  }
}

// ------------------------------------------------------------------------------ host
PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;

// 3-D map (d, head, row) over a [s, h, d] bf16 tensor; boxes of [128 rows][64] with 128B swizzle.
CUtensorMap make_map(const std::uint16_t* base, int s, int h) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(kHeadDim), static_cast<cuuint64_t>(h),
                              static_cast<cuuint64_t>(s)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(kHeadDim) * 2,
                                 static_cast<cuuint64_t>(h) * kHeadDim * 2};  // bytes, dims 1..2
  const cuuint32_t box[3] = {kHalfDim, 1, kTileN};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = g_encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<std::uint16_t*>(base), dims,
                              strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled failed (%d) for s=%d h=%d\n", static_cast<int>(r), s, h);
    std::exit(1);
  }
  return map;
}

struct Problem {
  int s, h_q, h_kv;
  std::uint16_t *q, *k, *v, *o;
  float* lse;
  CUtensorMap tm_q, tm_k, tm_v;
};

Problem make_problem(int s, int h_q, int h_kv, std::uint64_t seed) {
  Problem p{s, h_q, h_kv, nullptr, nullptr, nullptr, nullptr, nullptr, {}, {}, {}};
  const std::int64_t nq = static_cast<std::int64_t>(s) * h_q * kHeadDim;
  const std::int64_t nk = static_cast<std::int64_t>(s) * h_kv * kHeadDim;
  SP_DEV_CHECK(cudaMalloc(&p.q, nq * 2));
  SP_DEV_CHECK(cudaMalloc(&p.k, nk * 2));
  SP_DEV_CHECK(cudaMalloc(&p.v, nk * 2));
  SP_DEV_CHECK(cudaMalloc(&p.o, nq * 2));
  SP_DEV_CHECK(cudaMalloc(&p.lse, static_cast<std::int64_t>(s) * h_q * 4));
  fill_kernel<<<1024, 256>>>(p.q, nq, 3 * seed + 0);
  fill_kernel<<<1024, 256>>>(p.k, nk, 3 * seed + 1);
  fill_kernel<<<1024, 256>>>(p.v, nk, 3 * seed + 2);
  SP_DEV_CHECK(cudaGetLastError());
  p.tm_q = make_map(p.q, s, h_q);
  p.tm_k = make_map(p.k, s, h_kv);
  p.tm_v = make_map(p.v, s, h_kv);
  return p;
}

void free_problem(Problem& p) {
  SP_DEV_CHECK(cudaFree(p.q));
  SP_DEV_CHECK(cudaFree(p.k));
  SP_DEV_CHECK(cudaFree(p.v));
  SP_DEV_CHECK(cudaFree(p.o));
  SP_DEV_CHECK(cudaFree(p.lse));
}

using LaunchFn = void (*)(const Problem&, cudaStream_t);

template <int kStages, bool kOverlap, bool kPingPong>
void launch(const Problem& p, cudaStream_t stream) {
  auto* kernel = fwd_kernel<kStages, kOverlap, kPingPong>;
  const int smem = static_cast<int>(sizeof(Smem<kStages>)) + 1024;  // + alignment slack
  static bool configured = false;
  if (!configured) {
    SP_DEV_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    configured = true;
  }
  const Args args{p.o, p.lse, p.s, p.h_q, p.h_kv,
                  static_cast<float>(1.0 / std::sqrt(static_cast<double>(kHeadDim)) * 1.4426950408889634)};
  const dim3 grid(p.h_q, (p.s + kTileM - 1) / kTileM);
  kernel<<<grid, kThreads, smem, stream>>>(p.tm_q, p.tm_k, p.tm_v, args);
}

struct Version {
  const char* name;
  LaunchFn fn;
};
const Version kVersions[] = {
    {"v1", launch<2, false, false>},
    {"v2", launch<2, true, false>},
    {"v3", launch<2, true, true>},
    {"v4", launch<3, true, true>},
};

double causal_flops(int s, int h_q) { return 4.0 * h_q * kHeadDim * s * (s + 1.0) / 2.0; }

// Poisons O and LSE with NaN, runs a version, and compares with the fp32 reference. Passing
// needs every element written and finite, ‖O - ref‖ / ‖ref‖ <= 1e-2 and |LSE - ref| <= 1e-3.
bool check(const Version& ver, const Problem& p, const std::vector<float>& o_ref, const std::vector<float>& lse_ref) {
  const std::int64_t no = static_cast<std::int64_t>(p.s) * p.h_q * kHeadDim, nl = static_cast<std::int64_t>(p.s) * p.h_q;
  SP_DEV_CHECK(cudaMemset(p.o, 0xFF, no * 2));  // bf16 0xFFFF is NaN
  SP_DEV_CHECK(cudaMemset(p.lse, 0xFF, nl * 4));
  ver.fn(p, 0);
  SP_DEV_CHECK(cudaGetLastError());
  SP_DEV_CHECK(cudaDeviceSynchronize());
  std::vector<std::uint16_t> o(no);
  std::vector<float> lse(nl);
  SP_DEV_CHECK(cudaMemcpy(o.data(), p.o, no * 2, cudaMemcpyDeviceToHost));
  SP_DEV_CHECK(cudaMemcpy(lse.data(), p.lse, nl * 4, cudaMemcpyDeviceToHost));
  double err2 = 0, ref2 = 0, max_abs = 0, lse_max = 0;
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < no; ++i) {
    std::uint32_t bits = static_cast<std::uint32_t>(o[i]) << 16;
    float x;
    std::memcpy(&x, &bits, 4);
    if (!std::isfinite(x)) {
      ++bad;
      continue;
    }
    const double d = x - o_ref[i];
    err2 += d * d;
    ref2 += static_cast<double>(o_ref[i]) * o_ref[i];
    max_abs = std::max(max_abs, std::fabs(d));
  }
  for (std::int64_t i = 0; i < nl; ++i) {
    if (!std::isfinite(lse[i])) {
      ++bad;
      continue;
    }
    lse_max = std::max(lse_max, static_cast<double>(std::fabs(lse[i] - lse_ref[i])));
  }
  const double rel = std::sqrt(err2 / ref2);
  const bool ok = bad == 0 && rel <= 1e-2 && lse_max <= 1e-3;
  std::printf("check %s s=%-5d h_q=%d h_kv=%d: O rel_fro=%.2e max_abs=%.2e  LSE max_abs=%.2e  non-finite=%lld  %s\n",
              ver.name, p.s, p.h_q, p.h_kv, rel, max_abs, lse_max, static_cast<long long>(bad), ok ? "PASS" : "FAIL");
  return ok;
}

// True when `name` is in the comma-separated list (an empty list selects every version).
bool selected(const char* list, const char* name) {
  if (list == nullptr || *list == '\0') return true;
  const std::size_t n = std::strlen(name);
  for (const char* c = list; (c = std::strstr(c, name)) != nullptr; c += n) {
    const bool starts = c == list || c[-1] == ',';
    if (starts && (c[n] == ',' || c[n] == '\0')) return true;
  }
  return false;
}

// quick: small heads only (fast enough under compute-sanitizer).
bool run_checks(const char* versions, bool quick) {
  bool all = true;
  const std::vector<std::vector<int>> sizes =
      quick ? std::vector<std::vector<int>>{{128, 4, 1}, {1000, 4, 1}}
            : std::vector<std::vector<int>>{{128, 4, 1}, {1000, 32, 8}, {2048, 32, 8}};
  for (const auto& sz : sizes) {
    Problem p = make_problem(sz[0], sz[1], sz[2], 7 + sz[0]);
    float* o_ref_d;
    float* lse_ref_d;
    const std::int64_t no = static_cast<std::int64_t>(p.s) * p.h_q * kHeadDim, nl = static_cast<std::int64_t>(p.s) * p.h_q;
    SP_DEV_CHECK(cudaMalloc(&o_ref_d, no * 4));
    SP_DEV_CHECK(cudaMalloc(&lse_ref_d, nl * 4));
    reference_kernel<<<static_cast<int>((nl + 127) / 128), 128>>>(p.q, p.k, p.v, o_ref_d, lse_ref_d, p.s, p.h_q, p.h_kv,
                                                                   static_cast<float>(1.0 / std::sqrt(128.0)));
    SP_DEV_CHECK(cudaGetLastError());
    std::vector<float> o_ref(no), lse_ref(nl);
    SP_DEV_CHECK(cudaMemcpy(o_ref.data(), o_ref_d, no * 4, cudaMemcpyDeviceToHost));
    SP_DEV_CHECK(cudaMemcpy(lse_ref.data(), lse_ref_d, nl * 4, cudaMemcpyDeviceToHost));
    for (const Version& ver : kVersions) {
      if (selected(versions, ver.name)) all = check(ver, p, o_ref, lse_ref) && all;
    }
    SP_DEV_CHECK(cudaFree(o_ref_d));
    SP_DEV_CHECK(cudaFree(lse_ref_d));
    free_problem(p);
  }
  return all;
}

// Median time of each version at each size, over 3 input sets rotated per run (each set is
// more than the 60 MB L2 at every size timed). Also compares every version's O on set 0 with
// the first selected version's at the smallest size: a difference beyond rounding is a race.
void run_bench(const char* versions, const std::vector<int>& sizes) {
  constexpr int kSets = 3, kWarmup = 3, kReps = 20;
  std::printf("\n%-4s %7s %9s %9s\n", "ver", "s", "ms", "TFLOP/s");
  std::vector<std::vector<float>> rows;
  cudaEvent_t start, stop;
  SP_DEV_CHECK(cudaEventCreate(&start));
  SP_DEV_CHECK(cudaEventCreate(&stop));
  for (const int s : sizes) {
    std::vector<Problem> sets;
    for (int i = 0; i < kSets; ++i) sets.push_back(make_problem(s, 32, 8, 100 + i));
    std::vector<std::uint16_t> first, other;
    const char* first_name = "";
    const std::int64_t no = static_cast<std::int64_t>(s) * 32 * kHeadDim;
    for (const Version& ver : kVersions) {
      if (!selected(versions, ver.name)) continue;
      for (int i = 0; i < kWarmup; ++i) ver.fn(sets[i % kSets], 0);
      SP_DEV_CHECK(cudaGetLastError());
      std::vector<float> ms(kReps);
      for (int i = 0; i < kReps; ++i) {
        SP_DEV_CHECK(cudaEventRecord(start));
        ver.fn(sets[i % kSets], 0);
        SP_DEV_CHECK(cudaEventRecord(stop));
        SP_DEV_CHECK(cudaEventSynchronize(stop));
        SP_DEV_CHECK(cudaEventElapsedTime(&ms[i], start, stop));
      }
      SP_DEV_CHECK(cudaGetLastError());
      std::sort(ms.begin(), ms.end());
      const float med = ms[kReps / 2];
      std::printf("%-4s %7d %9.3f %9.1f\n", ver.name, s, med, causal_flops(s, 32) / (med * 1e-3) / 1e12);
      if (s == sizes.front()) {
        ver.fn(sets[0], 0);
        SP_DEV_CHECK(cudaDeviceSynchronize());
        if (first.empty()) first_name = ver.name;
        std::vector<std::uint16_t>& dst = first.empty() ? first : other;
        dst.resize(no);
        SP_DEV_CHECK(cudaMemcpy(dst.data(), sets[0].o, no * 2, cudaMemcpyDeviceToHost));
        if (&dst == &other) {
          double max_diff = 0;
          for (std::int64_t i = 0; i < no; ++i) {
            std::uint32_t a = static_cast<std::uint32_t>(first[i]) << 16, b = static_cast<std::uint32_t>(other[i]) << 16;
            float fa, fb;
            std::memcpy(&fa, &a, 4);
            std::memcpy(&fb, &b, 4);
            const double d = std::fabs(static_cast<double>(fa) - fb);
            max_diff = std::isnan(d) ? INFINITY : std::max(max_diff, d);
          }
          std::printf("     %s vs %s at s=%d: max |dO| = %.2e\n", ver.name, first_name, s, max_diff);
        }
      }
    }
    for (Problem& p : sets) free_problem(p);
  }
  SP_DEV_CHECK(cudaEventDestroy(start));
  SP_DEV_CHECK(cudaEventDestroy(stop));
}

}  // namespace sparseprefill::cuda::dev90

int main(int argc, char** argv) {
  using namespace sparseprefill::cuda::dev90;
  const char* mode = argc > 1 ? argv[1] : "all";
  const char* versions = argc > 2 ? argv[2] : "";
  cudaDeviceProp prop;
  SP_DEV_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs, %.0f MB L2, compute %d.%d\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6,
              prop.major, prop.minor);
  if (prop.major != 9) {
    std::fprintf(stderr, "needs an sm_90 (Hopper) GPU\n");
    return 1;
  }
  if (std::strcmp(mode, "info") == 0) return 0;
  cudaDriverEntryPointQueryResult query;
  SP_DEV_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&g_encode), 12000,
                                                cudaEnableDefault, &query));
  if (query != cudaDriverEntryPointSuccess || g_encode == nullptr) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found in the driver\n");
    return 1;
  }
  bool ok = true;
  std::vector<int> sizes;
  for (const char* c = argc > 3 ? argv[3] : "8192,16384,32768"; *c != '\0';) {
    char* end;
    sizes.push_back(static_cast<int>(std::strtol(c, &end, 10)));
    c = *end == ',' ? end + 1 : end;
    if (sizes.back() <= 0 || (*end != ',' && *end != '\0')) {
      std::fprintf(stderr, "sizes: expected comma-separated positive integers\n");
      return 1;
    }
  }
  const bool quick = std::strcmp(mode, "quick") == 0;
  if (std::strcmp(mode, "bench") != 0) ok = run_checks(versions, quick);
  if (std::strcmp(mode, "check") != 0 && !quick) run_bench(versions, sizes);
  return ok ? 0 : 1;
}
