// SPDX-License-Identifier: Apache-2.0
// estimate_select's selector on Hopper (sm_90a): the portable selector's scoring
// (select_kernel.cuh: S^T = K̄ · Q^T, E_j a row sum of the accumulator) with wgmma in place of
// mma.sync: the 128 query rows against 64 pooled blocks are 8 m64n128k16 instructions per
// warpgroup instead of 64 ldmatrix/mma pairs per warp. The block means, the energies' reduction
// (warp_lambdas) and the mask writing are the portable kernel's. Selector alone at 16K / 32K /
// 128K (Llama-3.1-8B, structured inputs, H200): 0.114 / 0.260 / 2.30 ms (record
// 2026-11-30-h200-selector-per-group-heads), against the portable kernel's 0.125 / 0.316 / 3.16
// with a CTA per head (record 2026-11-30-h200-portable-path-forced-full-end-hoisted). Included
// only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/select_kernel.cuh"
#include "cuda/kernel/sm90/hopper.cuh"
#include "cuda/kernel/sm90/rows_sw128.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::select90 {

namespace hw = sm90::hw;

// A CTA selects for one query tile of 128 rows and one unit (query head, or KV group with
// pack_gqa): two warpgroups, each scoring its own chunks of 64 pooled blocks (warpgroup w takes
// chunks w, w + 2, ...; an odd count's last one both, by query rows) against the tile,
// double-buffered. Tiles are [d / 64][rows][64] with the 128-byte swizzle, the layout the
// Hopper forward kernel's TMA writes.
template <bool kBf16_, int kD, bool kFp8_ = false>
struct Select90Config {
  static constexpr bool kBf16 = kBf16_;
  static constexpr bool kFp8 = kFp8_;  // e4m3 Q widened to bf16 (bf16 means)
  static constexpr int kHeadDim = kD;
  static constexpr int kWarpgroups = 2;
  static constexpr int kThreads = 128 * kWarpgroups;
  static constexpr int kRows = 128;   // query rows: wgmma N
  static constexpr int kChunk = tuning::kSelect90Chunk;   // pooled blocks of a warpgroup step: wgmma M
  static constexpr int kStages = tuning::kSelect90Stages;  // k̄ buffers per warpgroup
  static constexpr int kRowBytes = 128;
  static constexpr int kHalves = kD / 64;
  static constexpr int kKSteps = kD / 16;
  static constexpr int kQHalfBytes = kRows * kRowBytes;
  static constexpr int kQBytes = kHalves * kQHalfBytes;
  static constexpr int kChunkHalfBytes = kChunk * kRowBytes;
  static constexpr int kChunkBytes = kHalves * kChunkHalfBytes;
  static constexpr int kSmemFixed = kQBytes + kWarpgroups * kStages * kChunkBytes;
  static_assert(kRows == kBlockQ, "one query tile of block 128 per CTA");
  // 256: FP8's (the 16-bit selector there is the portable one, variants.py); its shared memory
  // (197 KB and λ) leaves one CTA per SM, which then takes up to 255 registers a thread (ptxas:
  // 136 bytes of spill stores, against 160 at two CTAs' 128; d 128 spills 84 bytes too).
  static_assert(kD == 64 || kD == 128 || (kD == 256 && kFp8_), "d = 64 or 128, fp8 also 256");
  static constexpr int kCtasPerSm = kD <= 128 ? 2 : 1;
  static_assert(!kFp8 || kBf16, "e4m3 queries meet bf16 means");
  // Plus λ per block and the slack that aligns the tiles to the swizzle period (1024 B).
  static std::size_t smem_bytes(int num_k_blocks) {
    return 1024 + kSmemFixed + static_cast<std::size_t>(num_k_blocks) * sizeof(float);
  }
};

// The CTA takes its KV group's heads in turn (SelectTile). Per head it loads the Q tile (the next
// head's, with its first chunks, while this head's mask row is written); then in steps
// s = 0 .. ceil(chunks / 2) - 1 warpgroup w scores chunk 2s + w against all 128 rows, both
// warpgroups in step (one CTA barrier per step) while the other CTA resident on the SM fills the
// tensor pipe. An odd count's last chunk is split by query rows instead (each warpgroup its 64
// rows, m64n64k16; warpgroup 1's λ added after the step): whole, it left warpgroup 1 idle for a
// step, and warps waiting at the barrier after the loop were 20% of Nsight's samples at 64K (log
// bench/records/2026-11-30-h200-selector-hopper-ncu-64k.log), a whole tile's worth at 16K where
// a tile has one or two chunks. Warpgroups out of step (a named barrier each) measured 2.34
// against 2.49 ms at 128K and equal at 16K-32K, but compute-sanitizer's racecheck then reports
// hazards on finish_selection's counts, which only barrier 0 orders (records
// 2026-11-30-h200-selector-hopper-out-of-step and -in-step): not worth a sanitizer exception.
// Both warpgroups on every chunk (64 rows each, m64n64k16) with chunk c + 1's wgmma in flight
// over chunk c's energies measured 2.94 ms at 128K (record
// 2026-11-30-h200-selector-hopper-row-halves-pipelined): N = 64 reads more shared memory per
// chunk and doubles the barriers per unit of work.
// Invariant at the top of a step: the only cp.async group in flight holds this step's chunks
// (buffer `buf`).
// kFp8: the e4m3 Q tile is widened into the same bf16 layout (widen_rows_sw128_e4m3) and q's
// descale joins the score scale: (q·qd)·k̄ = qd·(q·k̄), the products exact in bf16 wgmma.
template <bool kBf16, int kD, bool kFp8 = false>
__global__ void __launch_bounds__(Select90Config<kBf16, kD, kFp8>::kThreads,
                                  Select90Config<kBf16, kD, kFp8>::kCtasPerSm)
    select90_kernel(const __grid_constant__ SelectParams p) {
  using Cfg = Select90Config<kBf16, kD, kFp8>;
  constexpr int kChunk = Cfg::kChunk;
  constexpr int kHalfRows = Cfg::kRows / Cfg::kWarpgroups;
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ float s_red[Cfg::kThreads / 32];
  __shared__ int s_count[2][select::kScanRounds][Cfg::kThreads / 32];
  __shared__ float s_split[kChunk];  // warpgroup 1's λ of a split last chunk

  const int tid = threadIdx.x, wg = tid / 128, wt = tid % 128, lane = tid % 32;
  select::SelectTile t;
  if (!t.init(p, blockIdx.x)) return;
  const std::uint32_t raw = hw::smem_u32(smem_raw);
  const std::uint32_t pad = (1024 - (raw & 1023)) & 1023;
  const std::uint32_t s_q = raw + pad;
  const std::uint32_t s_chunks0 = s_q + Cfg::kQBytes;  // warpgroup 0's buffers, then warpgroup 1's
  const std::uint32_t s_chunks = s_chunks0 + static_cast<std::uint32_t>(wg * Cfg::kStages * Cfg::kChunkBytes);
  float* energy = reinterpret_cast<float*>(smem_raw + pad + Cfg::kSmemFixed);  // λ_j, j < A

  const int chunks = (t.scored + kChunk - 1) / kChunk;
  const int steps = (chunks + 1) / 2;
  const bool split_last = chunks % 2 == 1;
  const int last0 = (chunks - 1) * kChunk;  // the last chunk's first block
  const float scale_log2 = p.scale * 1.4426950408889634f * (kFp8 ? ptx::descale_of(p, 0, t.b, t.hk) : 1.f);
  const auto* mean = static_cast<const std::uint16_t*>(p.k_mean) +
                     (static_cast<std::int64_t>(t.b) * p.h_kv + t.hk) * p.num_k_blocks * static_cast<std::int64_t>(kD);
  // This warpgroup's chunk c into its buffer `buf` (rows past A zero-filled).
  auto load_chunk = [&](int c, int buf) {
    const int valid = t.scored - c * kChunk;
    sm90::load_rows_sw128<kChunk, kD, 128>(s_chunks + static_cast<std::uint32_t>(buf * Cfg::kChunkBytes),
                                     mean + static_cast<std::int64_t>(c) * kChunk * kD, kD,
                                     valid < kChunk ? valid : kChunk, wt);
  };
  // This head's Q tile and each warpgroup's first chunk, as one group.
  auto load_head = [&](int head) {
    const std::int64_t q_at = t.seq.q_off + (t.h0 + head) * p.q_head_stride + t.row0 * p.q_row_stride;
    if constexpr (kFp8) {
      sm90::widen_rows_sw128_e4m3<Cfg::kRows, kD, Cfg::kThreads>(s_q, static_cast<const std::uint8_t*>(p.q) + q_at,
                                                                p.q_row_stride, t.rows_valid, tid);
    } else {
      sm90::load_rows_sw128<Cfg::kRows, kD, Cfg::kThreads>(s_q, static_cast<const std::uint16_t*>(p.q) + q_at,
                                                           p.q_row_stride, t.rows_valid, tid);
    }
    if (wg < chunks) load_chunk(wg, 0);
    ptx::cp_async_commit();
  };
  if (chunks > 0) load_head(0);
#pragma unroll 1
  for (int head = 0; head < t.heads; ++head) {
    const bool add = !t.per_head && head > 0;  // pack_gqa: the group's heads into one λ
    int buf = 0;
#pragma unroll 1
    for (int s = 0; s < steps; ++s, buf ^= 1) {
      const int c = 2 * s + wg;
      ptx::cp_async_wait<0>();        // this step's chunks landed for this thread,
      hw::fence_proxy_async();  // ordered before wgmma's reads,
      __syncthreads();                // for every thread; every warp is done with the previous step
      if (c + 2 < chunks) load_chunk(c + 2, buf ^ 1);
      ptx::cp_async_commit();
      // Warp w of the warpgroup holds blocks j0 .. j0 + 15. Pairs that do not contribute exist
      // only in the chunk holding A - 1, the tile's own blocks or a short tile: the mask is
      // applied only there.
      if (split_last && s + 1 == steps) {
        // The last chunk, in warpgroup 0's buffer: this warpgroup's 64 query rows.
        const std::uint64_t a = hw::kmajor_desc_sw128(s_chunks0 + static_cast<std::uint32_t>(buf * Cfg::kChunkBytes));
        const std::uint64_t b = hw::kmajor_desc_sw128(s_q + static_cast<std::uint32_t>(wg * kHalfRows * Cfg::kRowBytes));
        float acc[8][4];
        hw::wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
          hw::wgmma_ss_n64<kBf16>(acc, a + hw::kmajor_k_step<Cfg::kChunkHalfBytes>(kk),
                                  b + hw::kmajor_k_step<Cfg::kQHalfBytes>(kk), kk > 0);
        }
        hw::wgmma_commit();
        hw::wgmma_wait<0>();
        hw::fence_regs(acc);
        const int j0 = last0 + (wt / 32) * 16, q0 = wg * kHalfRows;
        const bool masked = j0 + 15 >= t.scored || q0 + kHalfRows > t.rows_valid ||
                            t.a_f + q0 < static_cast<std::int64_t>(j0 + 15) * p.block;
        select::warp_lambdas(acc, t, p.block, scale_log2, j0, q0, masked, wg == 0 && add, wg == 0 ? energy : s_split,
                             wg == 0 ? 0 : last0, lane);
        continue;
      }
      const std::uint64_t a = hw::kmajor_desc_sw128(s_chunks + static_cast<std::uint32_t>(buf * Cfg::kChunkBytes));
      const std::uint64_t b = hw::kmajor_desc_sw128(s_q);
      float acc[16][4];
      hw::wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
        hw::wgmma_ss<kBf16>(acc, a + hw::kmajor_k_step<Cfg::kChunkHalfBytes>(kk),
                            b + hw::kmajor_k_step<Cfg::kQHalfBytes>(kk), kk > 0);
      }
      hw::wgmma_commit();
      hw::wgmma_wait<0>();
      hw::fence_regs(acc);
      const int j0 = c * kChunk + (wt / 32) * 16;
      const bool masked = j0 + 15 >= t.scored || Cfg::kRows > t.rows_valid ||
                          t.a_f < static_cast<std::int64_t>(j0 + 15) * p.block;
      select::warp_lambdas(acc, t, p.block, scale_log2, j0, 0, masked, add, energy, 0, lane);
    }
    if (split_last) {  // warpgroup 1's half of the last chunk joins warpgroup 0's
      __syncthreads();
      for (int j = last0 + tid; j < t.scored; j += Cfg::kThreads) energy[j] = select::log2_add(energy[j], s_split[j - last0]);
    }
    // Every λ of this head written, and both warpgroups done with its Q, chunks and s_split:
    // the next head's loads fly while this head's mask row is written.
    __syncthreads();
    if (chunks > 0 && head + 1 < t.heads) load_head(head + 1);
    if (t.per_head) {
      t.unit = t.h0 + head;
      select::finish_selection<Cfg::kThreads / 32>(p, t, energy, nullptr, s_red, s_count);
    }
  }
  // pack_gqa: after the loop, not at its last head: ptxas then keeps the loads' addresses live
  // across the loop and spills 500 bytes.
  if (!t.per_head) select::finish_selection<Cfg::kThreads / 32>(p, t, energy, nullptr, s_red, s_count);
}

// One stage: the block means (the portable kernel), or the selector; returns a cudaError_t value.
template <bool kBf16, int kD, bool kFp8 = false>
int launch_select(SelectStage stage, const SelectParams& p, void* stream) {
  using Cfg = Select90Config<kBf16, kD, kFp8>;
  return select::launch_selection_stage<kBf16, kD, kD, kFp8>(stage, p, stream, select90_kernel<kBf16, kD, kFp8>,
                                                             Cfg::kThreads, Cfg::smem_bytes(p.num_k_blocks));
}

}  // namespace sparseprefill::cuda::select90
