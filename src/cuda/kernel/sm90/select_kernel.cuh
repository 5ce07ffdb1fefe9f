// SPDX-License-Identifier: Apache-2.0
// estimate_select's selector on Hopper (sm_90a): the portable selector's scoring
// (select_kernel.cuh: S^T = K̄ · Q^T, E_j a row sum of the accumulator) with wgmma in place of
// mma.sync: the 128 query rows against 64 pooled blocks are 8 m64n128k16 instructions per
// warpgroup instead of 64 ldmatrix/mma pairs per warp. The block means, the energies' reduction
// (warp_lambdas) and the mask writing are the portable kernel's. Selector alone at 16K / 32K /
// 128K (Llama-3.1-8B, structured inputs, H200): 0.131 / 0.294 / 2.34 ms (record
// 2026-11-30-h200-selector-hopper-split-last-chunk) against the portable kernel's 0.125 / 0.316 /
// 3.16 (record 2026-11-30-h200-portable-path-forced-full-end-hoisted). Included only by generated
// instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/select_kernel.cuh"
#include "cuda/kernel/sm90/hopper.cuh"

namespace sparseprefill::cuda::select90 {

namespace hw = sm90::hw;

// A CTA selects for one query tile of 128 rows and one unit (query head, or KV group with
// pack_gqa): two warpgroups, warpgroup w scoring query rows 64·w .. 64·w + 63 against every chunk
// of 64 pooled blocks (wgmma m64n64k16), each with its own λ per block (added in
// finish_selection). Chunks of k̄ are shared by both warpgroups, kStages deep. Tiles are
// [d / 64][rows][64] with the 128-byte swizzle, the layout the Hopper forward kernel's TMA writes.
template <bool kBf16_, int kD>
struct Select90Config {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kD;
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kRows = 128;                     // query rows of the tile
  static constexpr int kWgRows = kRows / kWarpgroups;  // a warpgroup's rows: wgmma N
  static constexpr int kChunk = 64;                     // pooled blocks of a step: wgmma M
  static constexpr int kStages = 4;                     // k̄ chunks in shared memory
  static constexpr int kRowBytes = 128;
  static constexpr int kHalves = kD / 64;
  static constexpr int kKSteps = kD / 16;
  static constexpr int kQHalfBytes = kRows * kRowBytes;
  static constexpr int kQBytes = kHalves * kQHalfBytes;
  static constexpr int kChunkHalfBytes = kChunk * kRowBytes;
  static constexpr int kChunkBytes = kHalves * kChunkHalfBytes;
  static constexpr int kSmemFixed = kQBytes + kStages * kChunkBytes;
  static_assert(kRows == kBlockQ, "one query tile of block 128 per CTA");
  static_assert(kD == 64 || kD == 128, "d = 64 or 128");
  // Plus λ per warpgroup and block, and the slack that aligns the tiles to the swizzle period
  // (1024 B).
  static std::size_t smem_bytes(int num_k_blocks) {
    return 1024 + kSmemFixed + static_cast<std::size_t>(kWarpgroups) * static_cast<std::size_t>(num_k_blocks) * sizeof(float);
  }
};

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

// Per head (pack_gqa: the group's heads in turn) the CTA loads the Q tile and the first chunks;
// then step c issues the wgmma of chunk c + 1 into one accumulator set before reducing chunk c's
// scores from the other, so that the tensor pipe works while the warpgroup takes its
// exponentials (two sets of 32 registers: the 64-row N keeps them, and two CTAs, inside 128
// registers). Both warpgroups read the same chunk, so every chunk is loaded once per tile and
// there is no odd last chunk to split. One CTA barrier per step: after it every chunk up to c + 1
// has landed for every thread and every warpgroup has finished the wgmma of chunk c (waited at
// the end of step c - 1), so chunk c + kStages may load into chunk c's buffer.
// Invariant at the top of step c: acc_cur holds chunk c's scores; the cp.async groups in flight
// hold chunks c + 1 .. c + kStages - 1 (one group per chunk, empty past the last).
template <bool kBf16, int kD>
__global__ void __launch_bounds__(Select90Config<kBf16, kD>::kThreads, 2)
    select90_kernel(const __grid_constant__ SelectParams p) {
  using Cfg = Select90Config<kBf16, kD>;
  constexpr int kChunk = Cfg::kChunk, kStages = Cfg::kStages;
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ float s_red[Cfg::kThreads / 32];
  __shared__ int s_count[2][Cfg::kThreads / 32];

  const int tid = threadIdx.x, wg = tid / 128, wt = tid % 128, lane = tid % 32;
  select::SelectTile t;
  if (!t.init(p, blockIdx.x)) return;
  const std::uint32_t raw = hw::smem_u32(smem_raw);
  const std::uint32_t pad = (1024 - (raw & 1023)) & 1023;
  const std::uint32_t s_q = raw + pad;
  const std::uint32_t s_chunks = s_q + Cfg::kQBytes;
  // λ_j of warpgroup 0's rows, then warpgroup 1's ([2][num_k_blocks], entries j < A used).
  float* energy = reinterpret_cast<float*>(smem_raw + pad + Cfg::kSmemFixed);
  float* wg_energy = energy + wg * p.num_k_blocks;

  const int chunks = (t.scored + kChunk - 1) / kChunk;
  const int q0 = wg * Cfg::kWgRows;
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const auto* mean = static_cast<const std::uint16_t*>(p.k_mean) +
                     (static_cast<std::int64_t>(t.b) * p.h_kv + t.hk) * p.num_k_blocks * static_cast<std::int64_t>(kD);
  const std::uint64_t b_desc = hw::kmajor_desc_sw128(s_q + static_cast<std::uint32_t>(q0 * Cfg::kRowBytes));
  // Chunk c into its buffer, then commit (an empty group past the last chunk); rows past A
  // zero-filled.
  auto load_chunk = [&](int c) {
    if (c < chunks) {
      const int valid = t.scored - c * kChunk;
      load_rows_sw128<kChunk, kD, Cfg::kThreads>(s_chunks + static_cast<std::uint32_t>((c % kStages) * Cfg::kChunkBytes),
                                                 mean + static_cast<std::int64_t>(c) * kChunk * kD, kD,
                                                 valid < kChunk ? valid : kChunk, tid);
    }
    ptx::cp_async_commit();
  };
  // Chunk c's scores of this warpgroup's rows into `acc` (issued, not waited).
  auto issue = [&](float (&acc)[Cfg::kWgRows / 8][4], int c) {
    const std::uint64_t a = hw::kmajor_desc_sw128(s_chunks + static_cast<std::uint32_t>((c % kStages) * Cfg::kChunkBytes));
    hw::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
      hw::wgmma_ss_n64<kBf16>(acc, a + hw::kmajor_k_step<Cfg::kChunkHalfBytes>(kk),
                              b_desc + hw::kmajor_k_step<Cfg::kQHalfBytes>(kk), kk > 0);
    }
    hw::wgmma_commit();
  };
  // Chunk c + 1 landed for every thread (and every warpgroup past chunk c's wgmma): chunk
  // c + kStages into chunk c's buffer.
  auto next_landed = [&](int c) {
    ptx::cp_async_wait<kStages - 2>();
    hw::fence_proxy_async();  // the cp.async writes ordered before wgmma's reads
    __syncthreads();
    load_chunk(c + kStages);
  };
  // Step c: chunk c + 1's wgmma into `nxt`, chunk c's energies from `cur`, then wait for `nxt`.
  auto step = [&](float (&cur)[Cfg::kWgRows / 8][4], float (&nxt)[Cfg::kWgRows / 8][4], int c, bool add) {
    if (c + 1 < chunks) {
      next_landed(c);
      issue(nxt, c + 1);
    }
    // Warp w of the warpgroup holds blocks j0 .. j0 + 15. Pairs that do not contribute exist
    // only in the chunk holding A - 1, the tile's own blocks or a short tile: the mask is
    // applied only there.
    const int j0 = c * kChunk + (wt / 32) * 16;
    const bool masked = j0 + 15 >= t.scored || q0 + Cfg::kWgRows > t.rows_valid ||
                        t.a_f + q0 < static_cast<std::int64_t>(j0 + 15) * p.block;
    select::warp_lambdas(cur, t, p.block, scale_log2, j0, q0, masked, add, wg_energy, 0, lane);
    hw::wgmma_wait<0>();
    hw::fence_regs(nxt);
  };

#pragma unroll 1
  for (int head = 0; chunks > 0 && head < t.heads; ++head) {
    if (head > 0) __syncthreads();  // every warpgroup is done with the previous head's Q and chunks
    load_rows_sw128<Cfg::kRows, kD, Cfg::kThreads>(
        s_q, static_cast<const std::uint16_t*>(p.q) + t.seq.q_off + (t.h0 + head) * p.q_head_stride + t.row0 * p.q_row_stride,
        p.q_row_stride, t.rows_valid, tid);
    load_chunk(0);  // with Q: one group
#pragma unroll
    for (int c = 1; c < kStages; ++c) load_chunk(c);
    float acc0[Cfg::kWgRows / 8][4], acc1[Cfg::kWgRows / 8][4];
    ptx::cp_async_wait<kStages - 1>();  // Q and chunk 0
    hw::fence_proxy_async();
    __syncthreads();
    issue(acc0, 0);
    hw::wgmma_wait<0>();
    hw::fence_regs(acc0);
    // Chunk 0's buffer is refilled at step 0: the barrier there orders every warpgroup's wait
    // above before it.
#pragma unroll 1
    for (int c = 0; c < chunks; c += 2) {
      step(acc0, acc1, c, head > 0);
      if (c + 1 < chunks) step(acc1, acc0, c + 1, head > 0);
    }
  }
  __syncthreads();  // every λ written
  select::finish_selection<Cfg::kThreads / 32>(p, t, energy, energy + p.num_k_blocks, s_red, s_count);
}

// The block means (the portable kernel), then the selector; returns a cudaError_t value.
template <bool kBf16, int kD>
int launch_select(const SelectParams& p, void* stream) {
  using Cfg = Select90Config<kBf16, kD>;
  return select::launch_means_and_selector<kBf16, kD>(p, stream, select90_kernel<kBf16, kD>, Cfg::kThreads,
                                                      Cfg::smem_bytes(p.num_k_blocks));
}

}  // namespace sparseprefill::cuda::select90
