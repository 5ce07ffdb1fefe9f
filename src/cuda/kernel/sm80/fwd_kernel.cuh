// SPDX-License-Identifier: Apache-2.0
// The portable forward attention kernel (mma.sync m16n8k16, ldmatrix, cp.async; sm_80 and
// newer): one CTA of 4 warps (8 at head dims above 128) per (query block of 128 rows, batch,
// query head), online softmax over the key blocks a policy selects in 64-key sub-tiles, in-loop
// gates (exact_gate, softmax_skip) on whole blocks, block-mask execution and mean-correction
// pseudo-tokens. K/V rows are contiguous or paged (through the block table, KvRows in tile.cuh).
// Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/policy.cuh"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm80/tile.cuh"
#include "cuda/kernel/softmax.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::sm80 {

// Compile-time shape of one instance. Tile values never change results: kBlockM is the
// block_q every policy uses on CUDA; a block of block_k = 64 or 128 keys is visited as one or
// two 64-key sub-tiles. 4 warps of 32 rows (two m16 fragments each share every K/V fragment
// they load), so that two CTAs share an SM and hide each other's barriers and load latency
// (the FlashAttention-2 shape; docs/cuda.md has the measurements; kSmemBytes below).
// kGated: the instance runs the in-kernel gates (gated_mode), and only those. Without the gated
// blocks' code the loop of dense and block masks keeps more in registers (spills at sm_90:
// 108 / 160 bytes stored / loaded against 176 / 236 at d = 128, none against 100 / 204 at
// d = 64) and dense ran 1.5-2% faster at 16K-32K than with one instance, in the same call
// (record 2026-11-30-h200-portable-dense-ungated-instances); warp_scores' look-ahead since then
// (88 / 180 bytes at d = 128; 60 / 88 with one K prefetch site, the gated instance 160 / 364)
// is for the ungated instances only.
// kPlain (ungated only): the instance runs calls over contiguous K/V without mean-correction
// tiles (dense and block masks), so the paged row lookup and the mean tiles compile out;
// the other ungated instance (kPlain false) runs paged K/V and mean correction.
// kHeadDimV: V's (and O's) head dim, Q/K's but for MLA-style prefill (192 / 128).
template <bool kBf16_, int kHeadDim_, bool kGated_ = false, bool kPlain_ = false, int kHeadDimV_ = kHeadDim_>
struct FwdConfig {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kGated = kGated_;
  static constexpr bool kPlain = kPlain_;
  static_assert(!(kGated && kPlain), "the gated instance runs every K/V layout");
  static constexpr int kBlockM = kBlockQ;
  static constexpr int kBlockN = tuning::kPortableBlockN;  // keys per sub-tile
  // d <= 128: 4 warps of 32 rows, two CTAs per SM; wider Q/K heads (192, 256): 8 warps of 16
  // rows, one CTA (tuning.h: the registers).
  static constexpr bool kWide = kHeadDim > 128;
  static constexpr int kWarps = kWide ? tuning::kPortableWarpsWide : tuning::kPortableWarps;
  static constexpr int kMinBlocks = kWide ? 1 : 2;  // CTAs per SM (__launch_bounds__)
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kM = kBlockM / (kWarps * 16);  // m16 fragments per warp: 32 rows, or 16 wide
  static constexpr int kNFrags = kBlockN / 8;     // n8 fragments of a sub-tile's score row
  static constexpr int kDFrags = kHeadDimV / 8;   // n8 fragments of an output row
  static constexpr int kKSteps = kHeadDim / 16;   // k16 steps of Q·Kᵀ
  static constexpr int kPSteps = kBlockN / 16;    // k16 steps of P·V
  using Tile = SmemTile<kHeadDim, kThreads>;    // Q and K (and O, staged in Q's tile)
  using TileV = SmemTile<kHeadDimV, kThreads>;  // V
  static constexpr int kQBytes = kBlockM * Tile::kRowBytes;
  static constexpr int kKVBytes = kBlockN * Tile::kRowBytes;  // one K stage
  static constexpr int kVBytes = kBlockN * TileV::kRowBytes;  // one V slot
  // Fragment addresses in frag_addr's XOR form, which needs rows of a power of two bytes (not
  // d = 192's 384). Ungated: dense 6-7% and block masks 5% faster at 8K-32K (Llama shape), while
  // the gated instance and the permute kernel (PermuteConfig) ran 1-2.5% slower with it, in one
  // same-call A/B (record 2026-11-30-h200-portable-xor-fragment-addresses).
  static constexpr bool kXorFragments = tuning::portable_xor_fragments(kGated) &&
                                        (Tile::kRowBytes & (Tile::kRowBytes - 1)) == 0 &&
                                        (TileV::kRowBytes & (TileV::kRowBytes - 1)) == 0;
  // A gated 128-key block needs both sub-tiles' scores before its decision: the first
  // sub-tile's raw scores wait in smem, thread-private, in the region of the V slots (unused
  // until the decision), since the registers hold the output accumulator.
  static constexpr int kStashBytes = kThreads * kM * kNFrags * 4 * 4;
  static constexpr int kVRegionBytes =
      !kGated ? kVBytes : (2 * kVBytes > kStashBytes ? 2 * kVBytes : kStashBytes);
  // Q (reused for the O epilogue), K double-buffered, then the V region: one slot, or in the
  // gated instance two (one per sub-tile of a gated 128-key block) overlapping the stash.
  // Ungated 80 KB at d = 128 and 40 KB at d = 64, gated 96 and 64 KB. The registers allow two
  // CTAs per SM (255 × 128 threads); shared memory allows two ungated ones on every portable
  // GPU at d = 64 and on an A100's 164 KB at d = 128 (2 × (80 KB + 640 B static + 1 KB the
  // driver reserves per CTA) <= 164 KB; one only with a 96 KB V region or 1152 B static),
  // and two gated ones from 228 KB per SM (H100, H200). d = 96 as d = 128 (its rows' pitch,
  // SmemTile). The wide shapes run one CTA of 8 warps: d 192 / d_v 128 in 112 KB, d = 256 in
  // 160 KB, within the 163 KB a CTA may opt into on an A100; gated, 192 / 128 in 128 KB (an
  // A100 too) and d = 256 in 192 KB (two V slots of 32 KB), within an H100's 227 KB only; where a
  // device offers less (A100 for the gated 256, 99 KB on sm_86 and sm_89 for the wide ones) the
  // plan refuses them (each instance exports its count: variants.py).
  static constexpr int kSmemBytes = kQBytes + 2 * kKVBytes + kVRegionBytes;
  static constexpr int kStaticSmemBytes = 640;  // fwd_kernel's __shared__ arrays, in 128-byte units
  // Compute capability 8.0: 164 KB of shared memory per SM, 1 KB of it reserved per CTA
  // (the CUDA C++ Programming Guide's table of compute capabilities).
  static_assert(kGated || kWide || kHeadDimV != kHeadDim || 2 * (kSmemBytes + kStaticSmemBytes + 1024) <= 164 * 1024,
                "two ungated CTAs per SM of an A100");
  static_assert(kSmemBytes + kStaticSmemBytes <= (kGated && kWide ? 227 : 163) * 1024,
                "one CTA on an A100 (the gated wide one: on an H100)");
  // After the decision the first sub-tile's P (16-bit, half the stash) is parked in the free K
  // stage where it fits (d = 128: the accumulator leaves no room for a second P in registers);
  // at d = 64 it stays in registers.
  static constexpr int kParkBytes = kStashBytes / 2;
  static constexpr bool kParkInSmem = kParkBytes <= kKVBytes;

  static_assert(kBlockM == kWarps * 16 * kM, "the warps tile the query block");
  static_assert(kMeanChunk == kBlockN, "a mean-correction tile is one sub-tile of pooled blocks");
};

// S = Q·Kᵀ for one warp's kM m16 row groups (rows warp_row ..) against a [kBlockN, kHeadDim]
// K tile: every K fragment loaded serves all kM row groups.
template <class Cfg>
__device__ __forceinline__ void warp_scores(std::uint32_t q_tile, std::uint32_t k_tile, int warp_row, int lane,
                                            float (&s)[Cfg::kM][Cfg::kNFrags][4]) {
  using Tile = typename Cfg::Tile;
#pragma unroll
  for (int mi = 0; mi < Cfg::kM; ++mi) {
#pragma unroll
    for (int nf = 0; nf < Cfg::kNFrags; ++nf) s[mi][nf][0] = s[mi][nf][1] = s[mi][nf][2] = s[mi][nf][3] = 0.f;
  }
  // Ungated configs (the ungated forward instances, and permute_stop's portable kernel, whose
  // PermuteConfig is an ungated FwdConfig) load the fragments of k-step kk + 1 while the MMAs
  // of kk run (two register sets; ldmatrix and mma are volatile asm, so this order is the SASS
  // order). Dense ran 2.5-4.5% faster that way, the gated instance 1-1.5% slower on the Llama
  // shape, in one same-call A/B (record 2026-11-30-h200-portable-dense-pipelined-fragments): the
  // gated instance loads each fragment just before its MMAs. (The permute kernel's spills at
  // d = 128 fell from 156 / 196 to 36 / 48 bytes with it; timed since only beside other
  // changes, record 2026-11-30-h200-portable-xor-fragment-addresses.)
  constexpr bool kAhead = tuning::portable_fragments_ahead(Cfg::kGated);
  std::uint32_t qa[2][Cfg::kM][4], bk[2][Cfg::kNFrags / 2][4];
  auto load_q = [&](int kk, int buf) {
#pragma unroll
    for (int mi = 0; mi < Cfg::kM; ++mi) load_a_frag<Tile, Cfg::kXorFragments>(q_tile, warp_row + 16 * mi, kk, lane, qa[buf][mi]);
  };
  auto load_k = [&](int kk, int np, int buf) { load_k_frags<Tile, Cfg::kXorFragments>(k_tile, np * 16, kk, lane, bk[buf][np]); };
  auto load_step = [&](int kk, int buf) {
    load_q(kk, buf);
#pragma unroll
    for (int np = 0; np < Cfg::kNFrags / 2; ++np) load_k(kk, np, buf);
  };
  if constexpr (kAhead) load_step(0, 0);
#pragma unroll
  for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
    const int cur = kk & 1;
    if constexpr (kAhead) {
      if (kk + 1 < Cfg::kKSteps) load_step(kk + 1, cur ^ 1);
    } else {
      load_q(kk, cur);
    }
#pragma unroll
    for (int np = 0; np < Cfg::kNFrags / 2; ++np) {
      if constexpr (!kAhead) load_k(kk, np, cur);
#pragma unroll
      for (int mi = 0; mi < Cfg::kM; ++mi) {
        ptx::mma_16816<Cfg::kBf16>(s[mi][2 * np], qa[cur][mi], bk[cur][np][0], bk[cur][np][1]);
        ptx::mma_16816<Cfg::kBf16>(s[mi][2 * np + 1], qa[cur][mi], bk[cur][np][2], bk[cur][np][3]);
      }
    }
  }
}

// O += P·V for one warp's rows: P as A fragments [kM][kPSteps][4], V a [kBlockN, kHeadDimV] tile.
template <class Cfg>
__device__ __forceinline__ void warp_pv(std::uint32_t v_tile, int lane, const std::uint32_t (&pp)[Cfg::kM][Cfg::kPSteps][4],
                                        float (&acc)[Cfg::kM][Cfg::kDFrags][4]) {
  using Tile = typename Cfg::TileV;
#pragma unroll
  for (int kk = 0; kk < Cfg::kPSteps; ++kk) {
#pragma unroll
    for (int dp = 0; dp < Cfg::kDFrags / 2; ++dp) {
      std::uint32_t bv[4];
      load_v_frags<Tile, Cfg::kXorFragments>(v_tile, kk, dp, lane, bv);
#pragma unroll
      for (int mi = 0; mi < Cfg::kM; ++mi) {
        ptx::mma_16816<Cfg::kBf16>(acc[mi][2 * dp], pp[mi][kk], bv[0], bv[1]);
        ptx::mma_16816<Cfg::kBf16>(acc[mi][2 * dp + 1], pp[mi][kk], bv[2], bv[3]);
      }
    }
  }
}

// K (value = false) or V rows of sequence b (seq = p.seqs[b]) and KV head hk, contiguous or
// through the block table: the forward and permute_stop kernels read K/V only through this.
__device__ __forceinline__ KvRows kv_rows_of(const FwdParams& p, const SeqInfo& seq, int b, int hk, bool value) {
  const auto* base = static_cast<const std::uint16_t*>(value ? p.v : p.k) + (value ? seq.v_off : seq.k_off) +
                     hk * (value ? p.v_head_stride : p.k_head_stride);
  const std::int64_t stride = value ? p.v_row_stride : p.k_row_stride;
  if (p.paged.block_table == nullptr) return contiguous_rows(base, stride);
  return {base, stride, p.paged.block_table + b * p.paged.table_stride, p.paged.page_size,
          value ? p.paged.v_page_stride : p.paged.k_page_stride};
}

// kFeatures: the kernel of calls with a model-family feature (FwdParams: a local window, a
// softcap, learned sinks; launch_fwd picks it; the ungated instances only, check_support): its
// geometry and element masks read the window, its scores are capped, its rows finalised with
// their head's sink. The feature-free kernel takes every feature as absent at compile time, so
// it compiles as it did before they ran (the same SASS: record
// 2026-12-02-cpu-window-kernels-sass).
template <class Cfg, bool kFeatures>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks) fwd_kernel(const __grid_constant__ FwdParams p) {
  using Tile = typename Cfg::Tile;
  using TileV = typename Cfg::TileV;
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kD = Cfg::kHeadDim, kDV = Cfg::kHeadDimV;
  constexpr int kM = Cfg::kM, kNFrags = Cfg::kNFrags, kDFrags = Cfg::kDFrags;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ std::uint16_t s_chunks[kMaxMeanChunks];  // mean-correction tiles to visit (16-bit: kSmemBytes)
  __shared__ int s_num_chunks;
  static_assert(kMaxMeanChunks <= 65536, "16-bit tile indices");
  static_assert((sizeof(s_chunks) + sizeof(s_num_chunks) + 127) / 128 * 128 <= Cfg::kStaticSmemBytes,
                "the static shared memory FwdConfig counts on");

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;  // accumulator row (and row + 8) and column pair

  // Work tile in the order kv_major_grid (plan.h) chose: the last query blocks (the longest
  // under causal) start first either way.
  const auto gt = geom::grid_tile(static_cast<int>(blockIdx.x), p.h_q, p.group, p.batch, p.num_q_blocks, p.kv_major);
  const int h = gt.unit, b = gt.b, qb_rev = gt.tile_rev;
  const int hk = h / p.group;
  const SeqInfo seq = p.seqs[b];
  const geom::SeqGeometry rows{seq.s_q,
                               seq.s_k,
                               p.causal,
                               kFeatures ? p.window_left : -1,
                               kFeatures ? p.window_right : -1,
                               kFeatures ? p.attention_chunk : 0};
  const geom::BlockGeometry geo{rows, kBlockM, p.block_k};
  if (qb_rev >= geo.num_q_blocks()) return;
  const int qb = geo.num_q_blocks() - 1 - qb_rev;
  const std::int64_t row0 = geo.row_begin(qb);
  const int rows_valid = static_cast<int>(geo.row_end(qb) - row0);
  const int warp_row = warp * 16 * kM;  // the warp's first row in the query block

  const std::uint32_t s_q_tile = ptx::smem_addr(smem);
  const std::uint32_t s_k_tile = s_q_tile + Cfg::kQBytes;       // 2 stages
  const std::uint32_t s_v_tile = s_k_tile + 2 * Cfg::kKVBytes;  // 1 slot, or 2 gated
  // Thread-private stash in the V slots: float4 i of thread tid at (i · kThreads + tid) · 16.
  auto* stash = reinterpret_cast<float4*>(smem + Cfg::kQBytes + 2 * Cfg::kKVBytes);

  // ---- visit list
  const std::int64_t mask_row = mask_row_of(p, b, h, qb);
  const VisitList visit = make_visit_list(p, geo, qb, mask_row);
  // Mean-correction tiles: chunks of kMeanChunk consecutive pooled blocks holding at least one
  // block marked in this row's bitmap.
  const bool means = p.mode == PolicyMode::kBlockMask && p.k_mean != nullptr;
  const int mean_blocks_seq = means ? mean_blocks_of(p, seq.s_k) : 0;
  const std::uint32_t* mean_bits = means ? p.corrected_bits + mask_row * p.corrected_words : nullptr;
  if (means && warp == 0) {
    const int count = collect_mean_tiles<kMeanChunk>(p, mean_bits, mean_blocks_seq, lane, s_chunks);
    if (lane == 0) s_num_chunks = count;
  }
  // Published by the first __syncthreads below (before any thread reads them).

  // ---- per-CTA policy constants
  const Gate gate = make_gate(p, geo, qb, h);
  std::uint32_t* kept_row = kept_row_of(p, b, h, qb);

  // The thread's rows r = 2·mi + (e / 2) are query-block rows warp_row + 16·mi + g + 8·(e / 2).
  auto row_of = [&](int r) { return warp_row + 16 * (r / 2) + g + 8 * (r % 2); };
  auto row_ok = [&](int r) { return row_of(r) < rows_valid; };

  auto kv_rows = [&](bool value) { return kv_rows_of(p, seq, b, hk, value); };
  // Row 0 of this (b, hk)'s pooled K and V blocks, [b, h_kv, mean_blocks, d] and [.., d_v].
  const std::int64_t mean_base = (static_cast<std::int64_t>(b) * p.h_kv + hk) * p.mean_blocks * static_cast<std::int64_t>(kD);
  const std::int64_t mean_base_v =
      kDV == kD ? mean_base : (static_cast<std::int64_t>(b) * p.h_kv + hk) * p.mean_blocks * static_cast<std::int64_t>(kDV);

  // 64-key sub-tiles of visit position j: one or two for a key block, one for a mean tile.
  auto num_sub = [&](int j) -> int {
    if (!Cfg::kPlain && j >= visit.n_reg) return 1;
    const int kb = visit.block(j);
    return static_cast<int>(geom::ceil_div(geo.key_end(kb) - geo.key_begin(kb), kBlockN));
  };
  // Source of the K (value = false) or V sub-tile `sub` of position j.
  auto sub_src = [&](int j, int sub, bool value) -> TileSrc {
    if (Cfg::kPlain || j < visit.n_reg) {
      const int kb = visit.block(j);
      const std::int64_t key0 = geo.key_begin(kb) + sub * kBlockN;
      const std::int64_t valid = geom::min64(kBlockN, geo.key_end(kb) - key0);
      KvRows rows = kv_rows(value);
      if constexpr (Cfg::kPlain) rows = contiguous_rows(rows.base, rows.row_stride);
      return tile_src(rows, key0, static_cast<int>(valid));
    }
    const int c = s_chunks[j - visit.n_reg];
    const auto* mean = static_cast<const std::uint16_t*>(value ? p.v_mean : p.k_mean);
    const int valid = mean_blocks_seq - c * kMeanChunk;
    const int d = value ? kDV : kD;
    return {contiguous_rows(mean + (value ? mean_base_v : mean_base) + static_cast<std::int64_t>(c) * kMeanChunk * d, d), 0,
            valid < kMeanChunk ? valid : kMeanChunk};
  };

  // ---- prologue: Q and the first K sub-tile in one group.
  {
    const TileSrc q_src{contiguous_rows(static_cast<const std::uint16_t*>(p.q) + seq.q_off + h * p.q_head_stride, p.q_row_stride),
                        row0, rows_valid};
    load_tile<Tile, kBlockM>(s_q_tile, q_src, tid);
  }
  __syncthreads();  // publishes s_chunks / s_num_chunks
  const int n_visit = visit.n_reg + (means ? s_num_chunks : 0);
  if (n_visit > 0) load_tile<Tile, kBlockN>(s_k_tile, sub_src(0, 0, false), tid);
  ptx::cp_async_commit();

  float acc[kM][kDFrags][4];
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int df = 0; df < kDFrags; ++df) acc[mi][df][0] = acc[mi][df][1] = acc[mi][df][2] = acc[mi][df][3] = 0.f;
  }
  RowStats<kM> st;
  init_row_stats(st);
  float s[kM][kNFrags][4];  // raw scores of the current sub-tile

  // S = Q·K(stage)ᵀ for the warp's 16·kM rows.
  auto compute_scores = [&](int stage) {
    warp_scores<Cfg>(s_q_tile, s_k_tile + stage * Cfg::kKVBytes, warp_row, lane, s);
  };

  // Element masks of sub-tile `sub` of position j: the causal diagonal band, a local window's
  // bands and the sequence's last, short key block for key blocks; the marked pooled blocks for
  // mean tiles. Rows past s_q are left alone (never stored, excluded from the gates). Blocks below
  // full_end are full (geo.is_full; its 64-bit division by block_k hoisted out of the loop: ptxas
  // recomputed it per sub-tile, a CALL or an I2F/F2I sequence between Q·Kᵀ and the softmax; dense
  // 3–7% faster, records 2026-11-30-h200-portable-path-forced and -full-end-hoisted) but for a
  // left window bound's lower band, which the kFeatures kernel tests per block (full_below_end:
  // computing full_begin per CTA instead spilled 36 / 32 more bytes, sm_80 d = 128). Only the
  // ungated instances' kFeatures kernel compiles window code (check_support: dense and block masks).
  const int full_end = geo.full_end(qb);
  const bool window_below = kFeatures && geo.seq.left_bounded();
  // Chunks: a row's chunk begins at position(row0) + chunk_begin_after(phase, row), the phase
  // computed once per CTA (a 64-bit division per row spilled the kFeatures kernel: 40 -> 224
  // bytes at d = 128, and slowed windows 7%).
  const bool chunked = kFeatures && geo.seq.chunk > 0;
  const int chunk_phase = chunked ? geo.seq.chunk_phase(geo.seq.position(row0)) : 0;
  auto mask_scores = [&](int j, int sub) {
    if (Cfg::kPlain || j < visit.n_reg) {
      const int kb = visit.block(j);
      const std::int64_t key0 = geo.key_begin(kb) + sub * kBlockN;
      const std::int64_t key_end = geo.key_end(kb);
      if (kb < full_end && key0 + kBlockN <= key_end && (!window_below || geo.full_below_end(qb, kb, chunk_phase))) return;
      // Column limit per row: the last key the row sees (its position + reach under causal or
      // a right window bound: SeqGeometry::last_key_at; always before the block's end),
      // relative to the sub-tile, clamped to [-1, kBlockN].
      const std::int64_t end_limit = key_end - 1 - key0;
      const std::int64_t reach = geo.seq.reach();
      const std::int64_t diag = row0 + geo.seq.offset() - key0;  // + row: the row's position
      int limit[2 * kM];
#pragma unroll
      for (int r = 0; r < 2 * kM; ++r) {
        const std::int64_t lim = !kFeatures ? (p.causal ? geom::min64(diag + row_of(r), end_limit) : end_limit)
                                 : reach >= 0 ? geom::min64(diag + reach + row_of(r), end_limit)
                                              : end_limit;
        limit[r] = static_cast<int>(geom::min64(geom::max64(lim, -1), kBlockN));
      }
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (nf * 8 + 2 * t4 + (e & 1) > limit[2 * mi + e / 2]) s[mi][nf][e] = -INFINITY;
          }
        }
      }
      // A left window bound: columns before the row's first key (SeqGeometry::first_key_at),
      // clamped to [0, kBlockN]. A row whose range is empty has first > last, so the two
      // masks together hide every column from it.
      if (window_below && geo.seq.window_left >= 0) {
        // first_key_at(a) = max(a - window_left, 0), relative to the sub-tile: the row's offset
        // plus one 32-bit base (rows span kBlockM positions, so it is clamped to that range).
        const int base = static_cast<int>(geom::min64(geom::max64(diag - geo.seq.window_left, -kBlockM), kBlockN));
        int first[2 * kM];
#pragma unroll
        for (int r = 0; r < 2 * kM; ++r) first[r] = min(max(base + row_of(r), 0), kBlockN);
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if (nf * 8 + 2 * t4 + (e & 1) < first[2 * mi + e / 2]) s[mi][nf][e] = -INFINITY;
            }
          }
        }
      }
      // Chunks: columns outside the row's chunk (SeqGeometry::first_key_at / last_key_at),
      // apart from the window's masks above so that a window-only call's registers stay as
      // they were (one loop for both spilled 24 -> 104 bytes, sm_90 d = 128); the chunk begins
      // at diag + chunk_begin_after(chunk_phase, row).
      if (chunked) {
        int lo[2 * kM], hi[2 * kM];
#pragma unroll
        for (int r = 0; r < 2 * kM; ++r) {
          const std::int64_t c0 = diag + geo.seq.chunk_begin_after(chunk_phase, row_of(r));
          lo[r] = static_cast<int>(geom::min64(geom::max64(c0, 0), kBlockN));
          hi[r] = static_cast<int>(geom::min64(geom::max64(c0 + geo.seq.chunk - 1, -1), kBlockN));
        }
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
          for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int col = nf * 8 + 2 * t4 + (e & 1);
              if (col < lo[2 * mi + e / 2] || col > hi[2 * mi + e / 2]) s[mi][nf][e] = -INFINITY;
            }
          }
        }
      }
      return;
    }
    mask_mean_tile(p, s, mean_bits, s_chunks[j - visit.n_reg], seq.s_k, mean_blocks_seq);
  };

  // O += P·V(slot) for the warp's rows.
  auto pv = [&](int slot, const std::uint32_t (&pp)[kM][Cfg::kPSteps][4]) {
    warp_pv<Cfg>(s_v_tile + slot * Cfg::kVBytes, lane, pp, acc);
  };

  // Ungated instances compile no gated block (the code after the ungated branch is dead there).
  auto gated = [&](int j) { return Cfg::kGated && gate.gated(j, visit.n_a); };
  // The gate of a block from its row maxima over all its sub-tiles, as one CTA-wide vote.
  auto vote = [&](const float (&mx)[2 * kM]) -> bool {
    bool keep = false;
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) keep |= gate.keeps_row(mx[r], st.m[r], row_ok(r), p.scale, p.scale_log2);
    return __syncthreads_or(keep) != 0;
  };
  auto record = [&](int j) {
    if (kept_row != nullptr && tid == 0 && j < visit.n_reg) record_kept(kept_row, visit.block(j));
  };

  // ---- main loop over positions. Invariant at the top of each sub-tile: the only cp.async
  // group in flight is the current K sub-tile's (in stage `stage`).
  int stage = 0;
  for (int j = 0; j < n_visit; ++j) {
    const int n_sub = num_sub(j);
    // Issues the K sub-tile after (j, sub) into the other stage; commits always, so that the
    // group counts of the waits below hold at the end of the list too. One load_tile site, not
    // one per case: 10% less SASS (6024 against 6728 instructions at d = 128, sm_90) and spills
    // of 60 / 88 bytes against 88 / 180 (record 2026-11-30-h200-portable-dense-whole-tiles).
    auto prefetch_next_k = [&](int sub) {
      const bool same = sub + 1 < n_sub;
      const int nj = same ? j : j + 1;
      if (nj < n_visit) load_tile<Tile, kBlockN>(s_k_tile + (stage ^ 1) * Cfg::kKVBytes, sub_src(nj, same ? sub + 1 : 0, false), tid);
      ptx::cp_async_commit();
    };

    if (!gated(j)) {
      // Every sub-tile is an independent online-softmax step (FlashAttention-2 order): V and the
      // next K load while Q·Kᵀ and the softmax run.
      for (int sub = 0; sub < n_sub; ++sub) {
        ptx::cp_async_wait<0>();  // K(j, sub) has landed for this thread...
        __syncthreads();          // ...for all; and every warp is done with the previous
                                  // sub-tile (its Q·Kᵀ read the other K stage, its P·V the V slot)
        load_tile<TileV, kBlockN>(s_v_tile, sub_src(j, sub, true), tid);
        ptx::cp_async_commit();  // group V(j, sub)
        prefetch_next_k(sub);    // group K(next)
        compute_scores(stage);
        if constexpr (kFeatures) {
          if (p.softcap > 0.f) cap_scores(s, p.cap_scale, p.softcap);
        }
        mask_scores(j, sub);
        float mx[2 * kM], m_use[2 * kM];
        row_max(s, mx);
        // Lazy in the ungated instances (softmax.cuh, kLazyMaxLog2). The gated one's ungated
        // blocks stay exact: lazy there too (a second choice on gate.skip, whose vote reads the
        // exact running max) spilled 272 / 500 bytes against 196 / 364 at d = 128 (ptxas, sm_90).
        if constexpr (Cfg::kGated) {
          rescale(st, mx, p.scale_log2, acc, m_use);
        } else {
          rescale_lazy(st, mx, p.scale_log2, acc, m_use);
        }
        std::uint32_t pf[kM][Cfg::kPSteps][4];
        exp_pack<Cfg::kBf16>(s, m_use, p.scale_log2, st.l, pf);
        ptx::cp_async_wait<1>();  // V(j, sub) landed (K(next) may still be in flight)...
        __syncthreads();          // ...for every thread
        pv(0, pf);
        stage ^= 1;
      }
      record(j);
      continue;
    }

    // A gated block: the scores of all its sub-tiles, then one decision; V is loaded only for
    // a kept block, and a skipped block leaves m, l and O untouched.
    float mx_block[2 * kM];
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) mx_block[r] = -INFINITY;
    // One sub-tile's scores and their row maxima folded into the block's.
    auto gated_scores = [&](int sub) {
      ptx::cp_async_wait<0>();  // K(j, sub) landed for this thread...
      __syncthreads();          // ...for all; the V slots and the other K stage are free
      prefetch_next_k(sub);
      compute_scores(stage);
      mask_scores(j, sub);
      float mx[2 * kM];
      row_max(s, mx);
#pragma unroll
      for (int r = 0; r < 2 * kM; ++r) mx_block[r] = ptx::max_nan(mx_block[r], mx[r]);
      stage ^= 1;
    };
    gated_scores(0);
    if (n_sub == 2) {
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf) {
          stash[(mi * kNFrags + nf) * Cfg::kThreads + tid] = make_float4(s[mi][nf][0], s[mi][nf][1], s[mi][nf][2], s[mi][nf][3]);
        }
      }
      gated_scores(1);
    }
    if (!vote(mx_block)) continue;  // the vote's barrier: every thread agrees

    float m_use[2 * kM];
    // exact_gate's vote reads thresholds, not m: lazy as the ungated instances; softmax_skip's
    // reads the running max itself, which must stay exact.
    if (gate.skip) {
      rescale(st, mx_block, p.scale_log2, acc, m_use);
    } else {
      rescale_lazy(st, mx_block, p.scale_log2, acc, m_use);
    }
    // P of the first sub-tile, from the stash. At d = 128 it is parked thread-private in the K
    // stage the second sub-tile was read from (free after the vote; the next K streams into the
    // other stage), so that at most one P tile is ever live in registers.
    auto* park = reinterpret_cast<uint4*>(smem + Cfg::kQBytes + (stage ^ 1) * Cfg::kKVBytes);
    std::uint32_t p_first[kM][Cfg::kPSteps][4];
    if (n_sub == 2) {
#pragma unroll
      for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
        for (int kk = 0; kk < Cfg::kPSteps; ++kk) {
          std::uint32_t a[4];
#pragma unroll
          for (int h2 = 0; h2 < 2; ++h2) {
            const float4 v = stash[(mi * kNFrags + 2 * kk + h2) * Cfg::kThreads + tid];
            float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              e[i] = ptx::exp2f_fast(fmaf(e[i], p.scale_log2, -m_use[2 * mi + i / 2]));
              st.l[2 * mi + i / 2] += e[i];
            }
            a[2 * h2] = ptx::pack2<Cfg::kBf16>(e[0], e[1]);
            a[2 * h2 + 1] = ptx::pack2<Cfg::kBf16>(e[2], e[3]);
          }
          if constexpr (Cfg::kParkInSmem) {
            park[(mi * Cfg::kPSteps + kk) * Cfg::kThreads + tid] = make_uint4(a[0], a[1], a[2], a[3]);
          } else {
            p_first[mi][kk][0] = a[0], p_first[mi][kk][1] = a[1], p_first[mi][kk][2] = a[2], p_first[mi][kk][3] = a[3];
          }
        }
      }
      __syncthreads();  // every thread has read its stash before V overwrites the slots
    }
    for (int sub = 0; sub < n_sub; ++sub) load_tile<TileV, kBlockN>(s_v_tile + sub * Cfg::kVBytes, sub_src(j, sub, true), tid);
    ptx::cp_async_commit();  // V of the kept block, overlapping the last sub-tile's softmax
    std::uint32_t p_last[kM][Cfg::kPSteps][4];
    exp_pack<Cfg::kBf16>(s, m_use, p.scale_log2, st.l, p_last);
    ptx::cp_async_wait<0>();  // V of the block (and the next K, issued long before) landed...
    __syncthreads();          // ...for every thread
    pv(n_sub - 1, p_last);
    if (n_sub == 2) {
      if constexpr (Cfg::kParkInSmem) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
          for (int kk = 0; kk < Cfg::kPSteps; ++kk) {
            const uint4 a = park[(mi * Cfg::kPSteps + kk) * Cfg::kThreads + tid];
            p_first[mi][kk][0] = a.x, p_first[mi][kk][1] = a.y, p_first[mi][kk][2] = a.z, p_first[mi][kk][3] = a.w;
          }
        }
      }
      pv(0, p_first);
    }
    record(j);
  }

  // ---- epilogue: O = acc / l through smem (the Q tile; each warp reads and writes only its own
  // rows of it) as 16-byte row stores; LSE by the first thread of each quad.
  float o_scale[2 * kM], lse[2 * kM];
#pragma unroll
  for (int r = 0; r < 2 * kM; ++r) {
    if constexpr (kFeatures) {
      finalize_row_sink(st.m[r], st.l[r], head_sink_log2(p.sinks, p.sinks_stride, h), &o_scale[r], &lse[r]);
    } else {
      finalize_row(st.m[r], st.l[r], &o_scale[r], &lse[r]);
    }
  }
  // A query block with nothing to visit (every row sees no key, or the mask selects none)
  // never waited for its Q load, whose rows any thread may have copied: it must land for all
  // before zeros are staged over it, or it overwrites them (rows of Q came out as O:
  // FlashAttention-3's kvcache test, pages of 1). After a visit the loop has waited for it.
  if (n_visit == 0) {
    ptx::cp_async_wait<0>();
    __syncthreads();
  }
  __syncwarp();  // the warp's last Q fragment reads are done before its rows are overwritten
  auto* s_o = reinterpret_cast<std::uint32_t*>(smem);
#pragma unroll
  for (int mi = 0; mi < kM; ++mi) {
#pragma unroll
    for (int df = 0; df < kDFrags; ++df) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int r = warp_row + 16 * mi + g + 8 * i;
        const std::uint32_t byte = swizzle<Tile>(r, df) + t4 * 4;
        const float sc = o_scale[2 * mi + i];
        s_o[byte / 4] = ptx::pack2<Cfg::kBf16>(acc[mi][df][2 * i] * sc, acc[mi][df][2 * i + 1] * sc);
      }
    }
  }
  __syncwarp();  // each warp stores only the rows it wrote
  auto* o_base = static_cast<std::uint16_t*>(p.o) + seq.o_off + row0 * p.o_row_stride + h * p.o_head_stride;
  // O's rows have d_v values: TileV's data chunks, in Q's tile (its pitch, d_v <= d).
  static_assert(16 * kM * TileV::kDataChunks % 32 == 0, "whole rounds of the warp's chunk stores");
  static_assert(kDV <= kD, "O is staged in Q's tile");
#pragma unroll
  for (int i = 0; i < 16 * kM * TileV::kDataChunks / 32; ++i) {
    const int idx = lane + 32 * i;
    const int r = warp_row + idx / TileV::kDataChunks, c = idx % TileV::kDataChunks;
    if (r < rows_valid) {
      const uint4 val = *reinterpret_cast<const uint4*>(smem + swizzle<Tile>(r, c));
      *reinterpret_cast<uint4*>(o_base + r * p.o_row_stride + c * 8) = val;
    }
  }
  if (p.lse != nullptr && t4 == 0) {
#pragma unroll
    for (int r = 0; r < 2 * kM; ++r) {
      if (row_ok(r)) {
        const std::int64_t row = row0 + row_of(r);
        p.lse[seq.lse_off + h * p.lse_head_stride + row * p.lse_row_stride] = lse[r];
      }
    }
  }
}

// Host-side launch of one instance; returns a cudaError_t value (0 = success).
template <class Cfg>
int launch_fwd(const FwdParams& p, void* stream) {
  if (Cfg::kGated != gated_mode(p.mode)) return static_cast<int>(cudaErrorInvalidValue);  // the other instance's call
  if (Cfg::kPlain && !plain_call(p)) return static_cast<int>(cudaErrorInvalidValue);      // the general one's
  // The model-family features only where they are compiled: the ungated instances' kFeatures
  // kernel, without mean correction (check_support; make_fwd_params passes a window only where
  // it hides keys).
  const bool features = has_features(p);
  if (features && (Cfg::kGated || p.k_mean != nullptr)) return static_cast<int>(cudaErrorInvalidValue);
  auto* kernel = fwd_kernel<Cfg, false>;
  if constexpr (!Cfg::kGated) {
    if (features) kernel = fwd_kernel<Cfg, true>;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  // One CTA per (query block, batch, query head): the plan's portable_grid.
  if (p.grid <= 0) return 0;
  kernel<<<static_cast<unsigned>(p.grid), Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm80
