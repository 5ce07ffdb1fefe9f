// SPDX-License-Identifier: Apache-2.0
// estimate_select on the GPU (DESIGN.md §3, FlashPrefill V2): the pooled block means k̄/v̄
// and a straightforward selector that scores every query tile against the means with
// mma.sync and writes a device BlockMask (plus the mean-correction bitmap). Portable (sm_80+).
// Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm80/tile.cuh"

namespace sparseprefill::cuda::select {

// Element i of block j, KV head hk, sequence b of a cache of block means.
__device__ __forceinline__ std::uint16_t* cache_at(const MeanCache& c, int b, int hk, int j, int i) {
  return static_cast<std::uint16_t*>(c.data) + b * c.batch_stride + hk * c.head_stride + j * c.block_stride + i;
}

// k̄_j and v̄_j of one (block j, kv head, sequence): the mean of the block's valid keys,
// accumulated in double, rounded to fp32 and then to the input dtype, exactly as the oracle
// stores them. One thread per head-dim element (coalesced rows). Grid (num_k_blocks, h_kv, b).
// Chunked prefill: blocks j < cached are copied from the cache; the blocks this call completes
// (cached <= j < s_k / B) are written to it. Every thread reads and writes only its own
// element (b, hk, j, i) of the cache and of the means, so no synchronisation is needed; the
// selector reads the means after this kernel on the same stream.
template <bool kBf16, int kD>
__global__ void __launch_bounds__(kD) block_means_kernel(const __grid_constant__ SelectParams p) {
  const int j = blockIdx.x, hk = blockIdx.y, b = blockIdx.z, i = threadIdx.x;
  const SeqInfo seq = p.seqs[b];
  const std::int64_t key0 = static_cast<std::int64_t>(j) * p.block;
  const std::int64_t out = ((static_cast<std::int64_t>(b) * p.h_kv + hk) * p.num_k_blocks + j) * kD + i;
  if (key0 >= seq.s_k) {
    // Past this sequence's last block: masked out wherever it is read (the Hopper kernel loads
    // whole 128-block tiles of means), but its P·V term is 0 · v̄ only if v̄ is finite.
    static_cast<std::uint16_t*>(p.k_mean)[out] = 0;
    static_cast<std::uint16_t*>(p.v_mean)[out] = 0;
    return;
  }
  const std::int64_t cached = p.select_seqs != nullptr ? p.select_seqs[b].cached : 0;
  if (j < cached) {  // cached <= s_k / B (validated on the host): a complete block
    static_cast<std::uint16_t*>(p.k_mean)[out] = *cache_at(p.cache_k, b, hk, j, i);
    static_cast<std::uint16_t*>(p.v_mean)[out] = *cache_at(p.cache_v, b, hk, j, i);
    return;
  }
  const std::int64_t len = geom::min64(p.block, seq.s_k - key0);
  // The keys' rows through the forward kernel's addressor (contiguous or paged).
  const auto* k = static_cast<const std::uint16_t*>(p.k) + seq.k_off + hk * p.k_head_stride;
  const auto* v = static_cast<const std::uint16_t*>(p.v) + seq.v_off + hk * p.v_head_stride;
  const std::int32_t* pages = p.paged.block_table == nullptr ? nullptr : p.paged.block_table + b * p.paged.table_stride;
  const sm80::KvRows k_rows{k, p.k_row_stride, pages, p.paged.page_size, p.paged.k_page_stride};
  const sm80::KvRows v_rows{v, p.v_row_stride, pages, p.paged.page_size, p.paged.v_page_stride};
  // Summed in key order (the oracle's), 8 keys' loads issued before their adds: each thread
  // reads one element per key, so the loads, not the adds, are the latency.
  constexpr int kBatch = 8;
  double k_sum = 0.0, v_sum = 0.0;
  for (std::int64_t t0 = key0; t0 < key0 + len; t0 += kBatch) {
    std::uint16_t k_raw[kBatch], v_raw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      const bool ok = t0 + u < key0 + len;
      k_raw[u] = ok ? k_rows.row(t0 + u)[i] : 0;
      v_raw[u] = ok ? v_rows.row(t0 + u)[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (t0 + u >= key0 + len) break;
      k_sum += ptx::to_float<kBf16>(k_raw[u]);
      v_sum += ptx::to_float<kBf16>(v_raw[u]);
    }
  }
  const std::uint16_t k_bar = ptx::from_float<kBf16>(static_cast<float>(k_sum / static_cast<double>(len)));
  const std::uint16_t v_bar = ptx::from_float<kBf16>(static_cast<float>(v_sum / static_cast<double>(len)));
  static_cast<std::uint16_t*>(p.k_mean)[out] = k_bar;
  static_cast<std::uint16_t*>(p.v_mean)[out] = v_bar;
  if (p.cache_k.data != nullptr && j < seq.s_k / p.block) {
    *cache_at(p.cache_k, b, hk, j, i) = k_bar;
    *cache_at(p.cache_v, b, hk, j, i) = v_bar;
  }
}

// 8 warps of 16 query rows score chunks of 64 pooled blocks.
template <bool kBf16, int kD>
struct SelectConfig {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRows = kWarps * 16;  // = kBlockQ
  static constexpr int kChunk = 64;
  static constexpr int kKSteps = kD / 16;
  using Tile = sm80::SmemTile<kD, kThreads>;
  static constexpr int kQBytes = kRows * kD * 2;
  static constexpr int kChunkBytes = kChunk * kD * 2;
  static constexpr int kSmemFixed = kQBytes + 2 * kChunkBytes;  // Q tile + two chunks of k̄
  static_assert(kRows == kBlockQ, "one query tile of block 128 per CTA");
  static std::size_t smem_bytes(int num_k_blocks) {
    return kSmemFixed + static_cast<std::size_t>(num_k_blocks) * sizeof(float);
  }
};

// One CTA per (query tile i, selection unit, sequence): the unit is a query head, or with
// pack_gqa a KV head whose group's heads are scored together. For the tile's valid rows r at
// positions a_r and the scored blocks j < A = (a_l + 1) / B, x[r, j] = scale · q_r · k̄_j where
// a_r >= j·B; M = max x; E_j = Σ_r e^{x[r, j] - M}. One pass over the chunks of k̄ (double
// buffered: the next chunk loads while this one is scored) with a running max m, the energies
// so far rescaled by e^{m_old - m_new} whenever a chunk raises it (the online softmax's rule:
// at the end every E_j is relative to M, as two passes would compute it, up to rounding); then
// one thread per block applies the keep rule and the CTA writes the row's ascending
// full/partial lists and its mean-correction bitmap.
template <bool kBf16, int kD>
__global__ void __launch_bounds__(SelectConfig<kBf16, kD>::kThreads, 2)
    select_kernel(const __grid_constant__ SelectParams p) {
  using Cfg = SelectConfig<kBf16, kD>;
  using Tile = typename Cfg::Tile;
  constexpr int kChunk = Cfg::kChunk;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_red[Cfg::kWarps];
  __shared__ int s_count[2][Cfg::kWarps];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;
  const int units = p.pack_gqa ? p.h_kv : p.h_q;
  int tile = blockIdx.x;
  const int unit = tile % units;
  tile /= units;
  const int b = tile % p.batch;
  const int i = tile / p.batch;
  const SeqInfo seq = p.seqs[b];
  const int bs = p.block;
  const geom::BlockGeometry geo{{seq.s_q, seq.s_k, true}, bs, bs};
  const int tiles = geo.num_q_blocks();
  if (i >= tiles) return;
  const std::int64_t row0 = geo.row_begin(i);
  const int rows_valid = static_cast<int>(geo.row_end(i) - row0);
  const std::int64_t a_f = geo.seq.position(row0);
  const std::int64_t a_l = geo.seq.position(geo.row_end(i) - 1);
  if (a_l < 0) return;  // no row sees a key: the row stays empty (counts zeroed by the host)
  const std::int64_t fqb = geom::floor_div(a_f, bs), lqb = a_l / bs;
  const int scored = static_cast<int>((a_l + 1) / bs);  // A
  const int heads = p.pack_gqa ? p.group : 1;
  const int h0 = p.pack_gqa ? unit * p.group : unit;
  const int hk = h0 / p.group;

  const std::uint32_t s_q_tile = ptx::smem_addr(smem);
  const std::uint32_t s_k_tile = s_q_tile + Cfg::kQBytes;  // 2 buffers
  float* energy = reinterpret_cast<float*>(smem + Cfg::kSmemFixed);  // [num_k_blocks]
  for (int j = tid; j < scored; j += Cfg::kThreads) energy[j] = 0.f;

  const auto* mean = static_cast<const std::uint16_t*>(p.k_mean) +
                     (static_cast<std::int64_t>(b) * p.h_kv + hk) * p.num_k_blocks * static_cast<std::int64_t>(kD);
  const int chunks = (scored + kChunk - 1) / kChunk;
  const bool row_ok[2] = {warp * 16 + g < rows_valid, warp * 16 + g + 8 < rows_valid};

  std::uint32_t qf[Cfg::kKSteps][4];
  // Chunk c of k̄ into buffer `buf` (not committed).
  auto load_chunk = [&](int c, int buf) {
    const int valid = scored - c * kChunk;
    const sm80::TileSrc src{sm80::contiguous_rows(mean + static_cast<std::int64_t>(c) * kChunk * kD, kD), 0,
                            valid < kChunk ? valid : kChunk};
    sm80::load_tile<Tile, kChunk>(s_k_tile + buf * Cfg::kChunkBytes, src, tid);
  };
  // Head h's Q into smem and the warp's A fragments, its first chunk of k̄ loading into buffer
  // `buf` meanwhile (committed last: the newest group on return).
  auto start_head = [&](int h, int buf) {
    __syncthreads();  // every warp is done with the previous Q tile
    const sm80::TileSrc src{
        sm80::contiguous_rows(static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride, p.q_row_stride),
        row0, rows_valid};
    sm80::load_tile<Tile, Cfg::kRows>(s_q_tile, src, tid);
    ptx::cp_async_commit();
    load_chunk(0, buf);
    ptx::cp_async_commit();
    ptx::cp_async_wait<1>();  // Q landed for this thread (the chunk may be in flight)...
    __syncthreads();          // ...for every thread
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) sm80::load_a_frag<Tile>(s_q_tile, warp * 16, kk, lane, qf[kk]);
  };
  // x for chunk c in buffer `buf` into s[8][4] (raw q·k̄ · scale), non-contributing pairs -inf.
  float s[kChunk / 8][4];
  auto scores = [&](int c, int buf) {
    const std::uint32_t chunk_tile = s_k_tile + buf * Cfg::kChunkBytes;
#pragma unroll
    for (int nf = 0; nf < kChunk / 8; ++nf) s[nf][0] = s[nf][1] = s[nf][2] = s[nf][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
#pragma unroll
      for (int np = 0; np < kChunk / 16; ++np) {
        std::uint32_t bk[4];
        sm80::load_k_frags<Tile>(chunk_tile, np * 16, kk, lane, bk);
        ptx::mma_16816<kBf16>(s[2 * np], qf[kk], bk[0], bk[1]);
        ptx::mma_16816<kBf16>(s[2 * np + 1], qf[kk], bk[2], bk[3]);
      }
    }
#pragma unroll
    for (int nf = 0; nf < kChunk / 8; ++nf) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = c * kChunk + nf * 8 + 2 * t4 + (e & 1);
        const std::int64_t pos = a_f + warp * 16 + g + (e / 2) * 8;
        const bool contributes = row_ok[e / 2] && j < scored && pos >= static_cast<std::int64_t>(j) * bs;
        s[nf][e] = contributes ? s[nf][e] * p.scale : -INFINITY;
      }
    }
  };

  // The steps n = head · chunks + c. Invariant once a step has started (start_head at a head's
  // first chunk): chunk c is committed into buffer n % 2, its group the newest, and Q is the
  // step's head's.
  const int steps = heads * chunks;
  float m = -INFINITY;  // running max of x over the steps so far (CTA-uniform; NaN sticks)
  for (int n = 0; n < steps; ++n) {
    const int c = n % chunks, buf = n % 2;
    if (c == 0) start_head(h0 + n / chunks, buf);  // the next head (of a pack_gqa group)
    // The head's next chunk into the other buffer, read by step n - 1: every warp passed the
    // __syncthreads that ends it.
    if (c + 1 < chunks) load_chunk(c + 1, buf ^ 1);
    ptx::cp_async_commit();   // always: the wait below counts groups
    ptx::cp_async_wait<1>();  // chunk c landed for this thread (the prefetch may be in flight)...
    __syncthreads();          // ...for every thread
    scores(c, buf);
    // The chunk's max, CTA-wide.
    float cm = -INFINITY;
#pragma unroll
    for (int nf = 0; nf < kChunk / 8; ++nf) {
#pragma unroll
      for (int e = 0; e < 4; ++e) cm = ptx::max_nan(cm, s[nf][e]);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) cm = ptx::max_nan(cm, __shfl_xor_sync(0xffffffffu, cm, o));
    if (lane == 0) s_red[warp] = cm;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < Cfg::kWarps; ++w) cm = ptx::max_nan(cm, s_red[w]);
    const float m_new = ptx::max_nan(m, cm);
    if (!(m_new == m)) {  // raised (or NaN): the energies so far move to the new max
      const float f = expf(m - m_new);  // m = -inf: 0 on all-zero energies
      for (int j = tid; j < scored; j += Cfg::kThreads) energy[j] *= f;
      __syncthreads();  // rescaled before the adds below
      m = m_new;
    }
    // -inf while no pair contributed (then every x here is -inf): e^{-inf - 0} = 0, no NaN.
    const float m_use = m == -INFINITY ? 0.f : m;
    // E_j += Σ e^{x - m}: column sums over the warp's rows, then over warps in smem.
#pragma unroll
    for (int nf = 0; nf < kChunk / 8; ++nf) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float col = expf(s[nf][e] - m_use) + expf(s[nf][e + 2] - m_use);  // rows g and g + 8
        col += __shfl_xor_sync(0xffffffffu, col, 4);
        col += __shfl_xor_sync(0xffffffffu, col, 8);
        col += __shfl_xor_sync(0xffffffffu, col, 16);
        const int j = c * kChunk + nf * 8 + 2 * t4 + e;
        if (g == 0 && j < scored) atomicAdd(&energy[j], col);
      }
    }
    __syncthreads();  // buffer `buf` and s_red are free; the energies complete
  }

  // E_max over the scored blocks.
  float e_max = -INFINITY;
  for (int j = tid; j < scored; j += Cfg::kThreads) e_max = ptx::max_nan(e_max, energy[j]);
#pragma unroll
  for (int o = 16; o > 0; o /= 2) e_max = ptx::max_nan(e_max, __shfl_xor_sync(0xffffffffu, e_max, o));
  __syncthreads();
  if (lane == 0) s_red[warp] = e_max;
  __syncthreads();
  e_max = s_red[0];
#pragma unroll
  for (int w = 1; w < Cfg::kWarps; ++w) e_max = ptx::max_nan(e_max, s_red[w]);

  const std::int64_t mask_row = (static_cast<std::int64_t>(b) * units + unit) * p.num_q_blocks + i;
  // Calibration: the ratios E_j / max E of the scored blocks; without a mask to write
  // (full_index null) that is all the launch is for.
  if (p.energy_ratio != nullptr) {
    for (int j = tid; j < scored; j += Cfg::kThreads) p.energy_ratio[mask_row * p.num_k_blocks + j] = energy[j] / e_max;
  }
  if (p.full_index == nullptr) return;

  // Keep rule per block j <= lqb, and the ascending lists via a CTA-wide ballot scan.
  std::int32_t* full_idx = p.full_index + mask_row * p.num_k_blocks;
  std::int32_t* part_idx = p.partial_index + mask_row * p.num_k_blocks;
  const bool tail_tile = geo.is_tail_block(i, p.tail, p.select_seqs != nullptr ? p.select_seqs[b].prompt_len : 0);
  const float alpha_peak = p.alpha * e_max;
  const int words = p.corrected_bits != nullptr ? p.corrected_words : 0;
  const int j_end = geom::max64(lqb + 1, static_cast<std::int64_t>(words) * 32);
  int full_total = 0, part_total = 0;
  for (int j0 = 0; j0 < j_end; j0 += Cfg::kThreads) {
    const int j = j0 + tid;
    bool keep = false, corrected = false, full = false;
    if (j <= lqb) {
      // E_j >= alpha · max E, written so that a NaN energy keeps.
      const bool by_energy = j < scored && !(energy[j] < alpha_peak);
      const bool forced = tail_tile || j < p.sink || fqb - p.window + 1 <= j;
      keep = by_energy || forced;
      full = geo.is_full(i, j);
      // Pruned and wholly visible to the tile's first row, hence to every row.
      corrected = !keep && p.mean_correction && geo.key_end(j) - 1 <= a_f;
    }
    const unsigned full_bal = __ballot_sync(0xffffffffu, keep && full);
    const unsigned part_bal = __ballot_sync(0xffffffffu, keep && !full);
    const unsigned corr_bal = __ballot_sync(0xffffffffu, corrected);
    if (lane == 0) {
      s_count[0][warp] = __popc(full_bal);
      s_count[1][warp] = __popc(part_bal);
      if (j / 32 < words) p.corrected_bits[mask_row * words + j / 32] = corr_bal;
    }
    __syncthreads();
    int full_off = full_total, part_off = part_total;
    for (int w = 0; w < Cfg::kWarps; ++w) {
      if (w < warp) {
        full_off += s_count[0][w];
        part_off += s_count[1][w];
      }
      full_total += s_count[0][w];
      part_total += s_count[1][w];
    }
    const unsigned below = (1u << lane) - 1u;
    if (keep && full) full_idx[full_off + __popc(full_bal & below)] = j;
    if (keep && !full) part_idx[part_off + __popc(part_bal & below)] = j;
    __syncthreads();  // s_count is rewritten by the next round
  }
  if (tid == 0) {
    p.full_count[mask_row] = full_total;
    p.partial_count[mask_row] = part_total;
  }
}

// Host-side launches; each returns a cudaError_t value (0 = success).
template <bool kBf16, int kD>
int launch_select(const SelectParams& p, void* stream) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (p.batch == 0 || p.num_k_blocks == 0) return 0;
  block_means_kernel<kBf16, kD><<<dim3(p.num_k_blocks, p.h_kv, p.batch), kD, 0, st>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return static_cast<int>(err);
  const std::size_t smem = SelectConfig<kBf16, kD>::smem_bytes(p.num_k_blocks);
  auto* kernel = select_kernel<kBf16, kD>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  const int units = p.pack_gqa ? p.h_kv : p.h_q;
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(units) *
                        static_cast<unsigned>(p.batch);
  if (grid == 0) return 0;
  kernel<<<grid, SelectConfig<kBf16, kD>::kThreads, smem, st>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::select
