// SPDX-License-Identifier: Apache-2.0
// Calibration statistics on the GPU (calibration.h, compute_block_statistics): for one layer's
// causal q/k, per (sequence, query head, query block, key block) the maximum score of the
// block (exact_gate's statistic, read for full blocks) and, in the same pass, softmax_skip's g
// of every block visited after the first in BLASST order. Scores are fp32 from mma.sync, as
// the attention kernels compute them. Portable (sm_80+). Included only by generated instance
// files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm80/tile.cuh"

namespace sparseprefill::cuda::calib {

// 4 warps; warp w owns rows w·16 .. w·16 + 15 of each 64-row half of the query block (one
// half at block_q 64, two at 128: every K fragment feeds both). Keys stream in 64-key
// sub-tiles through two shared-memory stages.
template <int kD>
struct CalibConfig {
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kHalf = kWarps * 16;  // rows per half
  static constexpr int kMaxHalves = 2;       // block_q 128
  static constexpr int kSub = 64;            // keys per sub-tile
  static constexpr int kKSteps = kD / 16;
  using Tile = sm80::SmemTile<kD, kThreads>;
  static constexpr int kQBytes = kMaxHalves * kHalf * kD * 2;
  static constexpr int kSubBytes = kSub * kD * 2;
  static constexpr int kSmemBytes = kQBytes + 2 * kSubBytes;  // d 128: 64 KB, d 64: 32 KB
};

// One CTA per (query block, batch, query head); heads fastest (a KV group's heads share K
// through L2), last query blocks first (the longest under causal). The block is visited in
// BLASST order (partial blocks, then full blocks, each descending); per block and row the
// maximum of scale·q·k over the keys the row sees (tile_rowmax), then over the rows: the block
// maximum and g = max over rows of (tile_rowmax - m_run) with the host's rules (+inf for a row
// seeing its first keys, -inf for a row seeing none of the block), then m_run updated. Thread 0
// writes block v's values after the next barrier (two smem slots by parity).
template <bool kBf16, int kD>
__global__ void __launch_bounds__(CalibConfig<kD>::kThreads) calib_kernel(const __grid_constant__ CalibParams p) {
  using Cfg = CalibConfig<kD>;
  using Tile = typename Cfg::Tile;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_red[2][2][Cfg::kWarps];  // [block parity][max, g][warp]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  int idx = static_cast<int>(blockIdx.x);
  const int h = idx % p.h_q;
  idx /= p.h_q;
  const int b = idx % p.batch;
  const int qb = p.num_q_blocks - 1 - idx / p.batch;
  const SeqInfo seq = p.seqs[b];
  const geom::BlockGeometry geo{{seq.s_q, seq.s_k, true}, p.block_q, p.block_k};
  if (qb >= geo.num_q_blocks()) return;
  const int n_vis = geo.visible_end(qb);
  if (n_vis == 0) return;  // no row sees a key: nothing to write
  const int full_end = geo.full_end(qb);
  const int n_part = n_vis - full_end;
  const std::int64_t row0 = geo.row_begin(qb);
  const int rows_valid = static_cast<int>(geo.row_end(qb) - row0);
  const int halves = p.block_q / Cfg::kHalf;
  const int hk = h / p.group;
  const std::int64_t out_row = ((static_cast<std::int64_t>(b) * p.h_q + h) * p.num_q_blocks + qb) * p.num_k_blocks;

  const std::uint32_t s_q_tile = ptx::smem_addr(smem);
  const std::uint32_t s_k_tile = s_q_tile + Cfg::kQBytes;
  const auto* k_base = static_cast<const std::uint16_t*>(p.k) + seq.k_off + hk * p.k_head_stride;
  auto block_of = [&](int v) { return v < n_part ? n_vis - 1 - v : full_end - 1 - (v - n_part); };
  auto subs_of = [&](int kb) {
    return static_cast<int>(geom::ceil_div(geo.key_end(kb) - geo.key_begin(kb), Cfg::kSub));
  };
  auto load_sub = [&](int v, int st, int stage) {
    const std::int64_t key0 = geo.key_begin(block_of(v)) + static_cast<std::int64_t>(st) * Cfg::kSub;
    const sm80::TileSrc src{sm80::contiguous_rows(k_base, p.k_row_stride), key0,
                            static_cast<int>(geom::min64(Cfg::kSub, seq.s_k - key0))};
    sm80::load_tile<Tile, Cfg::kSub>(s_k_tile + stage * Cfg::kSubBytes, src, tid);
    ptx::cp_async_commit();
  };
  // Thread 0: the statistics of visited block v from the smem slots into the outputs.
  auto flush = [&](int v) {
    const int kb = block_of(v);
    float m = s_red[v & 1][0][0], gg = s_red[v & 1][1][0];
#pragma unroll
    for (int w = 1; w < Cfg::kWarps; ++w) {
      m = ptx::max_nan(m, s_red[v & 1][0][w]);
      gg = ptx::max_nan(gg, s_red[v & 1][1][w]);
    }
    if (p.block_max != nullptr) p.block_max[out_row + kb] = m;
    if (p.skip_g != nullptr && v > 0) p.skip_g[out_row + kb] = gg;
  };

  // Q once (rows past the sequence zero-filled), then the first K sub-tile.
  {
    const sm80::TileSrc src{sm80::contiguous_rows(static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride,
                                                  p.q_row_stride),
                            row0, rows_valid};
    sm80::load_tile<Tile, Cfg::kMaxHalves * Cfg::kHalf>(s_q_tile, src, tid);
    ptx::cp_async_commit();
  }
  load_sub(0, 0, 0);
  ptx::cp_async_wait<1>();
  __syncthreads();
  std::uint32_t qf[Cfg::kMaxHalves][Cfg::kKSteps][4];
#pragma unroll
  for (int f = 0; f < Cfg::kMaxHalves; ++f) {
    if (f < halves) {
#pragma unroll
      for (int kk = 0; kk < Cfg::kKSteps; ++kk) sm80::load_a_frag<Tile>(s_q_tile, f * Cfg::kHalf + warp * 16, kk, lane, qf[f][kk]);
    }
  }

  // Per thread: rows g and g + 8 of its warp in each half. keys_seen (0 for rows past s_q).
  std::int64_t seen[Cfg::kMaxHalves][2];
  float m_run[Cfg::kMaxHalves][2];
#pragma unroll
  for (int f = 0; f < Cfg::kMaxHalves; ++f) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = f * Cfg::kHalf + warp * 16 + g + e * 8;
      seen[f][e] = f < halves && r < rows_valid ? geo.seq.keys_seen(row0 + r) : 0;
      m_run[f][e] = -INFINITY;
    }
  }

  int stage = 0;
  for (int v = 0; v < n_vis; ++v) {
    const int kb = block_of(v);
    const int subs = subs_of(kb);
    const std::int64_t k_begin = geo.key_begin(kb);
    float tile_max[Cfg::kMaxHalves][2];
#pragma unroll
    for (int f = 0; f < Cfg::kMaxHalves; ++f) tile_max[f][0] = tile_max[f][1] = -INFINITY;
    for (int st = 0; st < subs; ++st) {
      ptx::cp_async_wait<0>();
      __syncthreads();  // this stage is loaded; every warp is done with the other one
      if (st == 0 && v > 0 && tid == 0) flush(v - 1);
      if (st + 1 < subs) {
        load_sub(v, st + 1, stage ^ 1);
      } else if (v + 1 < n_vis) {
        load_sub(v + 1, 0, stage ^ 1);
      }
      const std::uint32_t k_tile = s_k_tile + stage * Cfg::kSubBytes;
      float s[Cfg::kMaxHalves][Cfg::kSub / 8][4];
#pragma unroll
      for (int f = 0; f < Cfg::kMaxHalves; ++f) {
#pragma unroll
        for (int nf = 0; nf < Cfg::kSub / 8; ++nf) s[f][nf][0] = s[f][nf][1] = s[f][nf][2] = s[f][nf][3] = 0.f;
      }
      // Key pairs outer, head-dim steps inner: each K fragment is used as soon as it is loaded
      // (ptxas -v, sm_90, d = 128: 254 registers and no spill; head-dim steps outer spilled).
#pragma unroll
      for (int np = 0; np < Cfg::kSub / 16; ++np) {
#pragma unroll
        for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
          std::uint32_t bk[4];
          sm80::load_k_frags<Tile>(k_tile, np * 16, kk, lane, bk);
#pragma unroll
          for (int f = 0; f < Cfg::kMaxHalves; ++f) {
            if (f < halves) {
              ptx::mma_16816<kBf16>(s[f][2 * np], qf[f][kk], bk[0], bk[1]);
              ptx::mma_16816<kBf16>(s[f][2 * np + 1], qf[f][kk], bk[2], bk[3]);
            }
          }
        }
      }
      // Row maxima over the keys each row sees (key index < seen - key0): scale first, as the
      // host computes scale·(q·k), then the NaN-propagating max over the quad's columns.
      const std::int64_t key0 = k_begin + static_cast<std::int64_t>(st) * Cfg::kSub;
#pragma unroll
      for (int f = 0; f < Cfg::kMaxHalves; ++f) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const std::int64_t limit = seen[f][e] - key0;
          float mx = -INFINITY;
#pragma unroll
          for (int nf = 0; nf < Cfg::kSub / 8; ++nf) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int col = nf * 8 + 2 * t4 + c;
              if (col < limit) mx = ptx::max_nan(mx, s[f][nf][2 * e + c] * p.scale);
            }
          }
          mx = ptx::max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = ptx::max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          tile_max[f][e] = ptx::max_nan(tile_max[f][e], mx);
        }
      }
      stage ^= 1;
    }
    // The block's statistics over this thread's rows, then over the warp (the quad's lanes
    // hold equal values), into the slot of v's parity.
    float bm = -INFINITY, gg = -INFINITY;
#pragma unroll
    for (int f = 0; f < Cfg::kMaxHalves; ++f) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const bool here = seen[f][e] > k_begin;
        const bool before = m_run[f][e] != -INFINITY;
        bm = ptx::max_nan(bm, tile_max[f][e]);
        const float diff = !here ? -INFINITY : (!before ? INFINITY : tile_max[f][e] - m_run[f][e]);
        gg = ptx::max_nan(gg, diff);
        if (here) m_run[f][e] = ptx::max_nan(m_run[f][e], tile_max[f][e]);
      }
    }
#pragma unroll
    for (int o = 4; o < 32; o *= 2) {
      bm = ptx::max_nan(bm, __shfl_xor_sync(0xffffffffu, bm, o));
      gg = ptx::max_nan(gg, __shfl_xor_sync(0xffffffffu, gg, o));
    }
    if (lane == 0) {
      s_red[v & 1][0][warp] = bm;
      s_red[v & 1][1][warp] = gg;
    }
  }
  __syncthreads();
  if (tid == 0) flush(n_vis - 1);
}

// Host-side launch; returns a cudaError_t value (0 = success).
template <bool kBf16, int kD>
int launch_calib(const CalibParams& p, void* stream) {
  using Cfg = CalibConfig<kD>;
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(p.batch) *
                        static_cast<unsigned>(p.h_q);
  if (grid == 0) return 0;
  auto* kernel = calib_kernel<kBf16, kD>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::calib
