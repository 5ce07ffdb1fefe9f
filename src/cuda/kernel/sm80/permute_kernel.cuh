// SPDX-License-Identifier: Apache-2.0
// permute_stop (DESIGN.md §3, our definition of S2O) on the portable path: the ranking kernels
// (segment means q̄, prefix scores q̄·k, guide vector u and query scores q·u, in fp64 as the
// CPU backend computes them) and the attention kernel over permuted query tiles (mma.sync, the
// forward kernel's warp layout), one launch per stage; src/cuda/permute_stop.cpp enqueues them
// with the two segmented sorts between (permute_sort.cuh). Included only by generated instance
// files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/launch_types.h"
#include "cuda/kernel/permute_tile.cuh"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/rank_key.h"
#include "cuda/kernel/sm80/fwd_kernel.cuh"
#include "cuda/kernel/sm80/tile.cuh"
#include "cuda/kernel/softmax.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::sm80 {

// The forward kernel's tile shape (4 warps of 32 rows, 64-key sub-tiles). Shared memory: Q
// (gathered rows; reused to stage O), K and V double-buffered (the next sub-tile's gathered rows
// load during the whole of this one's work): 96 KB at d = 128, so two CTAs share an SM. With
// the staged indices below: 93.2 -> 80.3 ms at 128K (bench record
// 2026-11-29-h200-permute-stop-staged-indices-double-v).
template <bool kBf16_, int kHeadDim_>
struct PermuteConfig : FwdConfig<kBf16_, kHeadDim_> {
  using Base = FwdConfig<kBf16_, kHeadDim_>;
  static constexpr bool kXorFragments = false;  // FwdConfig::kXorFragments: slower here
  static constexpr int kSmemBytes = Base::kQBytes + 4 * Base::kKVBytes;
  static_assert(Base::kThreads == Base::kBlockM, "one thread per query row of the tile");
};

namespace permute {

// a + b·c without fused multiply-add: the CPU backend's evaluation of its fp64 sums, so that the
// scores (and the orders built from them) agree bit for bit where the CPU does not contract.
__device__ __forceinline__ double add_product(double a, double b, double c) { return __dadd_rn(a, __dmul_rn(b, c)); }

__device__ __forceinline__ geom::SegmentGeometry segments(const SeqInfo& seq, int len) {
  return {{seq.s_q, seq.s_k, true}, len};
}

// Slot arrays before the query sort: keys 0 (the order stays) and the identity rows (-1 past
// s_q). Rows at negative positions join no segment and see no key: O = 0, LSE = -inf here.
// Grid (ceil(max_s_q / 128), h_q, batch), 128 threads.
template <class Cfg>
__global__ void __launch_bounds__(128) order_init_kernel(const __grid_constant__ PermuteParams pp) {
  const FwdParams& p = pp.fwd;
  const int h = blockIdx.y, b = blockIdx.z;
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * 128 + threadIdx.x;
  if (r >= pp.max_s_q) return;
  const SeqInfo seq = p.seqs[b];
  const std::int64_t slot = (static_cast<std::int64_t>(b) * p.h_q + h) * pp.max_s_q + r;
  pp.query_keys[0][slot] = 0;
  pp.query_rows[0][slot] = r < seq.s_q ? static_cast<std::int32_t>(r) : -1;
  if (r >= segments(seq, pp.segment).first_row()) return;
  auto* o = static_cast<std::uint16_t*>(p.o) + seq.o_off + r * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int c = 0; c < Cfg::kHeadDim / 8; ++c) reinterpret_cast<uint4*>(o)[c] = make_uint4(0, 0, 0, 0);
  if (p.lse != nullptr) p.lse[seq.lse_off + h * p.lse_head_stride + r * p.lse_row_stride] = -INFINITY;
}

// q̄ of item (b, h, slot): the mean of the segment's rows, summed in row order in fp64 (the CPU
// backend's order). Grid (max_segments, h_q, batch), one thread per head-dim element.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kHeadDim) q_mean_kernel(const __grid_constant__ PermuteParams pp) {
  const FwdParams& p = pp.fwd;
  const int slot = blockIdx.x, h = blockIdx.y, b = blockIdx.z, i = threadIdx.x;
  const SeqInfo seq = p.seqs[b];
  const geom::SegmentGeometry sg = segments(seq, pp.segment);
  if (slot >= sg.count()) return;
  const std::int64_t s = sg.first() + slot;
  const std::int64_t r0 = sg.row_begin(s), r1 = sg.row_end(s);
  const auto* q = static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride + i;
  double sum = 0.0;
  for (std::int64_t r = r0; r < r1; ++r) sum += ptx::to_float<Cfg::kBf16>(q[r * p.q_row_stride]);
  const std::int64_t item = (static_cast<std::int64_t>(b) * p.h_q + h) * pp.max_segments + slot;
  pp.q_mean[item * Cfg::kHeadDim + i] = sum / static_cast<double>(r1 - r0);
}

// Ranking keys of the prefix keys t < prefix(s): rank_key(q̄·k_t) for every segment whose
// prefix holds t and every query head of the KV group. Grid (h_kv, key tiles of 128, batch),
// one thread per key: the tile's key rows are read from global memory once into shared memory
// (as element pairs x key, so that each thread reads its own row without bank conflicts), then
// every segment s with prefix(s) > t0 (the later the segment, the longer its prefix) scores
// them against its q̄, staged 8 heads at a time. Reading each key row once per tile instead of
// once per segment: 7.0 -> 6.0 ms at 128K, 0.41 -> 0.35 ms at 32K (bench records
// 2026-11-29-h200-permute-stop-hopper-main-loop, -permute-ranking-one-read): the kernel is
// bound by its fp64 arithmetic (no fused multiply-add), not by the key reads. Two keys per
// thread, so that each q̄ element read from shared memory serves both, ran slower (6.5 /
// 0.42 ms, -permute-ranking-two-keys-per-thread).
template <class Cfg>
__global__ void __launch_bounds__(128) prefix_scores_kernel(const __grid_constant__ PermuteParams pp) {
  constexpr int kD = Cfg::kHeadDim, kHeads = tuning::kPermuteScoreHeads;
  __shared__ double s_mean[kHeads][kD];
  __shared__ std::uint32_t s_key[kD / 2][128];  // elements 2c, 2c + 1 of key t0 + i at [c][i]
  const FwdParams& p = pp.fwd;
  const int hk = blockIdx.x, b = blockIdx.z, tid = threadIdx.x;
  const SeqInfo seq = p.seqs[b];
  const geom::SegmentGeometry sg = segments(seq, pp.segment);
  const std::int64_t count = sg.count();
  if (count == 0) return;
  const std::int64_t t0 = static_cast<std::int64_t>(blockIdx.y) * 128;
  const std::int64_t longest = sg.prefix(sg.first() + count - 1);
  if (t0 >= longest) return;
  // The tile's rows (keys past the longest prefix as zeros, never scored): thread i copies
  // 16-byte chunk c of key t0 + i for every c, so a warp writes one word row of s_key.
  const KvRows k_rows = kv_rows_of(p, seq, b, hk, false);
  const std::int64_t t = t0 + tid;
  const bool in_tile = t < longest;
#pragma unroll 4
  for (int c = 0; c < kD / 8; ++c) {
    const uint4 raw = in_tile ? *reinterpret_cast<const uint4*>(k_rows.row(t) + 8 * c) : make_uint4(0, 0, 0, 0);
    s_key[4 * c + 0][tid] = raw.x;
    s_key[4 * c + 1][tid] = raw.y;
    s_key[4 * c + 2][tid] = raw.z;
    s_key[4 * c + 3][tid] = raw.w;
  }
  // The first segment whose prefix holds t0: prefix(s) = min(s · len, s_k) grows with s.
  std::int64_t slot = 0;
  while (sg.prefix(sg.first() + slot) <= t0) ++slot;
  for (; slot < count; ++slot) {
    const std::int64_t prefix = sg.prefix(sg.first() + slot);
    const bool valid = t < prefix;
    for (int h0 = hk * p.group; h0 < (hk + 1) * p.group; h0 += kHeads) {
      const int heads = min(kHeads, (hk + 1) * p.group - h0);
      __syncthreads();  // the key rows are in; the previous heads' means are no longer read
      for (int e = tid; e < heads * kD; e += 128) {
        const std::int64_t item = (static_cast<std::int64_t>(b) * p.h_q + h0 + e / kD) * pp.max_segments + slot;
        s_mean[e / kD][e % kD] = pp.q_mean[item * kD + e % kD];
      }
      __syncthreads();
      if (!valid) continue;
      double dot[kHeads];
#pragma unroll
      for (int j = 0; j < kHeads; ++j) dot[j] = 0.0;
      // Elements in order, each product added as it is formed (the CPU backend's sum).
      for (int c = 0; c < kD / 2; ++c) {
        const std::uint32_t pair = s_key[c][tid];
        const double lo = ptx::to_float<Cfg::kBf16>(static_cast<std::uint16_t>(pair & 0xffffu));
        const double hi = ptx::to_float<Cfg::kBf16>(static_cast<std::uint16_t>(pair >> 16));
#pragma unroll
        for (int j = 0; j < kHeads; ++j) {
          if (j < heads) dot[j] = add_product(add_product(dot[j], s_mean[j][2 * c], lo), s_mean[j][2 * c + 1], hi);
        }
      }
#pragma unroll
      for (int j = 0; j < kHeads; ++j) {
        if (j >= heads) continue;
        const std::int64_t item = (static_cast<std::int64_t>(b) * p.h_q + h0 + j) * pp.max_segments + slot;
        const std::int64_t at = pp.rank_offsets[item] + t;
        pp.rank_keys[0][at] = rank_key(static_cast<float>(dot[j]));
        pp.rank_index[0][at] = static_cast<std::int32_t>(t);
      }
    }
  }
}

// The guide vector u of item (b, h, slot) (the mean of the top block_k ranked prefix keys, in
// rank order) and the ranking keys rank_key(q_r·u) of the segment's rows. A segment without a
// prefix keeps keys 0: the identity order. Grid (max_segments, h_q, batch), one thread per
// head-dim element for u, then per row.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kHeadDim) guide_kernel(const __grid_constant__ PermuteParams pp) {
  constexpr int kD = Cfg::kHeadDim;
  __shared__ double s_u[kD];
  const FwdParams& p = pp.fwd;
  const int slot = blockIdx.x, h = blockIdx.y, b = blockIdx.z, i = threadIdx.x;
  const SeqInfo seq = p.seqs[b];
  const geom::SegmentGeometry sg = segments(seq, pp.segment);
  if (slot >= sg.count()) return;
  const std::int64_t s = sg.first() + slot;
  const std::int64_t prefix = sg.prefix(s);
  if (prefix == 0) return;
  const std::int64_t item = (static_cast<std::int64_t>(b) * p.h_q + h) * pp.max_segments + slot;
  const std::int32_t* ranked = pp.ranked + pp.rank_offsets[item];
  const std::int64_t top = geom::min64(pp.block_k, prefix);
  const KvRows k_rows = kv_rows_of(p, seq, b, h / p.group, false);
  double u = 0.0;
  for (std::int64_t n = 0; n < top; ++n) u += ptx::to_float<Cfg::kBf16>(k_rows.row(ranked[n])[i]);
  s_u[i] = u / static_cast<double>(top);
  __syncthreads();
  const auto* q = static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride;
  const std::int64_t slots = (static_cast<std::int64_t>(b) * p.h_q + h) * pp.max_s_q;
  // Each thread reads its own rows, 16 bytes at a time (2-byte reads of 32 different rows per
  // warp instruction kept the kernel at 2.3 ms at 128K, bound by L1 wavefronts; 0.52 ms now,
  // bench record 2026-11-29-h200-permute-ranking-one-read).
  for (std::int64_t r = sg.row_begin(s) + i; r < sg.row_end(s); r += kD) {
    const std::uint16_t* row = q + r * p.q_row_stride;
    double dot = 0.0;
    for (int c = 0; c < kD; c += 8) {
      const uint4 raw = *reinterpret_cast<const uint4*>(row + c);
      const std::uint16_t* x = reinterpret_cast<const std::uint16_t*>(&raw);
#pragma unroll
      for (int e = 0; e < 8; ++e) dot = add_product(dot, ptx::to_float<Cfg::kBf16>(x[e]), s_u[c + e]);
    }
    pp.query_keys[0][slots + r] = rank_key(static_cast<float>(dot));
  }
}

}  // namespace permute

// One CTA per query tile: kBlockQ consecutive entries of a segment's permuted order (gathered Q
// rows). Pass 1 attends to the segment's own keys in 64-key sub-tiles with the causal mask of
// each row's original position; pass 2 walks the ranked prefix keys (gathered K/V rows) in
// chunks of block_k keys and stops after a chunk whose largest row gain Δl / l' is below tau
// (one CTA-wide vote per chunk); O and LSE are scattered back to the original rows.
//
// Scheduling: the grid order of PermuteTile (longest expected work first). The hardware
// dispatches CTAs in this order as SMs free up, which is the greedy longest-first list schedule
// an atomic work counter would give, without the counter's reset per call or a persistent
// loop's extra registers in a kernel already at 255.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 2) permute_kernel(const __grid_constant__ PermuteParams pp) {
  using Tile = typename Cfg::Tile;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN;
  constexpr int kM = Cfg::kM, kNFrags = Cfg::kNFrags;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::int32_t s_rows[kBlockM];  // the tile's call-relative rows, in visit order
  __shared__ int s_last_row;                // the tile's latest row (its last visible key)
  // Ranked key indices of sub-tile u in slot u % 2, copied a sub-tile ahead of its loads so that
  // no gathered load waits on a global index read.
  __shared__ std::int32_t s_idx[2][kBlockN];
  const FwdParams& p = pp.fwd;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  PermuteTile pt;
  if (!pt.init(pp, blockIdx.x, kBlockM)) return;
  const int h = pt.h, b = pt.b, hk = pt.hk, rows_valid = pt.rows_valid;
  const SeqInfo& seq = pt.seq;
  const std::int64_t item = pt.item, offset = pt.offset;
  const int warp_row = warp * 16 * kM;

  if (tid == 0) s_last_row = -1;
  __syncthreads();
  if (tid < rows_valid) {
    const std::int32_t r = pp.query_order[pt.first + tid];
    s_rows[tid] = r;
    atomicMax(&s_last_row, r);
  }
  __syncthreads();

  // Keys. Pass 1: the segment's own keys seg_k0 .. own_end-1 (own_end: one past the latest
  // row's position; never beyond the segment's keys, since every row of it lies before them).
  // Pass 2: the ranked prefix (prefix = seg_k0 keys), 64 entries per sub-tile, block_k per chunk.
  const std::int64_t seg_k0 = pt.seg_k0;
  const std::int64_t own_end = s_last_row + offset + 1;
  const int n_own = static_cast<int>(geom::ceil_div(own_end - seg_k0, kBlockN));
  const std::int64_t prefix = seg_k0;
  const int n_rank = static_cast<int>(geom::ceil_div(prefix, kBlockN));
  const int subs_per_chunk = pp.block_k / kBlockN;
  const int n_sub = n_own + n_rank;
  const std::int32_t* ranked = pp.ranked + pp.rank_offsets[item];

  const std::uint32_t s_q_tile = ptx::smem_addr(smem);
  const std::uint32_t s_k_tile = s_q_tile + Cfg::kQBytes;       // 2 stages
  const std::uint32_t s_v_tile = s_k_tile + 2 * Cfg::kKVBytes;  // 2 stages

  // Sub-tile u of K or V into smem: own keys are consecutive rows, ranked keys gathered through
  // the indices staged in s_idx[u % 2].
  const KvRows k_rows = kv_rows_of(p, seq, b, hk, false);
  const KvRows v_rows = kv_rows_of(p, seq, b, hk, true);
  auto ranked_valid = [&](int u) {
    return static_cast<int>(geom::min64(kBlockN, prefix - static_cast<std::int64_t>(u - n_own) * kBlockN));
  };
  auto load_sub = [&](std::uint32_t dst, int u, bool value) {
    const KvRows& rows = value ? v_rows : k_rows;
    if (u < n_own) {
      const std::int64_t key0 = seg_k0 + static_cast<std::int64_t>(u) * kBlockN;
      load_tile<Tile, kBlockN>(dst, TileSrc{rows, key0, static_cast<int>(geom::min64(kBlockN, own_end - key0))}, tid);
    } else {
      load_tile_rows<Tile, kBlockN>(dst, rows, s_idx[u % 2], ranked_valid(u), tid);
    }
  };
  // The indices of ranked sub-tile u into s_idx[u % 2] (not committed; nothing for own keys).
  auto stage_idx = [&](int u) {
    if (u < n_own || u >= n_sub || tid >= ranked_valid(u)) return;
    ptx::cp_async_4(ptx::smem_addr(&s_idx[u % 2][tid]), ranked + static_cast<std::int64_t>(u - n_own) * kBlockN + tid);
  };

  // Rows this thread holds: r = 2·mi + i is tile row warp_row + 16·mi + g + 8·i. Padding rows of
  // a short last tile (zero Q) take part in the arithmetic but never vote or get stored.
  auto row_of = [&](int r) { return warp_row + 16 * (r / 2) + g + 8 * (r % 2); };
  auto row_ok = [&](int r) { return row_of(r) < rows_valid; };
  // Per row: its position relative to the segment's first key (-1: a padding row, sees nothing
  // in pass 1).
  int rel_pos[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) rel_pos[r] = row_ok(r) ? static_cast<int>(s_rows[row_of(r)] + offset - seg_k0) : -1;

  // ---- prologue: the gathered Q rows, the first K and V sub-tiles and the next sub-tile's
  // indices in one group.
  load_tile_rows<Tile, kBlockM>(
      s_q_tile, contiguous_rows(static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride, p.q_row_stride),
      s_rows, rows_valid, tid);
  load_sub(s_k_tile, 0, false);  // n_own >= 1: every row sees the segment's first key
  load_sub(s_v_tile, 0, true);
  stage_idx(1);
  ptx::cp_async_commit();

  float acc[kM][Cfg::kDFrags][4];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int df = 0; df < Cfg::kDFrags; ++df) acc[mi][df][0] = acc[mi][df][1] = acc[mi][df][2] = acc[mi][df][3] = 0.f;
  }
  RowStats<kM> st;
  init_row_stats(st);
  float dl[2 * kM];  // this thread's part of Δl over the current chunk, relative to the running max
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) dl[r] = 0.f;
  float sc[kM][kNFrags][4];
  int visited = 0;

  // ---- main loop over sub-tiles, FlashAttention-2 order (as the forward kernel's ungated
  // blocks). Invariant at the top: the only cp.async group in flight holds K(u) and V(u) in
  // `stage` and the indices of sub-tile u + 1.
  int stage = 0;
  for (int u = 0; u < n_sub; ++u) {
    const bool ranked_sub = u >= n_own;
    ptx::cp_async_wait<0>();  // K(u), V(u) and the indices of u + 1 have landed for this thread...
    __syncthreads();          // ...for all; every warp is done with sub-tile u - 1 and its stage
    // K(u + 1) and V(u + 1) into the other stage, also across a chunk boundary before the stop
    // decision (a stop wastes one sub-tile's loads); the indices of u + 2 into the slot of u,
    // whose loads every thread issued before the barrier above.
    if (u + 1 < n_sub) {
      load_sub(s_k_tile + (stage ^ 1) * Cfg::kKVBytes, u + 1, false);
      load_sub(s_v_tile + (stage ^ 1) * Cfg::kKVBytes, u + 1, true);
    }
    stage_idx(u + 2);
    ptx::cp_async_commit();  // group K(u + 1), V(u + 1), indices of u + 2
    warp_scores<Cfg>(s_q_tile, s_k_tile + stage * Cfg::kKVBytes, warp_row, lane, sc);
    // Masks: pass 1 the causal limit of each row's position; pass 2 only the short last sub-tile
    // (every prefix key is visible to every row of the segment).
    const int limit_base = ranked_sub ? -1 : u * kBlockN;
    const int rank_valid = ranked_sub ? static_cast<int>(geom::min64(kBlockN, prefix - static_cast<std::int64_t>(u - n_own) * kBlockN))
                                      : kBlockN;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
      for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nf * 8 + 2 * t4 + (e & 1);
          const bool hidden = ranked_sub ? col >= rank_valid : limit_base + col > rel_pos[2 * mi + e / 2];
          if (hidden) sc[mi][nf][e] = -INFINITY;
        }
      }
    }
    float mx[2 * kM], m_use[2 * kM], m_old[2 * kM], part[2 * kM];
    row_max(sc, mx);
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) {
      m_old[r] = st.m[r];
      part[r] = 0.f;
    }
    rescale(st, mx, p.scale_log2, acc, m_use);
    std::uint32_t pf[kM][Cfg::kPSteps][4];
    exp_pack<Cfg::kBf16>(sc, m_use, p.scale_log2, part, pf);
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) {
      st.l[r] += part[r];
      // Δl follows the running max like l (the same factor rescale applied).
      if (ranked_sub) dl[r] = dl[r] * ptx::exp2f_fast(m_old[r] - m_use[r]) + part[r];
    }
    warp_pv<Cfg>(s_v_tile + stage * Cfg::kKVBytes, lane, pf, acc);
    stage ^= 1;

    if (!ranked_sub) continue;
    const int v = u - n_own;
    if ((v + 1) % subs_per_chunk != 0 && v + 1 != n_rank) continue;
    // End of a chunk: it is kept; another follows iff some valid row has gain Δl / l' >= tau
    // (a NaN gain continues, as in the oracle).
    ++visited;
    bool more = false;
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) {
      float l = st.l[r], d = dl[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      more |= row_ok(r) && !(d / l < pp.tau);
      dl[r] = 0.f;
    }
    if (__syncthreads_or(more) == 0) break;
  }
  ptx::cp_async_wait<0>();  // a sub-tile prefetched past the stop

  // ---- epilogue: O = acc / l through smem (the Q tile; each warp reads and writes only its own
  // rows of it) as 16-byte row stores to the original rows; LSE by the first thread of a quad.
  float o_scale[2 * kM], lse[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    finalize_row(st.m[r], st.l[r], &o_scale[r], &lse[r]);
  }
  __syncwarp();  // the warp's last Q fragment reads are done before its rows are overwritten
  auto* s_o = reinterpret_cast<std::uint32_t*>(smem);
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int df = 0; df < Cfg::kDFrags; ++df) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = warp_row + 16 * mi + g + 8 * i;
        const std::uint32_t byte = swizzle<Tile>(r, df) + t4 * 4;
        const float f = o_scale[2 * mi + i];
        s_o[byte / 4] = ptx::pack2<Cfg::kBf16>(acc[mi][df][2 * i] * f, acc[mi][df][2 * i + 1] * f);
      }
    }
  }
  __syncwarp();  // each warp stores only the rows it wrote
  auto* o_head = static_cast<std::uint16_t*>(p.o) + seq.o_off + h * p.o_head_stride;
  // The rows' data chunks only: at d = 96 the pitch's 4 padding chunks would land on the next
  // head's output.
  static_assert(16 * kM * Tile::kDataChunks % 32 == 0, "whole rounds of the warp's chunk stores");
#pragma unroll
  for (int i = 0; i < 16 * kM * Tile::kDataChunks / 32; ++i) {
    const int idx = lane + 32 * i;
    const int r = warp_row + idx / Tile::kDataChunks, c = idx % Tile::kDataChunks;
    if (r < rows_valid) {
      const uint4 val = *reinterpret_cast<const uint4*>(smem + swizzle<Tile>(r, c));
      *reinterpret_cast<uint4*>(o_head + s_rows[r] * p.o_row_stride + c * 8) = val;
    }
  }
  if (p.lse != nullptr && t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) {
      if (row_ok(r)) p.lse[seq.lse_off + h * p.lse_head_stride + s_rows[row_of(r)] * p.lse_row_stride] = lse[r];
    }
  }
  if (pp.visited != nullptr && tid == 0) pp.visited[item * pp.tiles_per_segment + pt.tile] = visited;
}

// One launch of permute_stop's portable sequence (PermuteStage, launch_types.h; the host runs
// the sorts between them and sets pp.ranked / pp.query_order to the sorted buffers first):
//   kOrderInit     [ceil(max_s_q / 128), h_q, batch] x 128: the slot order's initial state
//   kQueryMeans    [max_segments, h_q, batch] x d: each item's mean query q̄
//   kPrefixScores  [h_kv, key tiles of 128 over the longest prefix, batch] x 128: rank keys
//   kGuide         [max_segments, h_q, batch] x d: the query order's guide keys
//   kAttend        one CTA per (segment slot, tile, batch, query head): the attention
// Returns a cudaError_t value (0 = success; an empty grid enqueues nothing).
template <class Cfg>
int launch_permute_stage(PermuteStage stage, const PermuteParams& pp, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  const FwdParams& p = pp.fwd;
  const dim3 items(static_cast<unsigned>(pp.max_segments), static_cast<unsigned>(p.h_q), static_cast<unsigned>(p.batch));
  const int max_key_tiles = static_cast<int>((static_cast<std::int64_t>(pp.max_prefix) + 127) / 128);
  switch (stage) {
    case PermuteStage::kOrderInit:
      if (p.batch == 0 || pp.max_s_q == 0) return 0;
      permute::order_init_kernel<Cfg><<<dim3(static_cast<unsigned>((pp.max_s_q + 127) / 128), static_cast<unsigned>(p.h_q),
                                             static_cast<unsigned>(p.batch)),
                                        128, 0, st>>>(pp);
      break;
    case PermuteStage::kQueryMeans:
      if (items.x * items.y * items.z == 0) return 0;
      permute::q_mean_kernel<Cfg><<<items, Cfg::kHeadDim, 0, st>>>(pp);
      break;
    case PermuteStage::kPrefixScores:
      if (max_key_tiles == 0 || p.batch == 0) return 0;
      permute::prefix_scores_kernel<Cfg><<<dim3(static_cast<unsigned>(p.h_kv), static_cast<unsigned>(max_key_tiles),
                                                static_cast<unsigned>(p.batch)),
                                           128, 0, st>>>(pp);
      break;
    case PermuteStage::kGuide:
      if (items.x * items.y * items.z == 0) return 0;
      permute::guide_kernel<Cfg><<<items, Cfg::kHeadDim, 0, st>>>(pp);
      break;
    case PermuteStage::kAttend: {
      const unsigned grid = static_cast<unsigned>(pp.max_segments) * static_cast<unsigned>(pp.tiles_per_segment) *
                            static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.h_q);
      if (grid == 0) return 0;
      auto* kernel = permute_kernel<Cfg>;
      const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
      if (err != cudaSuccess) return static_cast<int>(err);
      kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, st>>>(pp);
      break;
    }
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm80
