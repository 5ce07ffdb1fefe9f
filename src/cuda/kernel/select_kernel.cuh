// SPDX-License-Identifier: Apache-2.0
// estimate_select on the GPU (DESIGN.md §3, FlashPrefill V2): the pooled block means k̄/v̄
// and the selector that scores the means against every query tile with mma.sync and writes a
// device BlockMask (plus the mean-correction bitmap). Portable (sm_80+).
// Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "core/rules/estimate_select.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/launch_types.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm80/tile.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::select {

// Element i of block j, KV head hk, sequence b of a cache of block means.
__device__ __forceinline__ std::uint16_t* cache_at(const MeanCache& c, int b, int hk, int j, int i) {
  return static_cast<std::uint16_t*>(c.data) + b * c.batch_stride + hk * c.head_stride + j * c.block_stride + i;
}

// k̄_j and v̄_j of one (block j, kv head, sequence): the mean of the block's valid keys,
// accumulated in double, rounded to fp32 and then to the input dtype, exactly as the oracle
// stores them. k̄ has Q/K's head dim kD, v̄ V's kDV (MLA-style prefill: 192 and 128). Thread t
// of a CTA owns the 16-byte chunk c = t % C of block j = blockIdx.x · kMeansBlocksPerCta + t / C,
// C = max(kD, kDV) / 8 (of k̄ where c < kD / 8, of v̄ where c < kDV / 8): 8 elements, each
// summed over the block's keys in key order (the oracle's), from one 16-byte load per key row: 0.148 ms at 128K on the
// Llama shape against 0.250 with one thread per element and a 2-byte load per key (record
// 2026-11-30-h200-selector-block-means-vectorized). Grid (ceil(num_k_blocks /
// kMeansBlocksPerCta), h_kv, b), kMeansThreads threads (those past the CTA's whole blocks idle:
// 8 of 128 at d = 96 and at 192). Chunked prefill: blocks j < cached are
// copied from the cache; the blocks this call completes (cached <= j < s_k / B) are written to
// it. Every thread reads and writes only its own elements (b, hk, j, 8c .. 8c + 7) of the cache
// and of the means, so no synchronisation is needed; the selector reads the means after this
// kernel on the same stream. K/V rows and the means are 16-byte aligned (plan.cpp's
// check_view); the cache, a caller's tensor, is read and written element by element.
// kFp8: e4m3 K/V (contiguous; 8-byte loads of a chunk's 8 elements), each element times its
// (batch, KV head) descale in double, as the oracle dequantizes; the means (and their cache)
// are bf16 (kBf16), docs/semantics.md §3.5.
constexpr int kMeansThreads = tuning::kMeansThreads;
template <int kD, int kDV>
constexpr int kMeansChunks = (kD > kDV ? kD : kDV) / 8;
template <int kD, int kDV>
constexpr int kMeansBlocksPerCta = kMeansThreads / kMeansChunks<kD, kDV>;

template <bool kBf16, int kD, int kDV, bool kFp8 = false>
__global__ void __launch_bounds__(kMeansThreads) block_means_kernel(const __grid_constant__ SelectParams p) {
  static_assert(!kFp8 || kBf16, "e4m3 inputs have bf16 means");
  constexpr int kChunks = kMeansChunks<kD, kDV>;
  if constexpr (kMeansThreads % kChunks != 0) {
    if (threadIdx.x >= kMeansBlocksPerCta<kD, kDV> * kChunks) return;
  }
  const int c = threadIdx.x % kChunks, hk = blockIdx.y, b = blockIdx.z;
  const int j = blockIdx.x * kMeansBlocksPerCta<kD, kDV> + threadIdx.x / kChunks;
  if (j >= p.num_k_blocks) return;
  // Whether chunk c exists in k̄'s and v̄'s rows (both when kD = kDV).
  const bool has_k = kD >= kDV || c < kD / 8;
  const bool has_v = kDV >= kD || c < kDV / 8;
  const SeqInfo seq = p.seqs[b];
  const std::int64_t key0 = static_cast<std::int64_t>(j) * p.block;
  const std::int64_t row = (static_cast<std::int64_t>(b) * p.h_kv + hk) * p.num_k_blocks + j;
  auto* k_out = static_cast<std::uint16_t*>(p.k_mean) + row * kD + 8 * c;
  auto* v_out = static_cast<std::uint16_t*>(p.v_mean) + row * kDV + 8 * c;
  if (key0 >= seq.s_k) {
    // Past this sequence's last block: masked out wherever it is read (the Hopper kernel loads
    // whole 128-block tiles of means), but its P·V term is 0 · v̄ only if v̄ is finite.
    if (has_k) *reinterpret_cast<uint4*>(k_out) = make_uint4(0, 0, 0, 0);
    if (has_v) *reinterpret_cast<uint4*>(v_out) = make_uint4(0, 0, 0, 0);
    return;
  }
  const std::int64_t cached = p.select_seqs != nullptr ? p.select_seqs[b].cached : 0;
  if (j < cached) {  // cached <= s_k / B (validated on the host): a complete block
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (has_k) k_out[e] = *cache_at(p.cache_k, b, hk, j, 8 * c + e);
      if (has_v) v_out[e] = *cache_at(p.cache_v, b, hk, j, 8 * c + e);
    }
    return;
  }
  const std::int64_t end = key0 + geom::min64(p.block, seq.s_k - key0);
  // kBatch keys' loads issued before their adds: the loads, not the adds, are the latency.
  constexpr int kBatch = 4;
  double k_sum[8] = {}, v_sum[8] = {};
  if constexpr (kFp8) {
    const auto* k = static_cast<const std::uint8_t*>(p.k) + seq.k_off + hk * p.k_head_stride + 8 * c;
    const auto* v = static_cast<const std::uint8_t*>(p.v) + seq.v_off + hk * p.v_head_stride + 8 * c;
    const double k_scale = ptx::descale_of(p, 1, b, hk), v_scale = ptx::descale_of(p, 2, b, hk);
    for (std::int64_t t0 = key0; t0 < end; t0 += kBatch) {
      uint2 k_raw[kBatch], v_raw[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const bool ok = t0 + u < end;
        k_raw[u] = ok && has_k ? *reinterpret_cast<const uint2*>(k + (t0 + u) * p.k_row_stride) : make_uint2(0, 0);
        v_raw[u] = ok && has_v ? *reinterpret_cast<const uint2*>(v + (t0 + u) * p.v_row_stride) : make_uint2(0, 0);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (t0 + u >= end) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) {  // element e: byte e % 4 of word e / 4 (little-endian)
          const std::uint32_t kw = e < 4 ? k_raw[u].x : k_raw[u].y, vw = e < 4 ? v_raw[u].x : v_raw[u].y;
          k_sum[e] += static_cast<double>(ptx::e4m3_to_float((kw >> (8 * (e % 4))) & 0xffu)) * k_scale;
          v_sum[e] += static_cast<double>(ptx::e4m3_to_float((vw >> (8 * (e % 4))) & 0xffu)) * v_scale;
        }
      }
    }
  } else {
    // The keys' rows through the forward kernel's addressor (contiguous or paged).
    const auto* k = static_cast<const std::uint16_t*>(p.k) + seq.k_off + hk * p.k_head_stride;
    const auto* v = static_cast<const std::uint16_t*>(p.v) + seq.v_off + hk * p.v_head_stride;
    const std::int32_t* pages = p.paged.block_table == nullptr ? nullptr : p.paged.block_table + b * p.paged.table_stride;
    const sm80::KvRows k_rows{k, p.k_row_stride, pages, p.paged.page_size, p.paged.k_page_stride};
    const sm80::KvRows v_rows{v, p.v_row_stride, pages, p.paged.page_size, p.paged.v_page_stride};
    for (std::int64_t t0 = key0; t0 < end; t0 += kBatch) {
      uint4 k_raw[kBatch], v_raw[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const bool ok = t0 + u < end;
        k_raw[u] = ok && has_k ? *reinterpret_cast<const uint4*>(k_rows.row(t0 + u) + 8 * c) : make_uint4(0, 0, 0, 0);
        v_raw[u] = ok && has_v ? *reinterpret_cast<const uint4*>(v_rows.row(t0 + u) + 8 * c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (t0 + u >= end) break;
        const std::uint32_t kw[4] = {k_raw[u].x, k_raw[u].y, k_raw[u].z, k_raw[u].w};
        const std::uint32_t vw[4] = {v_raw[u].x, v_raw[u].y, v_raw[u].z, v_raw[u].w};
#pragma unroll
        for (int e = 0; e < 8; ++e) {  // element e: half e % 2 of word e / 2 (little-endian)
          k_sum[e] += ptx::to_float<kBf16>(static_cast<std::uint16_t>(kw[e / 2] >> (16 * (e % 2))));
          v_sum[e] += ptx::to_float<kBf16>(static_cast<std::uint16_t>(vw[e / 2] >> (16 * (e % 2))));
        }
      }
    }
  }
  const double len = static_cast<double>(end - key0);
  std::uint16_t k_bar[8], v_bar[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    k_bar[e] = ptx::from_float<kBf16>(static_cast<float>(k_sum[e] / len));
    v_bar[e] = ptx::from_float<kBf16>(static_cast<float>(v_sum[e] / len));
  }
  auto pack = [](const std::uint16_t (&h)[8]) {
    auto w = [&](int i) { return static_cast<std::uint32_t>(h[2 * i]) | (static_cast<std::uint32_t>(h[2 * i + 1]) << 16); };
    return make_uint4(w(0), w(1), w(2), w(3));
  };
  if (has_k) *reinterpret_cast<uint4*>(k_out) = pack(k_bar);
  if (has_v) *reinterpret_cast<uint4*>(v_out) = pack(v_bar);
  if (p.cache_k.data != nullptr && j < seq.s_k / p.block) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      if (has_k) *cache_at(p.cache_k, b, hk, j, 8 * c + e) = k_bar[e];
      if (has_v) *cache_at(p.cache_v, b, hk, j, 8 * c + e) = v_bar[e];
    }
  }
}

// 8 warps as 4 block groups x 2 query halves: a chunk is 64 pooled blocks, and warp w scores
// blocks 16·(w % 4) .. +15 of it against query rows 64·(w / 4) .. +63 of the tile (32
// accumulators per thread). Chunks of 64, not 128: the last chunk of a tile idles fewer warps
// (Nsight, bench/records/2026-11-29-h200-selector-permute-ncu.log: 23% of the stall samples at
// the chunk barrier with 128; selector 4.38 -> 3.96 ms at 128K, records
// -selector-transposed-scores and -selector-chunks-of-64-query-halves).
template <bool kBf16, int kD>
struct SelectConfig {
  static constexpr int kWarps = tuning::kSelectWarps;
  static constexpr int kThreads = kWarps * 32;
  // Two CTAs per SM cap a thread at 128 registers: at d 192 that spilled 416 bytes (load_rows_each's
  // addresses; 256: 60, 96: 52; ptxas -v, sm_80), and their CTAs' shared memory (96 and 128 KB)
  // leaves at most two per SM anyway. One CTA per SM above d 128 is untimed.
  static constexpr int kMinBlocks = kD <= 128 ? 2 : 1;
  static constexpr int kRows = 128;  // = kBlockQ
  static constexpr int kHalves = tuning::kSelectHalves;  // query halves
  static constexpr int kHalf = kRows / kHalves;
  static constexpr int kChunk = kWarps / kHalves * 16;  // pooled blocks per chunk
  static constexpr int kKSteps = kD / 16;
  using Tile = sm80::SmemTile<kD, kThreads>;
  // Rows at the tile's pitch (d = 96's rows take 128 elements' bytes).
  static constexpr int kQBytes = kRows * Tile::kRowBytes;
  static constexpr int kChunkBytes = kChunk * Tile::kRowBytes;
  static constexpr int kSmemFixed = kQBytes + 2 * kChunkBytes;  // Q tile + two chunks of k̄
  static_assert(kRows == kBlockQ, "one query tile of block 128 per CTA");
  // Plus λ per query half and block.
  static std::size_t smem_bytes(int num_k_blocks) {
    return kSmemFixed + static_cast<std::size_t>(kHalves) * static_cast<std::size_t>(num_k_blocks) * sizeof(float);
  }
};

// log2(2^a + 2^b), NaN if either is; -inf + -inf = -inf.
__device__ __forceinline__ float log2_add(float a, float b) {
  const float hi = ptx::max_nan(a, b);
  if (hi == -INFINITY) return hi;
  return hi + __log2f(ptx::exp2f_fast(a - hi) + ptx::exp2f_fast(b - hi));
}

// The query tile and KV group one CTA selects for: block index = ((Q - 1 - i) · batch + b) · h_kv
// + hk for Q = num_q_blocks, the longest tiles first. The CTA takes the group's heads h0 .. h0 +
// heads - 1 in turn, each its own mask row (unit = its query head) or, with pack_gqa, their
// energies added into the group's one row (unit = hk). For the tile's valid rows r at positions
// a_r and the scored blocks j < A = (a_l + 1) / B, x[r, j] = scale · q_r · k̄_j where a_r >= j·B,
// and E_j = Σ_r e^{x[r, j]}. A CTA per group, not per head: a tile's fixed cost (its start, the
// first Q and k̄ loads) is paid once per group, and the next head's loads are in flight while
// the previous head's mask is written (Hopper selector 12-13% faster at 16K-32K, 2% at 128K:
// record 2026-11-30-h200-selector-per-group-heads).
struct SelectTile {
  int units, unit, b, i;
  SeqInfo seq;
  geom::BlockGeometry geo;
  std::int64_t row0, a_f, a_l, fqb, lqb;
  int rows_valid, scored, heads, h0, hk;
  bool per_head;  // a mask row per query head (not pack_gqa)

  // False when the CTA has nothing to select: past its sequence's tiles, or no row sees a key
  // (the rows stay empty: counts zeroed by the host).
  __device__ __forceinline__ bool init(const SelectParams& p, int block_index) {
    hk = block_index % p.h_kv;
    block_index /= p.h_kv;
    b = block_index % p.batch;
    i = p.num_q_blocks - 1 - block_index / p.batch;
    seq = p.seqs[b];
    geo = geom::BlockGeometry{{seq.s_q, seq.s_k, true}, p.block, p.block};
    if (i >= geo.num_q_blocks()) return false;
    row0 = geo.row_begin(i);
    rows_valid = static_cast<int>(geo.row_end(i) - row0);
    a_f = geo.seq.position(row0);
    a_l = geo.seq.position(geo.row_end(i) - 1);
    if (a_l < 0) return false;
    fqb = geom::floor_div(a_f, p.block);
    lqb = a_l / p.block;
    scored = static_cast<int>((a_l + 1) / p.block);
    heads = p.group;
    h0 = hk * p.group;
    per_head = !p.pack_gqa;
    units = per_head ? p.h_q : p.h_kv;
    unit = per_head ? h0 : hk;
    return true;
  }
};

// v[0] = op over v[0 .. kN - 1] as a pairwise tree (depth log2 kN); the rest is clobbered.
// Recursion on kN, not a halving loop: nvcc does not unroll the latter and keeps v in local
// memory.
template <int kN, class Op>
__device__ __forceinline__ void tree_reduce(float (&v)[kN], const Op& op) {
  if constexpr (kN > 1) {
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) v[i] = op(v[i], v[i + kN / 2]);
    tree_reduce<kN / 2>(reinterpret_cast<float(&)[kN / 2]>(v), op);
  }
}

// One warp's part of the energies: accumulator rows g and g + 8 (blocks j0 + g, j0 + g + 8) of
// raw scores q·k̄ over kNF n8 column groups (query rows q0 + 8·nf + 2·t4 + e % 2), in the
// mma.sync accumulator layout. Per row λ = log2 Σ 2^{y}, y = scale·log2(e)·q·k̄ over the
// contributing pairs (a row with none gets -inf), written to lambda[j - first] for j < A, added
// to what is there (log-sum-exp) when `add` (the later heads of a pack_gqa group). `masked`:
// some pair of these rows and columns may not contribute; otherwise the per-pair test is skipped. The
// max is taken on the raw scores (scale > 0) and the scale folded into the exponent's FMA; max
// and sum are pairwise trees, so that a row's dependency chain is log2(2·kNF) deep, not 2·kNF
// (the selector runs 4 warps per SM sub-partition: its chains are not hidden; the portable
// selector at 128K went from 3.86 to 3.16 ms, records 2026-11-29-h200-fp32-rank-keys-selector-
// final and 2026-11-30-h200-portable-path-forced-full-end-hoisted).
template <int kNF>
__device__ __forceinline__ void warp_lambdas(float (&acc)[kNF][4], const SelectTile& t, int bs, float scale_log2, int j0,
                                             int q0, bool masked, bool add, float* lambda, int first, int lane) {
  static_assert((kNF & (kNF - 1)) == 0, "a power of two of column groups");
  const int g = lane / 4, t4 = lane % 4;
  if (masked) {
#pragma unroll
    for (int nf = 0; nf < kNF; ++nf) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int q = q0 + nf * 8 + 2 * t4 + (e & 1);
        const int j = j0 + g + 8 * (e / 2);
        const bool contributes = q < t.rows_valid && j < t.scored && t.a_f + q >= static_cast<std::int64_t>(j) * bs;
        if (!contributes) acc[nf][e] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float part[kNF];
#pragma unroll
    for (int nf = 0; nf < kNF; ++nf) part[nf] = ptx::max_nan(acc[nf][2 * r], acc[nf][2 * r + 1]);
    tree_reduce<kNF>(part, [](float a, float b) { return ptx::max_nan(a, b); });
    float mx = part[0];
    mx = ptx::max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = ptx::max_nan(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // -inf when no pair of the row contributed: every term is e^{-inf} = 0, no NaN.
    const float m_use = mx == -INFINITY ? 0.f : mx * scale_log2;
#pragma unroll
    for (int nf = 0; nf < kNF; ++nf) {
      part[nf] = ptx::exp2f_fast(fmaf(acc[nf][2 * r], scale_log2, -m_use)) +
                 ptx::exp2f_fast(fmaf(acc[nf][2 * r + 1], scale_log2, -m_use));
    }
    tree_reduce<kNF>(part, [](float a, float b) { return a + b; });
    float sum = part[0];
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int j = j0 + g + 8 * r;
    if (t4 == 0 && j < t.scored) {
      const float l = (mx == -INFINITY ? mx : m_use) + __log2f(sum);
      float& out = lambda[j - first];
      out = add ? log2_add(out, l) : l;
    }
  }
}

// After every λ_j of the tile is in `energy` (and, with `second` non-null, a second part of it
// per block, e.g. the other query half, in `second`): E_j / max E = 2^{λ_j - max λ} (a NaN
// anywhere makes every ratio NaN: every block keeps), the calibration ratios, then the keep
// rule per block j <= lqb and the row's ascending full/partial lists (a CTA-wide ballot scan)
// and its mean-correction bitmap. Called by all kWarps warps of the CTA after a barrier.
// Blocks go in rounds of one per thread; the lists of up to kScanRounds rounds are placed
// after one barrier (their per-warp counts in s_count[list][round][warp]): 1024 blocks (128K
// tokens at block 128) at 256 threads in one barrier pair instead of four. select90_kernel ran
// 2-3% faster at 128K and up to 6% at 32K so, in a same-call A/B of three rounds (record
// 2026-11-30-h200-selector-one-scan).
constexpr int kScanRounds = tuning::kSelectScanRounds;
template <int kWarps>
__device__ __forceinline__ void finish_selection(const SelectParams& p, const SelectTile& t, float* energy,
                                                 const float* second, float* s_red,
                                                 int (*s_count)[kScanRounds][kWarps]) {
  constexpr int kThreads = kWarps * 32;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  float lam_max = -INFINITY;
  for (int j = tid; j < t.scored; j += kThreads) {
    const float lambda = second != nullptr ? log2_add(energy[j], second[j]) : energy[j];
    energy[j] = lambda;
    lam_max = ptx::max_nan(lam_max, lambda);
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) lam_max = ptx::max_nan(lam_max, __shfl_xor_sync(0xffffffffu, lam_max, o));
  if (lane == 0) s_red[warp] = lam_max;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) lam_max = ptx::max_nan(lam_max, s_red[w]);
  for (int j = tid; j < t.scored; j += kThreads) energy[j] = ptx::exp2f_fast(energy[j] - lam_max);
  __syncthreads();

  const std::int64_t mask_row = (static_cast<std::int64_t>(t.b) * t.units + t.unit) * p.num_q_blocks + t.i;
  // Calibration: the ratios E_j / max E of the scored blocks; without a mask to write
  // (full_index null) that is all the launch is for.
  if (p.energy_ratio != nullptr) {
    for (int j = tid; j < t.scored; j += kThreads) p.energy_ratio[mask_row * p.num_k_blocks + j] = energy[j];
  }
  if (p.full_index == nullptr) return;

  std::int32_t* full_idx = p.full_index + mask_row * p.num_k_blocks;
  std::int32_t* part_idx = p.partial_index + mask_row * p.num_k_blocks;
  const bool tail_tile = t.geo.is_tail_block(t.i, p.tail, p.select_seqs != nullptr ? p.select_seqs[t.b].prompt_len : 0);
  const int words = p.corrected_bits != nullptr ? p.corrected_words : 0;
  // Rounds of kThreads blocks up to lqb; the bitmap's words past the last round are zero (no
  // block past lqb is corrected), stored without a round each: at 128K a round costs two CTA
  // barriers, and the bitmap spans the sequence's 1024 blocks whatever the tile.
  const int j_end = static_cast<int>(t.lqb) + 1;
  for (int w = (j_end + kThreads - 1) / kThreads * (kThreads / 32) + tid; w < words; w += kThreads) {
    p.corrected_bits[mask_row * words + w] = 0u;
  }
  const int full_end = t.geo.full_end(t.i);  // blocks below it are full (geo.is_full)
  int full_total = 0, part_total = 0;
  for (int g0 = 0; g0 < j_end; g0 += kScanRounds * kThreads) {
    // The rounds of this group that hold blocks up to lqb (the same count for every thread).
    const int rounds = min(kScanRounds, (j_end - g0 + kThreads - 1) / kThreads);
    unsigned full_bal[kScanRounds], part_bal[kScanRounds];
#pragma unroll
    for (int r = 0; r < kScanRounds; ++r) {
      if (r >= rounds) break;
      const int j = g0 + r * kThreads + tid;
      bool keep = false, corrected = false, full = false;
      if (j <= t.lqb) {
        // E_j >= alpha · max E: a NaN energy or peak fails, leaving the forced blocks
        // (rules::estimate_keeps).
        const bool by_energy = j < t.scored && energy[j] >= p.alpha;
        keep = by_energy || rules::estimate_forced(tail_tile, t.fqb, j, p.sink, p.window);
        full = j < full_end;
        corrected = !keep && p.mean_correction && rules::estimate_correctable(t.geo, t.a_f, j);
      }
      full_bal[r] = __ballot_sync(0xffffffffu, keep && full);
      part_bal[r] = __ballot_sync(0xffffffffu, keep && !full);
      const unsigned corr_bal = __ballot_sync(0xffffffffu, corrected);
      if (lane == 0) {
        s_count[0][r][warp] = __popc(full_bal[r]);
        s_count[1][r][warp] = __popc(part_bal[r]);
        if (j / 32 < words) p.corrected_bits[mask_row * words + j / 32] = corr_bal;
      }
    }
    __syncthreads();
    const unsigned below = (1u << lane) - 1u;
#pragma unroll
    for (int r = 0; r < kScanRounds; ++r) {
      if (r >= rounds) break;
      int full_off = full_total, part_off = part_total;
      for (int w = 0; w < kWarps; ++w) {
        if (w < warp) {
          full_off += s_count[0][r][w];
          part_off += s_count[1][r][w];
        }
        full_total += s_count[0][r][w];
        part_total += s_count[1][r][w];
      }
      const int j = g0 + r * kThreads + tid;
      if (full_bal[r] & (1u << lane)) full_idx[full_off + __popc(full_bal[r] & below)] = j;
      if (part_bal[r] & (1u << lane)) part_idx[part_off + __popc(part_bal[r] & below)] = j;
    }
    __syncthreads();  // s_count is rewritten by the next group
  }
  if (tid == 0) {
    p.full_count[mask_row] = full_total;
    p.partial_count[mask_row] = part_total;
  }
}

// The scores are computed transposed, S^T = K̄ · Q^T (k̄ the A operand, the Q tile the B
// operand), so that E_j is a row sum: per warp a max and a sum per row in registers and two
// quad shuffles, no shared-memory atomics and no CTA-wide max per chunk (the column-sum layout
// this replaces: bench record 2026-11-29-h200-selectors-kernel-profile-before). One barrier per
// chunk of k̄ (double buffered: the next chunk loads while this one is scored). Each query half
// keeps its own λ (log2 energy, pack_gqa heads added); finish_selection adds the halves.
template <bool kBf16, int kD>
__global__ void __launch_bounds__(SelectConfig<kBf16, kD>::kThreads, SelectConfig<kBf16, kD>::kMinBlocks)
    select_kernel(const __grid_constant__ SelectParams p) {
  using Cfg = SelectConfig<kBf16, kD>;
  using Tile = typename Cfg::Tile;
  constexpr int kChunk = Cfg::kChunk, kHalf = Cfg::kHalf;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ float s_red[Cfg::kWarps];
  __shared__ int s_count[2][kScanRounds][Cfg::kWarps];

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  SelectTile t;
  if (!t.init(p, blockIdx.x)) return;
  const float scale_log2 = p.scale * 1.4426950408889634f;
  const int q0 = (warp / (Cfg::kWarps / Cfg::kHalves)) * kHalf;  // this warp's query half
  const int wb = warp % (Cfg::kWarps / Cfg::kHalves);             // and block group

  const std::uint32_t s_q_tile = ptx::smem_addr(smem);
  const std::uint32_t s_k_tile = s_q_tile + Cfg::kQBytes;  // 2 buffers
  // λ_j of each query half ([2][num_k_blocks], entries j < A used), then E_j / max E in the first.
  float* energy = reinterpret_cast<float*>(smem + Cfg::kSmemFixed);
  float* half_energy = energy + (q0 / kHalf) * p.num_k_blocks;

  const auto* mean = static_cast<const std::uint16_t*>(p.k_mean) +
                     (static_cast<std::int64_t>(t.b) * p.h_kv + t.hk) * p.num_k_blocks * static_cast<std::int64_t>(kD);
  const int chunks = (t.scored + kChunk - 1) / kChunk;

  // Chunk c of k̄ into buffer `buf` (not committed); rows past A zero-filled.
  auto load_chunk = [&](int c, int buf) {
    const int valid = t.scored - c * kChunk;
    const sm80::TileSrc src{sm80::contiguous_rows(mean + static_cast<std::int64_t>(c) * kChunk * kD, kD), 0,
                            valid < kChunk ? valid : kChunk};
    sm80::load_tile<Tile, kChunk>(s_k_tile + buf * Cfg::kChunkBytes, src, tid);
  };
  // Head h's Q tile (not committed); rows past the tile's valid rows zero-filled.
  auto load_q = [&](int h) {
    const sm80::TileSrc src{sm80::contiguous_rows(static_cast<const std::uint16_t*>(p.q) + t.seq.q_off + h * p.q_head_stride,
                                                  p.q_row_stride),
                            t.row0, t.rows_valid};
    sm80::load_tile<Tile, Cfg::kRows>(s_q_tile, src, tid);
  };

  // Steps over (head, chunk c), c fastest. Invariant at the top of a step: the only cp.async
  // group in flight holds chunk c (in buffer `buf`) and, at a head's first chunk, its Q tile.
  load_q(t.h0);
  load_chunk(0, 0);
  ptx::cp_async_commit();
  int buf = 0;
#pragma unroll 1
  for (int head = 0; head < t.heads; ++head) {
#pragma unroll 1
    for (int c = 0; c < chunks; ++c, buf ^= 1) {
      ptx::cp_async_wait<0>();  // chunk c (and Q) landed for this thread...
      __syncthreads();          // ...for every thread; every warp is done with the previous step
      // The next step's chunk into the buffer the previous step read; at a head change its Q
      // waits for the end of this step (the Q tile is in use).
      if (c + 1 < chunks) {
        load_chunk(c + 1, buf ^ 1);
      } else if (head + 1 < t.heads) {
        load_chunk(0, buf ^ 1);
      }
      ptx::cp_async_commit();

      // This warp's blocks j0 .. j0 + 15 against query rows q0 .. q0 + 63 of the tile.
      const int j0 = c * kChunk + wb * 16;
      if (j0 < t.scored) {
        const std::uint32_t chunk_tile = s_k_tile + buf * Cfg::kChunkBytes;
        float acc[kHalf / 8][4];
#pragma unroll
        for (int nf = 0; nf < kHalf / 8; ++nf) acc[nf][0] = acc[nf][1] = acc[nf][2] = acc[nf][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
          std::uint32_t a[4];
          sm80::load_a_frag<Tile>(chunk_tile, wb * 16, kk, lane, a);
#pragma unroll
          for (int np = 0; np < kHalf / 16; ++np) {
            std::uint32_t bq[4];
            sm80::load_k_frags<Tile>(s_q_tile, q0 + np * 16, kk, lane, bq);
            ptx::mma_16816<kBf16>(acc[2 * np], a, bq[0], bq[1]);
            ptx::mma_16816<kBf16>(acc[2 * np + 1], a, bq[2], bq[3]);
          }
        }
        // Pairs that do not contribute (query rows past the tile's, keys of block j not yet
        // visible to the row, blocks past A) exist only in the chunk that holds A - 1 and the
        // tile's own blocks, or in a short tile: the mask is applied only there.
        const bool masked = j0 + 15 >= t.scored || q0 + kHalf > t.rows_valid ||
                            t.a_f + q0 < static_cast<std::int64_t>(j0 + 15) * p.block;
        warp_lambdas(acc, t, p.block, scale_log2, j0, q0, masked, !t.per_head && head > 0, half_energy, 0, lane);
      }
      if (c + 1 == chunks) {
        __syncthreads();  // every warp has written this head's λ and is done with its Q
        if (head + 1 < t.heads) {
          load_q(t.h0 + head + 1);
          ptx::cp_async_commit();
        }
      }
    }
    // The mask row (per head: this head's, while the next head's Q and first chunk load).
    if (t.per_head || head + 1 == t.heads) {
      if (t.per_head) t.unit = t.h0 + head;
      finish_selection<Cfg::kWarps>(p, t, energy, energy + p.num_k_blocks, s_red, s_count);
    }
  }
}

// One launch of estimate_select's selection (SelectStage, launch_types.h): kMeans, the block
// means [ceil(num_k_blocks / per CTA), h_kv, batch] (k̄ of kD, v̄ of kDV); kSelect, the selector `kernel` (this
// file's, or the Hopper one) with `threads` threads and `smem` bytes of dynamic shared memory,
// one CTA per (query block, KV head, batch). Returns a cudaError_t value.
template <bool kBf16, int kD, int kDV = kD, bool kFp8 = false>
int launch_selection_stage(SelectStage stage, const SelectParams& p, void* stream, void (*kernel)(SelectParams),
                           int threads, std::size_t smem) {
  const auto st = static_cast<cudaStream_t>(stream);
  if (p.batch == 0 || p.num_k_blocks == 0) return 0;
  if (stage == SelectStage::kMeans) {
    constexpr int kPerCta = kMeansBlocksPerCta<kD, kDV>;
    const unsigned mean_ctas = static_cast<unsigned>((p.num_k_blocks + kPerCta - 1) / kPerCta);
    block_means_kernel<kBf16, kD, kDV, kFp8><<<dim3(mean_ctas, p.h_kv, p.batch), kMeansThreads, 0, st>>>(p);
    return static_cast<int>(cudaGetLastError());
  }
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(p.h_kv) *
                        static_cast<unsigned>(p.batch);
  if (grid == 0) return 0;
  kernel<<<grid, threads, smem, st>>>(p);
  return static_cast<int>(cudaGetLastError());
}

template <bool kBf16, int kD, int kDV = kD>
int launch_select(SelectStage stage, const SelectParams& p, void* stream) {
  using Cfg = SelectConfig<kBf16, kD>;
  return launch_selection_stage<kBf16, kD, kDV>(stage, p, stream, select_kernel<kBf16, kD>, Cfg::kThreads,
                                                Cfg::smem_bytes(p.num_k_blocks));
}

}  // namespace sparseprefill::cuda::select
