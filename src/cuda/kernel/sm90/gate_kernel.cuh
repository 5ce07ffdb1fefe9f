// SPDX-License-Identifier: Apache-2.0
// exact_gate's decisions ahead of the attention, on Hopper (sm_90a): the two-pass execution
// (plan.h, choose_gate_passes). exact_gate keeps a gated block iff some valid row's maximum
// score reaches the head's threshold (policy.cuh, Gate::keeps_row), which no running state
// enters, so every decision can be taken before any softmax: this kernel computes each gated
// block's scores with the forward kernel's wgmma (the same instruction, operand layouts and
// k order, so the same fp32 S), keeps or skips it, and writes the query block's BlockMask row
// (the ungated group A as the partial list, the kept gated blocks as the full list) and its kept
// bitmap. The forward kernel then runs that mask and visits exactly the blocks, in exactly the
// order, the in-kernel gate keeps. Without a softmax between two Q·Kᵀ, nothing waits for a
// decision: the in-kernel gate's vote round trip idles the tensor pipe at every gated block
// (docs/cuda.md, exact_gate). Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/policy.cuh"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm90/hopper.cuh"
#include "cuda/kernel/sm90/rows_sw128.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::gate90 {

namespace hw = sm90::hw;

// A CTA decides for one query block of kBlockQ = 128 rows and heads_per_cta (H <= kMaxHeads)
// query heads of one KV group, so that each K tile, loaded once, is scored by H · 128 rows:
// alone (H = 1) a K tile would be read from L2 for every 1024 tensor-pipe cycles of work. Two
// warpgroups; warpgroup w scores rows 64w .. 64w + 63 of every head. Tiles are [d / 64][128
// rows][64] with the 128-byte swizzle, the forward kernel's layout.
template <bool kBf16_, int kD>
struct Gate90Config {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kThreads = 256;
  static constexpr int kMaxHeads = tuning::kGateHeadsPerCta;
  static constexpr int kTileRows = 128;  // query rows of a head, keys of a K tile
  static constexpr int kHalfBytes = kTileRows * 128;
  static constexpr int kTileBytes = kD / 64 * kHalfBytes;
  static constexpr int kKSteps = kD / 16;
  static_assert(kTileRows == kBlockQ, "one query block per CTA");
  static_assert(kD == 64 || kD == 128, "d = 64 or 128");
  // H Q tiles, two K stages and H kept bitmaps of `words` words; the slack aligns the tiles to
  // the swizzle period (1024 B). d = 128, H = 4: 192 KB plus the bitmaps.
  static std::size_t smem_bytes(int heads, int words) {
    return 1024 + static_cast<std::size_t>(heads + 2) * kTileBytes + static_cast<std::size_t>(heads) * words * 4;
  }
};

// Grid: one CTA per (query block, batch, unit of H heads) in the forward kernels' order
// (geom::grid_tile with FwdParams::kv_major), the last query blocks first. The gated blocks
// (group B: the full blocks under causal, all but the last non-causal; policy.cuh) descend as
// the forward kernel visits them. Per K tile: one barrier (the tile landed for every thread, and
// both warpgroups are done with the other stage), the next tile's load, then each head's
// [64 x 128] S and its maximum. A warp keeps the block for a head iff one of its rows does; the
// CTA's bitmaps in shared memory collect the votes (atomicOr), and the rows are written after
// the last tile.
template <bool kBf16, int kD>
__global__ void __launch_bounds__(Gate90Config<kBf16, kD>::kThreads, 1)
    gate90_kernel(const __grid_constant__ GateParams gp) {
  using Cfg = Gate90Config<kBf16, kD>;
  const FwdParams& p = gp.fwd;
  const int heads = gp.heads_per_cta;
  extern __shared__ std::uint8_t smem_raw[];
  __shared__ float s_threshold[Cfg::kMaxHeads];
  __shared__ std::int64_t s_red[Cfg::kThreads / 32];

  const int tid = threadIdx.x, wg = tid / 128, warp = tid / 32, lane = tid % 32;
  GateTile tile;
  if (!tile.init(p, heads)) return;

  const std::uint32_t raw = hw::smem_u32(smem_raw);
  const std::uint32_t pad = (1024 - (raw & 1023)) & 1023;
  const std::uint32_t s_q = raw + pad;
  const std::uint32_t s_k = s_q + static_cast<std::uint32_t>(heads * Cfg::kTileBytes);
  auto* bits = reinterpret_cast<std::uint32_t*>(smem_raw + pad + (heads + 2) * Cfg::kTileBytes);  // [heads][words]

  for (int i = tid; i < heads * gp.words; i += Cfg::kThreads) bits[i] = 0u;
  if (tid < heads) s_threshold[tid] = make_gate(p, tile.geo, tile.qb, tile.h0 + tid).threshold;
  const auto* k_base = static_cast<const std::uint16_t*>(p.k) + tile.seq.k_off + tile.hk * p.k_head_stride;
  auto load_k = [&](int kb, int stage) {
    const std::int64_t key0 = tile.geo.key_begin(kb);
    sm90::load_rows_sw128<Cfg::kTileRows, kD, Cfg::kThreads>(
        s_k + static_cast<std::uint32_t>(stage * Cfg::kTileBytes), k_base + key0 * p.k_row_stride, p.k_row_stride,
        static_cast<int>(tile.geo.key_end(kb) - key0), tid);
  };
  if (tile.n_gated > 0) {
    for (int i = 0; i < heads; ++i) {
      sm90::load_rows_sw128<Cfg::kTileRows, kD, Cfg::kThreads>(
          s_q + static_cast<std::uint32_t>(i * Cfg::kTileBytes),
          static_cast<const std::uint16_t*>(p.q) + tile.seq.q_off + (tile.h0 + i) * p.q_head_stride +
              tile.row0 * p.q_row_stride,
          p.q_row_stride, tile.rows_valid, tid);
    }
    load_k(tile.n_gated - 1, 0);
  }
  ptx::cp_async_commit();

  // The thread's rows of its warpgroup's slab (the wgmma accumulator layout): r and r + 8.
  const int r = wg * 64 + (warp % 4) * 16 + lane / 4;
  const bool valid[2] = {r < tile.rows_valid, r + 8 < tile.rows_valid};
  const bool has_rows = wg * 64 < tile.rows_valid;  // the warpgroup's: uniform over its threads
  float acc[2][16][4];
  auto issue = [&](float (&s)[16][4], int head, std::uint64_t k_desc) {
    const std::uint64_t q_desc =
        hw::kmajor_desc_sw128(s_q + static_cast<std::uint32_t>(head * Cfg::kTileBytes + wg * 64 * 128));
    hw::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
      hw::wgmma_ss<kBf16>(s, q_desc + hw::kmajor_k_step<Cfg::kHalfBytes>(kk), k_desc + hw::kmajor_k_step<Cfg::kHalfBytes>(kk),
                          kk > 0);
    }
    hw::wgmma_commit();
  };
  // Head `head`'s vote on key block kb from its S (keys past s_k, zero-filled, are masked: a
  // short last block is gated only when the query block's first row sees the sequence's end).
  // Per thread the NaN-propagating maximum of each of its two rows over its 32 columns: the
  // row's keep rule over those partial maxima is the rule over the row's maximum (rounding of
  // a positive scale is monotone; a NaN keeps either way).
  auto decide = [&](float (&s)[16][4], int head, int kb, int keys) {
    if (keys < Cfg::kTileRows) {
      const int t = lane % 4;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (8 * j + 2 * t + e % 2 >= keys) s[j][e] = -INFINITY;
        }
      }
    }
    Gate gate;
    gate.exact = true;
    gate.threshold = s_threshold[head];
    bool keep = false;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float m[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        m[j] = ptx::max_nan(ptx::max_nan(s[j][2 * half], s[j][2 * half + 1]),
                            ptx::max_nan(s[j + 8][2 * half], s[j + 8][2 * half + 1]));
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) m[j] = ptx::max_nan(m[j], m[j + 4]);
      const float mx = ptx::max_nan(ptx::max_nan(m[0], m[1]), ptx::max_nan(m[2], m[3]));
      keep |= gate.keeps_row(mx, 0.f, valid[half], p.scale, p.scale_log2);
    }
    if (__any_sync(0xffffffffu, keep) && lane == 0) atomicOr(bits + head * gp.words + kb / 32, 1u << (kb % 32));
  };

  for (int t = 0; t < tile.n_gated; ++t) {
    const int kb = tile.n_gated - 1 - t, stage = t & 1;
    ptx::cp_async_wait<0>();  // K(kb) (and at t = 0 Q) landed for this thread,
    hw::fence_proxy_async();  // ordered before wgmma's reads,
    __syncthreads();          // for every thread; both warpgroups are done with the other stage
    if (t + 1 < tile.n_gated) load_k(kb - 1, stage ^ 1);
    ptx::cp_async_commit();
    // A warpgroup whose 64 rows all lie past s_q (a query block of at most 64 rows: a
    // sequence's last, or a short chunk) has no say: it loads K and meets the barriers only,
    // and the other warpgroup has the tensor pipe to itself.
    if (!has_rows) continue;
    const std::uint64_t k_desc = hw::kmajor_desc_sw128(s_k + static_cast<std::uint32_t>(stage * Cfg::kTileBytes));
    const int keys = static_cast<int>(tile.geo.key_end(kb) - tile.geo.key_begin(kb));
    // One head's wgmma in flight while the previous head's maximum is taken: head i in
    // acc[i % 2]; at the loop's head exactly head i is in flight, and each branch after it ends
    // with none (ptxas then needs no wait of its own: with a wait under a second condition it
    // injected one at the loop's back edge, C7517).
    issue(acc[0], 0, k_desc);
    int i = 0;
    for (; i + 2 < heads; i += 2) {
      issue(acc[1], i + 1, k_desc);
      hw::wgmma_wait<1>();
      hw::fence_regs(acc[0]);
      decide(acc[0], i, kb, keys);
      issue(acc[0], i + 2, k_desc);
      hw::wgmma_wait<1>();
      hw::fence_regs(acc[1]);
      decide(acc[1], i + 1, kb, keys);
    }
    if (i + 1 < heads) {
      issue(acc[1], i + 1, k_desc);
      hw::wgmma_wait<1>();
      hw::fence_regs(acc[0]);
      decide(acc[0], i, kb, keys);
      hw::wgmma_wait<0>();
      hw::fence_regs(acc[1]);
      decide(acc[1], i + 1, kb, keys);
    } else {
      hw::wgmma_wait<0>();
      hw::fence_regs(acc[0]);
      decide(acc[0], i, kb, keys);
    }
  }
  __syncthreads();  // every vote is in the bitmaps

  // Warp w writes head w's row.
  const GateRowStart start = gate_row_start(gp, tile.geo, tile.b, tile.qb, s_red);
  if (warp < heads) {
    const int h = tile.h0 + warp;
    write_gate_row(gp, tile.geo, tile.b, h, tile.qb, tile.visit, start.first + h * start.per_head, bits + warp * gp.words,
                   lane);
  }
}

// Launches the decision kernel; returns a cudaError_t value (0 = success).
template <bool kBf16, int kD>
int launch_gate(const GateParams& gp, void* stream) {
  using Cfg = Gate90Config<kBf16, kD>;
  const FwdParams& p = gp.fwd;
  if (gp.heads_per_cta < 1 || gp.heads_per_cta > Cfg::kMaxHeads || p.group % gp.heads_per_cta != 0 ||
      p.block_k != Cfg::kTileRows) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const std::size_t smem = Cfg::smem_bytes(gp.heads_per_cta, gp.words);
  auto* kernel = gate90_kernel<kBf16, kD>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(p.batch) *
                        static_cast<unsigned>(p.h_q / gp.heads_per_cta);
  if (grid == 0) return 0;
  kernel<<<grid, Cfg::kThreads, smem, static_cast<cudaStream_t>(stream)>>>(gp);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::gate90
