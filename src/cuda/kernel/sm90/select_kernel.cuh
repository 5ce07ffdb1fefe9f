// SPDX-License-Identifier: Apache-2.0
// estimate_select's selector on the Hopper path (sm_90a): the portable selector's transposed
// scores S^T = K̄ · Q^T with wgmma instead of mma.sync (the block means, the energies' rule,
// the keep rule and the lists are the portable kernel's: cuda/kernel/select_kernel.cuh).
// Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel/select_kernel.cuh"
#include "cuda/kernel/sm90/hopper.cuh"

namespace sparseprefill::cuda::sm90 {

// Two warpgroups; a chunk is 128 pooled blocks, 64 per warpgroup (the m64 of wgmma), scored
// against the 128 query rows of the tile in two halves of 64 (n64), each half its own wgmma
// group: the second half multiplies while the first half's energies are summed (the forward
// kernel's intra-warpgroup overlap; a pipeline across chunks, reading one accumulator set while
// the next chunk's wgmma runs, was serialised by ptxas: C7514). 32 + 32 accumulators per
// thread, two CTAs per SM. Tiles of [rows][d] are stored as d / 64 boxes of [rows][64] with the
// 128-byte swizzle wgmma reads.
template <bool kBf16_, int kD_>
struct Select90Config {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kD = kD_;
  static constexpr int kThreads = 256;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int kRows = 128;   // = kBlockQ: query rows
  static constexpr int kHalf = 64;    // query rows per wgmma group (its n)
  static constexpr int kChunk = 128;  // pooled blocks per chunk, 64 per warpgroup
  static constexpr int kHalfDim = 64;
  static constexpr int kRowBytes = kHalfDim * 2;     // 128: one swizzle row
  static constexpr int kAtomBytes = 8 * kRowBytes;   // 1024: the 128B-swizzle period
  static constexpr int kBoxBytes = 128 * kRowBytes;  // one [128][64] box (Q tile or chunk)
  static constexpr int kTileBytes = (kD / kHalfDim) * kBoxBytes;
  static constexpr int kKSteps = kD / 16;
  // Q tile + two chunks of k̄, 1024-aligned (the swizzle atoms), then λ per block.
  static constexpr int kSmemFixed = 3 * kTileBytes;
  static_assert(kRows == kBlockQ, "one query tile of block 128 per CTA");
  static_assert(kD == 64 || kD == 128, "d = 64 or 128");
  static std::size_t smem_bytes(int num_k_blocks) {
    return kAtomBytes + kSmemFixed + static_cast<std::size_t>(num_k_blocks) * sizeof(float);
  }
};

// Rows 0 .. valid - 1 of a [128][kD] source (rows `stride` elements apart) into the swizzled
// boxes at `dst`; rows past `valid` become zeros without a read. 16-byte chunk c of row r goes
// to box c / 8, row r, chunk (c % 8) ^ (r % 8). The caller commits the group.
template <class Cfg>
__device__ __forceinline__ void load_swizzled(std::uint32_t dst, const std::uint16_t* src, std::int64_t stride, int valid,
                                              int tid) {
  constexpr int kChunks = Cfg::kD / 8;  // per row
  static_assert((128 * kChunks) % Cfg::kThreads == 0, "whole passes");
#pragma unroll
  for (int n = 0; n < 128 * kChunks / Cfg::kThreads; ++n) {
    const int idx = tid + n * Cfg::kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r < valid;
    const std::uint32_t to =
        dst + static_cast<std::uint32_t>((c / 8) * Cfg::kBoxBytes + r * Cfg::kRowBytes + (((c % 8) ^ (r & 7)) << 4));
    ptx::cp_async_16(to, ok ? src + r * stride + c * 8 : src, ok ? 16 : 0);
  }
}

// One CTA per mask row (select::SelectTile). Steps over (head, chunk of 128 blocks), one barrier
// each, the next chunk loading while this one is scored; warpgroup wg scores blocks
// 64·wg .. +63 of the chunk with 2 · kD / 16 wgmma m64n64k16 (both operands K-major from shared
// memory), and select::warp_lambdas turns each warp's 16 rows into λ, half by half.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 2) select90_kernel(const __grid_constant__ SelectParams p) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  __shared__ float s_red[Cfg::kWarps];
  __shared__ int s_count[2][Cfg::kWarps];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wg = warp / 4, wq = warp % 4;
  select::SelectTile t;
  if (!t.init(p, blockIdx.x)) return;
  const float scale_log2 = p.scale * 1.4426950408889634f;

  const std::uint32_t base = (ptx::smem_addr(smem_raw) + Cfg::kAtomBytes - 1) & ~static_cast<std::uint32_t>(Cfg::kAtomBytes - 1);
  const std::uint32_t s_q = base;
  const std::uint32_t s_k = base + Cfg::kTileBytes;  // 2 buffers
  float* lambda = reinterpret_cast<float*>(smem_raw + (base - ptx::smem_addr(smem_raw)) + Cfg::kSmemFixed);

  const auto* mean = static_cast<const std::uint16_t*>(p.k_mean) +
                     (static_cast<std::int64_t>(t.b) * p.h_kv + t.hk) * p.num_k_blocks * static_cast<std::int64_t>(Cfg::kD);
  const int chunks = (t.scored + Cfg::kChunk - 1) / Cfg::kChunk;
  auto load_chunk = [&](int c, int buf) {
    const int valid = t.scored - c * Cfg::kChunk;
    load_swizzled<Cfg>(s_k + buf * Cfg::kTileBytes, mean + static_cast<std::int64_t>(c) * Cfg::kChunk * Cfg::kD, Cfg::kD,
                       valid < Cfg::kChunk ? valid : Cfg::kChunk, tid);
  };
  auto load_q = [&](int h) {
    load_swizzled<Cfg>(s_q,
                       static_cast<const std::uint16_t*>(p.q) + t.seq.q_off + h * p.q_head_stride + t.row0 * p.q_row_stride,
                       p.q_row_stride, t.rows_valid, tid);
  };
  // Descriptors: rows of 64 elements (128 B), 8-row groups 1024 B apart (SBO); the k16 step kk
  // at +32·(kk % 4) bytes inside box kk / 4; address fields in 16-byte units.
  auto k_step = [](int kk) { return static_cast<std::uint64_t>(((kk / 4) * Cfg::kBoxBytes + (kk % 4) * 32) >> 4); };
  const std::uint64_t q_desc = hw::desc_sw128(s_q, 16, Cfg::kAtomBytes);
  const std::uint64_t q_half = (Cfg::kHalf * Cfg::kRowBytes) >> 4;  // rows 64.. of the Q tile

  // Invariant at the top of a step: the only cp.async group in flight holds chunk c (in buffer
  // `buf`) and, at a head's first chunk, its Q tile.
  load_q(t.h0);
  load_chunk(0, 0);
  ptx::cp_async_commit();
  int buf = 0;
#pragma unroll 1
  for (int head = 0; head < t.heads; ++head) {
#pragma unroll 1
    for (int c = 0; c < chunks; ++c, buf ^= 1) {
      ptx::cp_async_wait<0>();  // chunk c (and Q) landed for this thread...
      hw::fence_proxy_async();  // ...and is ordered before the async proxy's (wgmma's) reads...
      __syncthreads();          // ...for every thread; every warp is done with the previous step
      if (c + 1 < chunks) {
        load_chunk(c + 1, buf ^ 1);
      } else if (head + 1 < t.heads) {
        load_chunk(0, buf ^ 1);
      }
      ptx::cp_async_commit();

      // Issued by both warpgroups even past A (zero rows, never read back): a wgmma under a
      // branch is serialised by ptxas (C7520). Query half 0 into acc0, half 1 into acc1.
      const int jw = c * Cfg::kChunk + wg * 64;  // the warpgroup's first block
      const std::uint64_t a_desc = hw::desc_sw128(s_k + buf * Cfg::kTileBytes + wg * 64 * Cfg::kRowBytes, 16, Cfg::kAtomBytes);
      float acc0[8][4], acc1[8][4];
      hw::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::kKSteps; ++kk) hw::wgmma_ss_n64<Cfg::kBf16>(acc0, a_desc + k_step(kk), q_desc + k_step(kk), kk > 0);
      hw::wgmma_commit();
#pragma unroll
      for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
        hw::wgmma_ss_n64<Cfg::kBf16>(acc1, a_desc + k_step(kk), q_desc + q_half + k_step(kk), kk > 0);
      }
      hw::wgmma_commit();
      // Warp wq holds blocks j0 .. j0 + 15 (accumulator rows 16·wq + g, + 8); the mask only
      // where some pair may not contribute (see the portable kernel).
      const int j0 = jw + 16 * wq;
      const bool live = jw < t.scored;
      const bool edge = j0 + 15 >= t.scored || t.a_f < static_cast<std::int64_t>(j0 + 15) * p.block;
      hw::wgmma_wait<1>();  // half 0 done; half 1 may run on
      hw::fence_regs(acc0);
      if (live) {
        select::warp_lambdas(acc0, t, p.block, scale_log2, j0, 0, edge || t.rows_valid < Cfg::kHalf, head > 0, lambda, lane);
      }
      hw::wgmma_wait<0>();
      hw::fence_regs(acc1);
      if (live) {
        select::warp_lambdas(acc1, t, p.block, scale_log2, j0, Cfg::kHalf, edge || t.rows_valid < Cfg::kRows, true, lambda,
                             lane);
      }
      if (c + 1 == chunks && head + 1 < t.heads) {  // the next head's Q once every warp is done with this one
        __syncthreads();
        load_q(t.h0 + head + 1);
        ptx::cp_async_commit();
      }
    }
  }
  __syncthreads();  // every λ written
  select::finish_selection<Cfg::kWarps>(p, t, lambda, nullptr, s_red, s_count);
}

// The block means (the portable kernel) and the selector; returns a cudaError_t value.
template <class Cfg>
int launch_select90(const SelectParams& p, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (p.batch == 0 || p.num_k_blocks == 0) return 0;
  select::block_means_kernel<Cfg::kBf16, Cfg::kD><<<dim3(p.num_k_blocks, p.h_kv, p.batch), Cfg::kD, 0, st>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return static_cast<int>(err);
  const std::size_t smem = Cfg::smem_bytes(p.num_k_blocks);
  auto* kernel = select90_kernel<Cfg>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  const int units = p.pack_gqa ? p.h_kv : p.h_q;
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(units) *
                        static_cast<unsigned>(p.batch);
  if (grid == 0) return 0;
  kernel<<<grid, Cfg::kThreads, smem, st>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm90
