// SPDX-License-Identifier: Apache-2.0
// estimate_select's selector on the Hopper path (sm_90a): the portable selector's transposed
// scores S^T = K̄ · Q^T (cuda/kernel/select_kernel.cuh: tile setup, per-warp energies, keep
// rule and lists are shared) with wgmma: 64-block chunks of k̄ stream by TMA through a
// 4-stage mbarrier ring, two warpgroups score each chunk against their query halves and take
// turns issuing (ping-pong), so that one warpgroup's energies (one exp2 per pair) overlap the
// other's multiply. The block means are the portable kernel's launch, which calls this one in
// place of its own selector. Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel/select_kernel.cuh"
#include "cuda/kernel/sm90/fwd_kernel.cuh"
#include "cuda/kernel/sm90/hopper.cuh"

namespace sparseprefill::cuda::sm90 {

// Two warpgroups, one per query half (rows 64·wg .. +63), and no producer warp: 8 warps of at
// most 128 registers, 2 CTAs per SM, so one CTA's Q load and keep rule overlap the other's
// scoring. A round is one chunk of 64 pooled blocks, which both warpgroups score against their
// halves (wgmma m64n64k16), so every warp has work in a tile's first and last chunks; each half
// keeps its own λ, added in the keep rule (as in the portable selector).
//
// Measured on the way (records 2026-11-29-h200-selector-hopper-warp-specialised and
// -selector-hopper-128-block-rounds): a ninth, producer warp cost the second CTA (an SM
// sub-partition holds 4 warps of 112 registers, so 2 x 9 did not fit: 5.5-6.1 ms at 128K
// against the portable selector's 3.9); 128-block rounds split between the warpgroups by
// blocks ran 3.5 ms at 128K but 0.39 / 0.16 ms at 32K / 16K (portable 0.37 / 0.14): a tile's
// last chunk left one warpgroup idle.
template <bool kBf16_, int kHeadDim_>
struct Select90Config {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kThreads = 256;
  static constexpr int kTileM = kBlockQ;  // query rows
  static constexpr int kChunk = 64;       // pooled blocks per round: the m of wgmma
  static constexpr int kStages = 4;
  static constexpr int kHalfDim = 64;
  static constexpr int kHalves = kHeadDim / kHalfDim;  // d-halves: 128-byte swizzle rows
  static constexpr int kRowBytes = kHalfDim * 2;
  static constexpr int kAtomBytes = 8 * kRowBytes;
  static constexpr int kQHalfBytes = kTileM * kRowBytes;        // one d-half of Q: [128][64]
  static constexpr int kChunkHalfBytes = kChunk * kRowBytes;    // one d-half of a chunk: [64][64]
  static constexpr int kQBytes = kHalves * kQHalfBytes;
  static constexpr int kChunkBytes = kHalves * kChunkHalfBytes;
  static constexpr int kKSteps = kHeadDim / 16;
  static constexpr int kTileN = kChunk;  // encode_mean_map's box rows
  static_assert(kHeadDim == 64 || kHeadDim == 128, "d = 64 or 128");
};

template <class Cfg>
struct alignas(1024) Select90Smem {
  std::uint8_t q[Cfg::kQBytes];                    // the query tile, [d-half][row][64], 128B swizzle
  std::uint8_t k[Cfg::kStages][Cfg::kChunkBytes];  // k̄ chunks, as TMA writes them
  std::uint64_t k_loaded[Cfg::kStages];            // TMA -> warps (transaction bytes)
  std::uint64_t k_free[Cfg::kStages];              // 8 warp arrivals: the stage may be refilled
  float red[8];
  int count[2][8];
  // Then λ per query half and pooled block: [2][num_k_blocks] floats (the launch sizes the
  // dynamic shared memory).
};

namespace select90 {

// Rows 0 .. valid - 1 of the query tile (rows `stride` elements apart) into the layout TMA
// writes; rows past `valid` become zeros without a read. Called by all 256 threads; the caller
// waits for the group.
template <class Cfg>
__device__ __forceinline__ void load_q(std::uint32_t dst, const std::uint16_t* src, std::int64_t stride, int valid) {
  constexpr int kChunks = Cfg::kHeadDim / 8;  // 16-byte chunks per row
  static_assert((128 * kChunks) % Cfg::kThreads == 0, "whole passes");
#pragma unroll
  for (int n = 0; n < 128 * kChunks / Cfg::kThreads; ++n) {
    const int idx = static_cast<int>(threadIdx.x) + n * Cfg::kThreads;
    const int r = idx / kChunks, c = idx % kChunks;
    const std::uint32_t to =
        dst + static_cast<std::uint32_t>((c / 8) * Cfg::kQHalfBytes + r * Cfg::kRowBytes + (((c % 8) ^ (r & 7)) << 4));
    ptx::cp_async_16_or_zero(to, src + static_cast<std::int64_t>(r < valid ? r : 0) * stride + c * 8, r < valid);
  }
  ptx::cp_async_commit();
}

}  // namespace select90

// One CTA per mask row (select::SelectTile), in the portable selector's grid order. Rounds over
// (head, chunk of 64 blocks), the same for both warpgroups; warpgroup wg scores the chunk
// against query rows 64·wg .. +63 (kD / 16 wgmma m64n64k16, both operands K-major from shared
// memory), then select::warp_lambdas turns each warp's 16 blocks into λ of its half. The wgmma
// is issued in every round whatever the chunk holds (ptxas serialises wgmma under a branch:
// C7520); warps whose blocks lie past A skip only the energies. Thread 0 requests the first
// kStages chunks, thread 128 (warpgroup 1 issues second, so it mostly releases a stage last)
// each later one once all 8 warps have released its stage.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 2)
    select90_kernel(const __grid_constant__ SelectParams p, const __grid_constant__ MeanMaps mean_maps) {
  using S = Select90Smem<Cfg>;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = hw::smem_u32(smem_raw);
  S& sm = *reinterpret_cast<S*>(smem_raw + ((1024 - (raw & 1023)) & 1023));
  float* lambda = reinterpret_cast<float*>(reinterpret_cast<std::uint8_t*>(&sm) + sizeof(S));

  select::SelectTile t;
  if (!t.init(p, blockIdx.x)) return;
  const int chunks = (t.scored + Cfg::kChunk - 1) / Cfg::kChunk;
  const int rounds = t.heads * chunks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int st = 0; st < Cfg::kStages; ++st) {
      hw::mbar_init(hw::smem_u32(&sm.k_loaded[st]), 1);
      hw::mbar_init(hw::smem_u32(&sm.k_free[st]), 8);
    }
    hw::fence_mbar_init();
  }
  __syncthreads();
  // Chunk n (of round n: head n / chunks) into stage n % kStages; blocks past the means'
  // capacity read as zero.
  auto request = [&](int n) {
    const int st = n % Cfg::kStages;
    const std::uint32_t bar = hw::smem_u32(&sm.k_loaded[st]);
    hw::mbar_expect_tx(bar, Cfg::kChunkBytes);
    for (int half = 0; half < Cfg::kHalves; ++half) {
      hw::tma_load_4d(hw::smem_u32(sm.k[st]) + half * Cfg::kChunkHalfBytes, &mean_maps.k, bar, half * Cfg::kHalfDim,
                      (n % chunks) * Cfg::kChunk, t.hk, t.b);
    }
  };
  if (threadIdx.x == 0) {
    for (int n = 0; n < Cfg::kStages && n < rounds; ++n) request(n);
  }

  const int wg = warp / 4, wq = warp % 4;
  const int q0 = 64 * wg;  // this warpgroup's query half
  float* half_lambda = lambda + wg * p.num_k_blocks;
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const auto* q_rows = static_cast<const std::uint16_t*>(p.q) + t.seq.q_off + t.row0 * p.q_row_stride;
  auto load_q = [&](int h) {
    select90::load_q<Cfg>(hw::smem_u32(sm.q), q_rows + h * p.q_head_stride, p.q_row_stride, t.rows_valid);
    ptx::cp_async_wait<0>();
    hw::fence_proxy_async();  // cp.async wrote Q: the wgmma reads it
    __syncthreads();
  };
  // Descriptors as in the forward kernel: rows of 64 elements, 8-row groups 1024 B apart, the
  // k16 step kk at +32·(kk % 4) bytes inside d-half kk / 4 (address fields in 16-byte units);
  // the d-halves of a chunk are [64][64] boxes, those of Q [128][64].
  auto step = [](int kk, int half_bytes) { return static_cast<std::uint64_t>(((kk / 4) * half_bytes + (kk % 4) * 32) >> 4); };
  const std::uint64_t q_desc = hw::desc_sw128(hw::smem_u32(sm.q) + q0 * Cfg::kRowBytes, 16, Cfg::kAtomBytes);

  load_q(t.h0);
  const int my_turn = 1 + wg, other_turn = 2 - wg;
  if (wg == 1 && rounds > 0) hw::named_arrive(1);  // warpgroup 0 issues first
  float acc[8][4];
  for (int n = 0; n < rounds; ++n) {
    const int st = n % Cfg::kStages, head = n / chunks, c = n % chunks;
    if (c == 0 && head > 0) {
      __syncthreads();  // every warp's wgmma on the previous head's Q completed
      load_q(t.h0 + head);
    }
    hw::mbar_wait(hw::smem_u32(&sm.k_loaded[st]), (n / Cfg::kStages) & 1);
    hw::named_sync(my_turn);
    const std::uint64_t a_desc = hw::desc_sw128(hw::smem_u32(sm.k[st]), 16, Cfg::kAtomBytes);
    hw::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
      hw::wgmma_ss<Cfg::kBf16>(acc, a_desc + step(kk, Cfg::kChunkHalfBytes), q_desc + step(kk, Cfg::kQHalfBytes), kk > 0);
    }
    hw::wgmma_commit();
    if (wg == 0 || n + 1 < rounds) hw::named_arrive(other_turn);  // warpgroup 1's last would never be consumed
    hw::wgmma_wait<0>();
    hw::fence_regs(acc);
    if (lane == 0) hw::mbar_arrive(hw::smem_u32(&sm.k_free[st]));
    if (threadIdx.x == 128 && n + Cfg::kStages < rounds) {
      hw::mbar_wait(hw::smem_u32(&sm.k_free[st]), (n / Cfg::kStages) & 1);
      request(n + Cfg::kStages);
    }
    // Warp wq holds blocks j0 .. j0 + 15 (accumulator rows 16·wq + g, + 8) against the half's
    // query rows; the mask only where some pair may not contribute (see the portable kernel).
    const int j0 = c * Cfg::kChunk + 16 * wq;
    if (j0 < t.scored) {
      const bool masked = j0 + 15 >= t.scored || q0 + 64 > t.rows_valid ||
                          t.a_f + q0 < static_cast<std::int64_t>(j0 + 15) * p.block;
      select::warp_lambdas(acc, t, p.block, scale_log2, j0, q0, masked, head > 0, half_lambda, lane);
    }
  }
  __syncthreads();  // every λ written
  select::finish_selection<8>(p, t, lambda, lambda + p.num_k_blocks, sm.red, sm.count, [] { __syncthreads(); });
}

// The selector after the block means (the portable launch enqueued them on the same stream);
// returns a cudaError_t value, cudaErrorNotSupported when the driver cannot encode the means'
// tensor map (having enqueued nothing: the caller then runs the portable selector).
template <class Cfg>
int launch_select90(const SelectParams& p, void* stream) {
  if (tensor_map_encoder() == nullptr) return static_cast<int>(cudaErrorNotSupported);
  MeanMaps maps{};
  if (!encode_mean_map<Cfg>(&maps.k, p.k_mean, p.num_k_blocks, p.h_kv, p.batch, Cfg::kChunk)) {
    return static_cast<int>(cudaErrorNotSupported);
  }
  const int units = p.pack_gqa ? p.h_kv : p.h_q;
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(units) *
                        static_cast<unsigned>(p.batch);
  if (grid == 0) return 0;
  const std::size_t smem =
      sizeof(Select90Smem<Cfg>) + 1024 + 2 * static_cast<std::size_t>(p.num_k_blocks) * sizeof(float);
  auto* kernel = select90_kernel<Cfg>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<grid, Cfg::kThreads, smem, static_cast<cudaStream_t>(stream)>>>(p, maps);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm90
