// SPDX-License-Identifier: Apache-2.0
// permute_stop's attention on the Hopper main loop (sm_90a): the permuted query tiles of
// sm80/permute_kernel.cuh (pass 1 over the segment's own keys, pass 2 over the ranked prefix
// keys in 128-key chunks with the early stop under tau) run on the forward kernel's warp
// specialisation: a producer warpgroup gathers Q, K and V rows with cp.async into the layout
// TMA writes (TMA cannot gather on sm_90), two consumer warpgroups issue wgmma in ping-pong.
// The ranking (segment means, prefix scores, sorts, guide) is the portable sequence, which
// calls launch_permute_attend in place of its own attention kernel. Contiguous K/V and
// 128-key chunks (choose_fwd_path). Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/permute_tile.cuh"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm90/fwd_kernel.cuh"
#include "cuda/kernel/sm90/hopper.cuh"
#include "cuda/kernel/softmax.cuh"

namespace sparseprefill::cuda::sm90 {

// The forward kernel's shape (one 128-row query tile per CTA, 128-key tiles, 2 stages) with the
// register split of its gathering (paged) instances: the producer warpgroup copies every row.
template <bool kBf16_, int kHeadDim_>
struct PermuteConfig : FwdConfig<kBf16_, kHeadDim_, true> {};

template <class Cfg>
struct alignas(1024) PermuteSmem {
  // Tiles in the forward kernel's layout ([d-half][row][64], 128B swizzle), 1024-byte aligned.
  std::uint8_t q[Cfg::kTileBytes];
  std::uint8_t k[Cfg::kStages][Cfg::kTileBytes];
  std::uint8_t v[Cfg::kStages][Cfg::kTileBytes];
  // mbarriers as in the forward kernel; every loaded barrier takes the 128 producer threads'
  // cp.async arrivals.
  std::uint64_t q_loaded;
  std::uint64_t k_loaded[Cfg::kStages];
  std::uint64_t v_loaded[Cfg::kStages];
  std::uint64_t k_free[Cfg::kStages];
  std::uint64_t v_free[Cfg::kStages];
  // Stop votes: after ranked tile v (not the last), each consumer warp writes whether one of
  // its valid rows still gains at least tau to its byte of votes[v % kVoteSlots] and arrives on
  // decided[v % kVoteSlots] (8 arrivals). Readers: the consumers in the next round, the producer
  // before it loads ranked tile v + 2; a slot is rewritten 4 ranked tiles later, when both
  // have read it.
  std::uint64_t decided[Cfg::kVoteSlots];
  alignas(8) std::uint8_t votes[Cfg::kVoteSlots][8];
  std::int32_t rows[Cfg::kTileM];  // the tile's call-relative query rows, in visit order
  int last_row;                    // the tile's latest row (its last visible own key)
};

namespace permute90 {

// Copies the [128][d] tile whose row j is source row index_j of `base` (a row every
// row_stride elements; index -1: zero-filled, nothing read) into `dst` in the layout TMA
// writes: 16-byte chunk c of row r at chunk c ^ (r % 8) of its 128-byte row, d-halves one box
// apart. Thread t copies chunk c = t % kChunks of rows r0 + kRowStep·i (i < kChunks), so a warp
// reads whole rows and all rows of a thread share one swizzle (kRowStep is a multiple of 8);
// thread t looked up row t / kChunks + kRowStep·(t % kChunks) (`mine`), and the kChunks
// threads of a row group pass their indices round by shuffles, as gather_tile does with its
// page lookups.
template <class Cfg>
__device__ __forceinline__ void gather_rows(const std::uint16_t* base, std::int64_t row_stride, int mine,
                                            std::uint32_t dst) {
  constexpr int kChunks = Cfg::kHeadDim / 8;
  constexpr int kRowStep = 128 / kChunks;
  static_assert(Cfg::kTileN / kRowStep == kChunks, "each thread's rows are looked up by its row group");
  static_assert(kRowStep % 8 == 0, "the rows of a thread share their swizzle");
  const int t = threadIdx.x % 128, c = t % kChunks, r0 = t / kChunks;
  const int lane_base = (t % 32) - c;
  const std::uint16_t* chunk = base + 8 * c;
  const std::uint32_t to = dst + static_cast<std::uint32_t>((c / 8) * Cfg::kHalfBytes + r0 * Cfg::kRowBytes +
                                                            (((c % 8) ^ (r0 & 7)) << 4));
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int index = __shfl_sync(0xffffffffu, mine, lane_base + i);
    ptx::cp_async_16_or_zero(to + static_cast<std::uint32_t>(i * kRowStep * Cfg::kRowBytes),
                             chunk + static_cast<std::int64_t>(index < 0 ? 0 : index) * row_stride, index >= 0);
  }
}

// softmax_tile (fwd_kernel.cuh) that also returns the tile's own row sums `part` (before they
// join l): the gain Δl of a ranked chunk. l = l·alpha + part.
__device__ __forceinline__ void softmax_tile_part(float (&s)[1][16][4], const float (&mx)[2], RowStats<1>& st,
                                                  float scale_log2, float (&alpha)[2], float (&part)[2]) {
  float m_use[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    move_row(st.m[r], mx[r], scale_log2, m_use[r], alpha[r]);
    part[r] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[0][j][e] = ptx::exp2f_fast(fmaf(s[0][j][e], scale_log2, -m_use[e / 2]));
      part[e / 2] += s[0][j][e];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * alpha[r] + part[r];
}

}  // namespace permute90

// One CTA per permuted query tile, in PermuteTile's grid order (the longest expected work first).
// Positions: n_own tiles of the segment's own keys (consecutive rows, each row masked at its
// original position), then the ranked prefix in tiles of 128 (one chunk each), the last one
// short. The stop decision of ranked tile v (CTA-wide: does some valid row still gain tau?) is
// voted after its softmax and read one round later, after the next tile's Q·Kᵀ has been issued,
// so the vote costs the ping-pong no wait; the producer reads it before loading ranked tile
// v + 2. A stop after tile v therefore wastes the loads of tile v + 1 and its Q·Kᵀ, never more.
template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) permute_attend_kernel(const __grid_constant__ PermuteParams pp) {
  using S = PermuteSmem<Cfg>;
  constexpr int kTileN = Cfg::kTileN, kRowBytes = Cfg::kRowBytes;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = hw::smem_u32(smem_raw);
  S& sm = *reinterpret_cast<S*>(smem_raw + ((1024 - (raw & 1023)) & 1023));
  const FwdParams& p = pp.fwd;

  PermuteTile pt;
  if (!pt.init(pp, blockIdx.x, Cfg::kTileM)) return;
  const int h = pt.h, hk = pt.hk, rows_valid = pt.rows_valid;
  const SeqInfo& seq = pt.seq;
  const std::int64_t offset = pt.offset;
  const int warpgroup = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    sm.last_row = -1;
    hw::mbar_init(hw::smem_u32(&sm.q_loaded), 128);
#pragma unroll
    for (int st = 0; st < Cfg::kStages; ++st) {
      hw::mbar_init(hw::smem_u32(&sm.k_loaded[st]), 128);
      hw::mbar_init(hw::smem_u32(&sm.v_loaded[st]), 128);
      hw::mbar_init(hw::smem_u32(&sm.k_free[st]), 4 * Cfg::kConsumers);
      hw::mbar_init(hw::smem_u32(&sm.v_free[st]), 4 * Cfg::kConsumers);
    }
#pragma unroll
    for (int v = 0; v < Cfg::kVoteSlots; ++v) hw::mbar_init(hw::smem_u32(&sm.decided[v]), 4 * Cfg::kConsumers);
    hw::fence_mbar_init();
  }
  __syncthreads();
  if (threadIdx.x < rows_valid) {
    const std::int32_t r = pp.query_order[pt.first + threadIdx.x];
    sm.rows[threadIdx.x] = r;
    atomicMax(&sm.last_row, r);
  }
  __syncthreads();

  // Pass 1: own keys seg_k0 .. own_end - 1 (one past the latest row's position: never beyond the
  // segment's keys); pass 2: the ranked prefix keys t < seg_k0, best first.
  const std::int64_t seg_k0 = pt.seg_k0;
  const std::int64_t own_end = sm.last_row + offset + 1;
  const int n_own = static_cast<int>(geom::ceil_div(own_end - seg_k0, kTileN));
  const std::int64_t prefix = seg_k0;
  const int n_rank = static_cast<int>(geom::ceil_div(prefix, kTileN));
  const int n_sub = n_own + n_rank;
  const std::int32_t* ranked = pp.ranked + pp.rank_offsets[pt.item];

  // The stop decision after ranked tile v, as every thread reads it (all 8 consumer warps voted).
  auto decision = [&](int v) -> bool {
    hw::mbar_wait(hw::smem_u32(&sm.decided[v % Cfg::kVoteSlots]), (v / Cfg::kVoteSlots) & 1);
    return *reinterpret_cast<volatile std::uint64_t*>(sm.votes[v % Cfg::kVoteSlots]) != 0u;
  };

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    hw::setmaxnreg_dec<Cfg::kProducerRegs>();
    constexpr int kChunks = Cfg::kHeadDim / 8;
    const int t = threadIdx.x;
    const int look = t / kChunks + (128 / kChunks) * (t % kChunks);  // the tile row this thread looks up
    const auto* q_head = static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride;
    const auto* k_head = static_cast<const std::uint16_t*>(p.k) + seq.k_off + hk * p.k_head_stride;
    const auto* v_head = static_cast<const std::uint16_t*>(p.v) + seq.v_off + hk * p.v_head_stride;
    permute90::gather_rows<Cfg>(q_head, p.q_row_stride, look < rows_valid ? sm.rows[look] : -1, hw::smem_u32(sm.q));
    hw::cp_async_mbar_arrive(hw::smem_u32(&sm.q_loaded));
    // Key index of this thread's lookup row of position it (-1: none), read one position ahead.
    auto lookup = [&](int it) -> int {
      if (it < n_own) {
        const std::int64_t key = seg_k0 + static_cast<std::int64_t>(it) * kTileN + look;
        return key < own_end ? static_cast<int>(key) : -1;
      }
      const std::int64_t n = static_cast<std::int64_t>(it - n_own) * kTileN + look;
      return n < prefix ? ranked[n] : -1;
    };
    int next = lookup(0);  // n_sub >= 1: every row sees its segment's first key
    for (int it = 0; it < n_sub; ++it) {
      const int st = it % Cfg::kStages;
      const int index = next;
      if (it + 1 < n_sub) next = lookup(it + 1);
      const int v = it - n_own;
      if (v >= 2 && !decision(v - 2)) break;
      hw::mbar_wait(hw::smem_u32(&sm.k_free[st]), ((it / Cfg::kStages) & 1) ^ 1);
      permute90::gather_rows<Cfg>(k_head, p.k_row_stride, index, hw::smem_u32(sm.k[st]));
      hw::cp_async_mbar_arrive(hw::smem_u32(&sm.k_loaded[st]));
      hw::mbar_wait(hw::smem_u32(&sm.v_free[st]), ((it / Cfg::kStages) & 1) ^ 1);
      permute90::gather_rows<Cfg>(v_head, p.v_row_stride, index, hw::smem_u32(sm.v[st]));
      hw::cp_async_mbar_arrive(hw::smem_u32(&sm.v_loaded[st]));
    }
    ptx::cp_async_wait<0>();  // a tile loaded past the stop lands before the CTA exits
    return;
  }

  // ------------------------------------------------------------------ consumers
  hw::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int wg = warpgroup - 1;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int r0 = wg * 64 + warp * 16 + lane / 4;  // the thread's first tile row; also r0 + 8
  bool row_ok[2];
  int rel_pos[2];  // the row's position relative to seg_k0 (-1: a padding row, sees no own key)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_ok[r] = r0 + 8 * r < rows_valid;
    rel_pos[r] = row_ok[r] ? static_cast<int>(sm.rows[r0 + 8 * r] + offset - seg_k0) : -1;
  }

  float s[1][16][4];
  float o[Cfg::kDFrags][4];
  std::uint32_t pf[Cfg::kPvSteps][4];
  RowStats<1> stats;
  init_row_stats(stats);
  zero_acc(o);
  const std::uint64_t q_desc = kmajor_desc<Cfg>(hw::smem_u32(sm.q) + wg * 64 * kRowBytes);
  auto issue_qk = [&](int st) { wgmma_qk<Cfg>(s, q_desc, kmajor_desc<Cfg>(hw::smem_u32(sm.k[st]))); };
  auto issue_pv = [&](int st) { wgmma_pv<Cfg>(o, pf, v_desc<Cfg>(hw::smem_u32(sm.v[st]))); };
  auto release = [&](std::uint64_t& bar) {
    if (lane == 0) hw::mbar_arrive(hw::smem_u32(&bar));
  };

  const int my_turn = 1 + wg, other_turn = 2 - wg;
  int visited = 0;
  bool stopped = false;
  if (wg == 1) hw::named_arrive(1);  // warpgroup 0 issues first
  hw::mbar_wait(hw::smem_u32(&sm.q_loaded), 0);
  hw::fence_proxy_async();  // cp.async wrote Q: the wgmma reads it
  // Tile it - 1's P waits in pf for its P·V, issued in round it with S(it) (every visited tile
  // is kept); alpha rescaled O for it at the end of round it - 1.
  for (int it = 0; it < n_sub; ++it) {
    const int st = it % Cfg::kStages, prev = (it + Cfg::kStages - 1) % Cfg::kStages;
    hw::mbar_wait(hw::smem_u32(&sm.k_loaded[st]), (it / Cfg::kStages) & 1);
    hw::fence_proxy_async();
    hw::named_sync(my_turn);
    issue_qk(st);
    if (it > 0) {
      hw::mbar_wait(hw::smem_u32(&sm.v_loaded[prev]), ((it - 1) / Cfg::kStages) & 1);
      hw::fence_proxy_async();
      issue_pv(prev);
    } else {
      hw::wgmma_fence();
      hw::wgmma_commit();  // an empty group: the waits below count the same groups either way
    }
    if (wg == 0 || it + 1 < n_sub) hw::named_arrive(other_turn);
    hw::wgmma_wait<1>();  // S(it) done; P(it - 1)·V may still run
    hw::fence_regs(s[0]);
    release(sm.k_free[st]);
    const int v = it - n_own;
    if (v >= 1 && !decision(v - 1)) {
      // Stopped after ranked tile v - 1: its P·V (issued above) is the last; S(it) is dropped.
      hw::wgmma_wait<0>();
      hw::fence_regs(o);
      // Warpgroup 1 arrived for a round warpgroup 0 will not run: consumed here, so that the
      // named barriers end balanced.
      if (wg == 0 && it + 1 < n_sub) hw::named_sync(my_turn);
      stopped = true;
      break;
    }
    int limit[2];
    if (v < 0) {  // own keys: each row up to its position
#pragma unroll
      for (int r = 0; r < 2; ++r) limit[r] = min(max(rel_pos[r] - it * kTileN, -1), kTileN);
      mask_tile(s, limit);
    } else if (v + 1 == n_rank && prefix % kTileN != 0) {  // the short last ranked tile
      limit[0] = limit[1] = static_cast<int>(prefix % kTileN) - 1;
      mask_tile(s, limit);
    }
    float mx[2], alpha[2], part[2];
    row_max_tile(s, mx);
    permute90::softmax_tile_part(s, mx, stats, p.scale_log2, alpha, part);
    hw::wgmma_wait<0>();  // P(it - 1)·V done: its P registers and V stage are free
    hw::fence_regs(o);
    scale_acc(o, alpha);
    if (it > 0) release(sm.v_free[prev]);
    pack_p<Cfg>(s, pf);
    if (v < 0) continue;
    ++visited;
    if (v + 1 == n_rank) continue;  // no chunk follows: nothing to decide
    // End of a chunk (one tile: its gain Δl is `part`, at the running max like l): another
    // follows iff some valid row has gain Δl / l' >= tau (a NaN gain continues, as in the oracle).
    bool more = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float l = stats.l[r], d = part[r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      d += __shfl_xor_sync(0xffffffffu, d, 1);
      d += __shfl_xor_sync(0xffffffffu, d, 2);
      more |= row_ok[r] && !(d / l < pp.tau);
    }
    more = __any_sync(0xffffffffu, more);
    if (lane == 0) {
      sm.votes[v % Cfg::kVoteSlots][wg * 4 + warp] = more ? 1 : 0;
      hw::mbar_arrive(hw::smem_u32(&sm.decided[v % Cfg::kVoteSlots]));  // release: orders the vote byte
    }
  }
  // The last tile's P·V, unless the loop stopped (which completed the P·V it issued).
  if (!stopped) {
    const int last = (n_sub - 1) % Cfg::kStages;
    hw::mbar_wait(hw::smem_u32(&sm.v_loaded[last]), ((n_sub - 1) / Cfg::kStages) & 1);
    hw::fence_proxy_async();
    issue_pv(last);
    hw::wgmma_wait<0>();
    hw::fence_regs(o);
  }

  // ---------------------------------------------------------------- epilogue: O and LSE
  // Rows scattered back to their original positions; padding rows are not stored.
  auto* o_head = static_cast<std::uint16_t*>(p.o) + seq.o_off + h * p.o_head_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float o_scale, lse;
    finalize_row(stats.m[r], stats.l[r], &o_scale, &lse);
    if (!row_ok[r]) continue;
    const std::int64_t row = sm.rows[r0 + 8 * r];
    std::uint16_t* o_row = o_head + row * p.o_row_stride;
#pragma unroll
    for (int j = 0; j < Cfg::kDFrags; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<std::uint32_t*>(o_row + col) = ptx::pack2<Cfg::kBf16>(o[j][2 * r] * o_scale, o[j][2 * r + 1] * o_scale);
    }
    if (p.lse != nullptr && lane % 4 == 0) p.lse[seq.lse_off + h * p.lse_head_stride + row * p.lse_row_stride] = lse;
  }
  if (pp.visited != nullptr && threadIdx.x == 128) pp.visited[pt.item * pp.tiles_per_segment + pt.tile] = visited;
}

// Host-side launch of the attention kernel once the portable sequence has ranked and sorted
// (pp.ranked and pp.query_order set). Returns a cudaError_t value (0 = success);
// cudaErrorNotSupported, having enqueued nothing, for chunks other than 128 keys or paged K/V
// (choose_fwd_path sends those to the portable kernel, which also runs if one arrives here).
template <class Cfg>
int launch_permute_attend(const PermuteParams& pp, void* stream) {
  const FwdParams& p = pp.fwd;
  if (pp.block_k != Cfg::kTileN || p.paged.block_table != nullptr) return static_cast<int>(cudaErrorNotSupported);
  const unsigned grid = static_cast<unsigned>(pp.max_segments) * static_cast<unsigned>(pp.tiles_per_segment) *
                        static_cast<unsigned>(p.batch) * static_cast<unsigned>(p.h_q);
  if (grid == 0) return 0;
  auto* kernel = permute_attend_kernel<Cfg>;
  const int smem = static_cast<int>(sizeof(PermuteSmem<Cfg>)) + 1024;  // + alignment slack
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<grid, Cfg::kThreads, smem, static_cast<cudaStream_t>(stream)>>>(pp);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm90
