// SPDX-License-Identifier: Apache-2.0
// exact_gate's decisions ahead of the attention on the portable path (mma.sync; sm_80 and
// newer): the two-pass execution (plan.h, choose_gate_passes) of the Hopper decision kernel
// (sm90/gate_kernel.cuh, whose header says why no decision needs the softmax) with the portable
// forward kernel's tiles and Q·Kᵀ (warp_scores of its plain instance: the same mma.sync
// sequence, so the same fp32 S as its gated instance), for every block_k. A skipped block then
// costs its Q·Kᵀ alone, where the gated instance also paid a CTA-wide vote, the first sub-tile's
// scores stashed in shared memory and V loaded after the decision (docs/cuda.md). Included only
// by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/policy.cuh"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm80/fwd_kernel.cuh"
#include "cuda/kernel/sm80/tile.cuh"

namespace sparseprefill::cuda::gate80 {

// The plain forward instance's shapes: 4 warps of 32 query rows, 64-key sub-tiles, Q and two K
// stages in shared memory (d = 128: 64 KB), plus the CTA's kept bitmap of `words` words.
template <bool kBf16, int kD>
struct Gate80Config {
  using Fwd = sm80::FwdConfig<kBf16, kD, false, true>;
  static constexpr int kThreads = Fwd::kThreads;
  static std::size_t smem_bytes(int words) {
    return static_cast<std::size_t>(Fwd::kQBytes + 2 * Fwd::kKVBytes) + static_cast<std::size_t>(words) * 4;
  }
};

// Grid: one CTA per (query block, batch, query head) in the forward kernel's order
// (geom::grid_tile with FwdParams::kv_major): a KV group's heads on adjacent CTAs share K through
// L2, two CTAs per SM hide each other's barriers. The gated blocks (group B) descend as the
// forward kernel visits them, each as its 64-key sub-tiles through two K stages (one barrier
// per sub-tile). Each warp decides its 32 rows over the whole block (policy.cuh's rule over
// the thread's partial row maxima, as the Hopper kernel's) and the CTA's bitmap collects the
// warps' votes (atomicOr): no CTA-wide vote per block.
template <bool kBf16, int kD>
__global__ void __launch_bounds__(Gate80Config<kBf16, kD>::kThreads, 2) gate80_kernel(const __grid_constant__ GateParams gp) {
  using Cfg = Gate80Config<kBf16, kD>;
  using Fwd = typename Cfg::Fwd;
  using Tile = typename Fwd::Tile;
  constexpr int kM = Fwd::kM, kNFrags = Fwd::kNFrags, kBlockN = Fwd::kBlockN;
  const FwdParams& p = gp.fwd;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::int64_t s_red[Cfg::kThreads / 32];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  GateTile tile;
  if (!tile.init(p, 1)) return;
  const int h = tile.h0;

  const std::uint32_t s_q = ptx::smem_addr(smem);
  const std::uint32_t s_k = s_q + Fwd::kQBytes;  // 2 stages
  auto* bits = reinterpret_cast<std::uint32_t*>(smem + Fwd::kQBytes + 2 * Fwd::kKVBytes);
  for (int i = tid; i < gp.words; i += Cfg::kThreads) bits[i] = 0u;

  const sm80::KvRows k_rows = sm80::contiguous_rows(
      static_cast<const std::uint16_t*>(p.k) + tile.seq.k_off + tile.hk * p.k_head_stride, p.k_row_stride);
  // Sub-tile `sub` of key block kb into stage `stage`; its valid keys.
  auto sub_keys = [&](int kb, int sub) {
    return static_cast<int>(geom::min64(kBlockN, tile.geo.key_end(kb) - tile.geo.key_begin(kb) - sub * kBlockN));
  };
  auto load_sub = [&](int kb, int sub, int stage) {
    sm80::load_tile<Tile, kBlockN>(s_k + stage * Fwd::kKVBytes,
                                   sm80::tile_src(k_rows, tile.geo.key_begin(kb) + sub * kBlockN, sub_keys(kb, sub)), tid);
  };
  auto num_sub = [&](int kb) {
    return static_cast<int>(geom::ceil_div(tile.geo.key_end(kb) - tile.geo.key_begin(kb), kBlockN));
  };
  if (tile.n_gated > 0) {
    const sm80::TileSrc q_src{
        sm80::contiguous_rows(static_cast<const std::uint16_t*>(p.q) + tile.seq.q_off + h * p.q_head_stride, p.q_row_stride),
        tile.row0, tile.rows_valid};
    sm80::load_tile<Tile, Fwd::kBlockM>(s_q, q_src, tid);
    load_sub(tile.n_gated - 1, 0, 0);
  }
  ptx::cp_async_commit();

  const Gate gate = make_gate(p, tile.geo, tile.qb, h);
  const int g = lane / 4, t4 = lane % 4;
  const int warp_row = warp * 16 * kM;
  bool row_ok[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) row_ok[r] = warp_row + 16 * (r / 2) + g + 8 * (r % 2) < tile.rows_valid;
  // A warp whose rows all lie past s_q (a query block's last rows: a sequence's last block, or
  // a short chunk) computes no scores.
  const bool warp_has_rows = warp_row < tile.rows_valid;

  float s[kM][kNFrags][4];
  int stage = 0;
  for (int t = 0; t < tile.n_gated; ++t) {
    const int kb = tile.n_gated - 1 - t;
    const int n_sub = num_sub(kb);
    // The thread's partial row maxima over the block (NaN-propagating).
    float mx[2 * kM];
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) mx[r] = -INFINITY;
    for (int sub = 0; sub < n_sub; ++sub) {
      ptx::cp_async_wait<0>();  // this sub-tile (and at first Q) landed for this thread...
      __syncthreads();          // ...for all; every warp is done with the other stage
      if (sub + 1 < n_sub) {
        load_sub(kb, sub + 1, stage ^ 1);
      } else if (t + 1 < tile.n_gated) {
        load_sub(kb - 1, 0, stage ^ 1);
      }
      ptx::cp_async_commit();
      if (!warp_has_rows) {  // no say: it loads and meets the barriers only
        stage ^= 1;
        continue;
      }
      sm80::warp_scores<Fwd>(s_q, s_k + stage * Fwd::kKVBytes, warp_row, lane, s);
      // Keys past s_k (zero-filled) only in a short last block, gated only when the query
      // block's first row sees the sequence's end.
      const int keys = sub_keys(kb, sub);
      if (keys < kBlockN) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (nf * 8 + 2 * t4 + (e & 1) >= keys) s[mi][nf][e] = -INFINITY;
            }
          }
        }
      }
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[2 * mi + e / 2] = ptx::max_nan(mx[2 * mi + e / 2], s[mi][nf][e]);
        }
      }
      stage ^= 1;
    }
    // The row's keep rule over the thread's partial maxima is the rule over the row's maximum
    // (rounding of a positive scale is monotone; a NaN keeps either way).
    bool keep = false;
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) keep |= gate.keeps_row(mx[r], 0.f, row_ok[r], p.scale, p.scale_log2);
    if (__any_sync(0xffffffffu, keep) && lane == 0) atomicOr(bits + kb / 32, 1u << (kb % 32));
  }
  __syncthreads();  // every vote is in the bitmap
  const GateRowStart start = gate_row_start(gp, tile.geo, tile.b, tile.qb, s_red);
  if (warp == 0) write_gate_row(gp, tile.geo, tile.b, h, tile.qb, tile.visit, start.first + h * start.per_head, bits, lane);
}

// Launches the decision kernel; returns a cudaError_t value (0 = success).
template <bool kBf16, int kD>
int launch_gate(const GateParams& gp, void* stream) {
  using Cfg = Gate80Config<kBf16, kD>;
  const FwdParams& p = gp.fwd;
  if (gp.heads_per_cta != 1) return static_cast<int>(cudaErrorInvalidValue);
  const std::size_t smem = Cfg::smem_bytes(gp.words);
  auto* kernel = gate80_kernel<kBf16, kD>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(p.batch) *
                        static_cast<unsigned>(p.h_q);
  if (grid == 0) return 0;
  kernel<<<grid, Cfg::kThreads, smem, static_cast<cudaStream_t>(stream)>>>(gp);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::gate80
