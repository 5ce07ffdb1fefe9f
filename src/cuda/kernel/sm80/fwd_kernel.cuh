// SPDX-License-Identifier: Apache-2.0
// The portable forward attention kernel (mma.sync m16n8k16, ldmatrix, cp.async; sm_80 and
// newer): one CTA per (query block of 128 rows, batch, query head), online softmax over the
// key blocks a policy selects, in-loop gates (exact_gate, softmax_skip), block-mask execution
// and mean-correction pseudo-tokens. Included only by generated instance files.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/softmax.cuh"

namespace sparseprefill::cuda::sm80 {

// Compile-time shape of one instance. Tile values never change results: kBlockM is the
// block_q every policy uses on CUDA, kBlockN the block_k the instance serves (a gate decides
// on a whole block, so the score tile must span one).
template <bool kBf16_, int kHeadDim_, int kBlockN_>
struct FwdConfig {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockQ;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = 8;  // each warp owns 16 query rows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kChunks = kHeadDim / 8;     // 16-byte chunks per smem row
  static constexpr int kNFrags = kBlockN / 8;      // n8 fragments of a score row
  static constexpr int kDFrags = kHeadDim / 8;     // n8 fragments of an output row
  static constexpr int kKSteps = kHeadDim / 16;    // k16 steps of Q·Kᵀ
  static constexpr int kPSteps = kBlockN / 16;     // k16 steps of P·V
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKVBytes = kBlockN * kHeadDim * 2;  // one K or V stage
  // Q (reused for the O epilogue), K double-buffered, V double-buffered.
  static constexpr int kSmemBytes = kQBytes + 4 * kKVBytes;
  // Q fragments stay in registers when the per-thread tiles leave room (S + P + O + Q <= 160
  // registers; ptxas -v in docs/cuda.md); otherwise they are re-read from smem each k-step.
  static constexpr bool kQInRegs = kBlockN / 2 + kBlockN / 4 + kHeadDim / 2 + kHeadDim / 4 <= 160;

  static_assert(kBlockM == kWarps * 16, "one m16 row fragment per warp");
  static_assert(kHeadDim % 64 == 0, "the XOR swizzle needs at least 8 chunks per row");
  static_assert(kBlockN % 32 == 0, "K is read as pairs of n8 fragments; bitmaps by 32");
  static_assert((kBlockN * kChunks) % kThreads == 0, "K/V tiles split evenly over threads");
  static_assert((kBlockM * kChunks) % kThreads == 0, "the Q tile splits evenly over threads");
};

// Byte offset of 16-byte chunk c of row r in a [rows, kHeadDim] 16-bit smem tile. Chunks are
// XOR-swizzled by r % 8 so that the 8 rows an ldmatrix phase reads (and the 8 chunks a
// cp.async phase writes) fall in 8 different 16-byte bank groups: conflict-free.
template <class Cfg>
__device__ __forceinline__ std::uint32_t swizzle(int r, int c) {
  return static_cast<std::uint32_t>(r * Cfg::kHeadDim * 2 + ((c ^ (r & 7)) << 4));
}

// Where one K/V (or mean) tile comes from: kRows rows of head_dim elements at `ptr` with
// `stride` elements between rows, of which the first `valid` exist (the rest are zero-filled).
struct TileSrc {
  const std::uint16_t* ptr;
  std::int64_t stride;
  int valid;
};

// Asynchronously copies a [kRows, kHeadDim] tile into swizzled smem; rows >= valid become
// zeros without reading global memory. The caller commits the group. Thread tid copies chunk
// tid % kChunks of rows tid / kChunks + i·kRowStep: the row step is a multiple of 8, so the
// swizzled chunk is the same for every i and addresses advance by constants.
template <class Cfg, int kRows>
__device__ __forceinline__ void load_tile(std::uint32_t smem, const TileSrc& src, int tid) {
  constexpr int kRowStep = Cfg::kThreads / Cfg::kChunks;
  static_assert(kRowStep % 8 == 0 && kRows % kRowStep == 0, "constant swizzle per thread");
  const int r0 = tid / Cfg::kChunks, c = tid % Cfg::kChunks;
  const std::uint32_t dst = smem + swizzle<Cfg>(r0, c);
  const std::uint16_t* g = src.ptr + r0 * src.stride + c * 8;
#pragma unroll
  for (int i = 0; i < kRows / kRowStep; ++i) {
    const bool ok = r0 + i * kRowStep < src.valid;
    ptx::cp_async_16(dst + i * kRowStep * Cfg::kHeadDim * 2, ok ? g + i * kRowStep * src.stride : src.ptr, ok ? 16 : 0);
  }
}

// The key blocks one CTA visits, in order: group A (never gated by exact_gate: the partial
// blocks, or non-causal the last key block), then group B (the full blocks), each descending,
// then the mean-correction tiles. Dense and the gates walk one descending range
// [0, a_hi); a block mask walks its partial list then its full list.
struct VisitList {
  int n_a = 0;        // group A entries
  int n_reg = 0;      // A + B entries (real key blocks)
  int a_hi = 0;       // range mode: first visited block + 1
  const std::int32_t* a_list = nullptr;  // mask mode: ascending partial indices (else null)
  const std::int32_t* b_list = nullptr;  // mask mode: ascending full indices

  __device__ __forceinline__ int block(int j) const {
    if (a_list == nullptr) return a_hi - 1 - j;
    return j < n_a ? a_list[n_a - 1 - j] : b_list[n_reg - 1 - j];
  }
};

template <class Cfg>
__global__ void __launch_bounds__(Cfg::kThreads, 1) fwd_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kBlockM = Cfg::kBlockM, kBlockN = Cfg::kBlockN, kD = Cfg::kHeadDim;
  constexpr int kNFrags = Cfg::kNFrags, kDFrags = Cfg::kDFrags;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int s_chunks[kMaxMeanChunks];  // mean-correction tiles to visit
  __shared__ int s_num_chunks;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t4 = lane % 4;  // accumulator row (and row + 8) and column pair

  // Work tile. Heads vary fastest so the query heads of one KV group run on adjacent CTAs and
  // share each K/V tile through L2; within a sequence the last query blocks (the longest under
  // causal) start first.
  int tile = blockIdx.x;
  const int h = tile % p.h_q;
  tile /= p.h_q;
  const int b = tile % p.batch;
  const int qb_rev = tile / p.batch;
  const SeqInfo seq = p.seqs[b];
  const geom::BlockGeometry geo{{seq.s_q, seq.s_k, p.causal}, kBlockM, kBlockN};
  if (qb_rev >= geo.num_q_blocks()) return;
  const int qb = geo.num_q_blocks() - 1 - qb_rev;
  const int hk = h / p.group;
  const std::int64_t row0 = geo.row_begin(qb);
  const int rows_valid = static_cast<int>(geo.row_end(qb) - row0);

  const std::uint32_t s_q_tile = ptx::smem_addr(smem);
  const std::uint32_t s_k_tile = s_q_tile + Cfg::kQBytes;                   // 2 stages
  const std::uint32_t s_v_tile = s_k_tile + 2 * Cfg::kKVBytes;              // 2 stages

  // ---- visit list
  VisitList visit;
  const int h_mask = p.mask_per_kv_head ? hk : h;
  const std::int64_t mask_row =
      (static_cast<std::int64_t>(b) * p.mask_heads + h_mask) * p.mask_q_blocks + qb;
  if (p.mode == PolicyMode::kBlockMask) {
    visit.n_a = p.partial_count[mask_row];
    visit.n_reg = visit.n_a + p.full_count[mask_row];
    visit.a_list = p.partial_index + (p.partial_start != nullptr ? p.partial_start[mask_row] : mask_row * p.mask_k_blocks);
    visit.b_list = p.full_index + (p.full_start != nullptr ? p.full_start[mask_row] : mask_row * p.mask_k_blocks);
  } else {
    visit.a_hi = geo.visible_end(qb);
    // Causal: the partial blocks [full_end, visible_end). Non-causal: every block is full and
    // the last one is the forced one.
    const int a_lo = p.causal ? geo.full_end(qb) : geo.visible_end(qb) - 1;
    visit.n_a = visit.a_hi - (a_lo < 0 ? 0 : a_lo);
    visit.n_reg = visit.a_hi;
  }
  // Mean-correction tiles: chunks of kBlockN consecutive pooled blocks holding at least one
  // block marked in this row's bitmap.
  const bool means = p.mode == PolicyMode::kBlockMask && p.k_mean != nullptr;
  const int mean_blocks_seq = means ? static_cast<int>(geom::ceil_div(seq.s_k, p.mean_block)) : 0;
  if (means && warp == 0) {
    const std::uint32_t* bits = p.corrected_bits + mask_row * p.corrected_words;
    const int chunks = (mean_blocks_seq + kBlockN - 1) / kBlockN;
    int count = 0;
    for (int c0 = 0; c0 < chunks; c0 += 32) {
      const int c = c0 + lane;
      bool any = false;
      if (c < chunks) {
#pragma unroll
        for (int w = 0; w < kBlockN / 32; ++w) {
          const int word = c * (kBlockN / 32) + w;
          any |= word < p.corrected_words && bits[word] != 0u;
        }
      }
      const unsigned ballot = __ballot_sync(0xffffffffu, any);
      if (any) s_chunks[count + __popc(ballot & ((1u << lane) - 1u))] = c;
      count += __popc(ballot);
    }
    if (lane == 0) s_num_chunks = count;
  }
  // Published by the first __syncthreads below (before any thread reads them).

  // ---- per-CTA policy constants
  const bool exact_gate = p.mode == PolicyMode::kExactGate;
  const bool skip_gate = p.mode == PolicyMode::kSoftmaxSkip && !(static_cast<float>(seq.s_k) < p.skip_a);
  float threshold = 0.f;
  if (exact_gate) {
    const int pos = geo.threshold_position(qb, p.thr_positions);
    threshold = p.thresholds[h * p.thr_head_stride + pos * p.thr_pos_stride];
  }
  // log2 λ = log2(a / s_k): the BLASST test in the exp2 domain of the running max.
  const float log2_lambda = skip_gate ? __log2f(p.skip_a / static_cast<float>(seq.s_k)) : 0.f;
  std::uint32_t* kept_row =
      p.kept_bits == nullptr
          ? nullptr
          : p.kept_bits + ((static_cast<std::int64_t>(b) * p.h_q + h) * p.num_q_blocks + qb) * p.kept_words;

  const bool row_ok[2] = {warp * 16 + g < rows_valid, warp * 16 + g + 8 < rows_valid};
  // The last key each of the thread's two rows sees (-1: none).
  const std::int64_t last_key[2] = {geo.seq.last_key(row0 + warp * 16 + g), geo.seq.last_key(row0 + warp * 16 + g + 8)};

  const auto* k_base = static_cast<const std::uint16_t*>(p.k) + seq.k_off + hk * p.k_head_stride;
  const auto* v_base = static_cast<const std::uint16_t*>(p.v) + seq.v_off + hk * p.v_head_stride;
  const std::int64_t mean_base =
      (static_cast<std::int64_t>(b) * p.h_kv + hk) * p.mean_blocks * static_cast<std::int64_t>(kD);

  // Source of the K (value = false) or V tile of visit position j (a key block, or a tile of
  // pooled means after the real blocks).
  auto tile_src = [&](int j, bool value) -> TileSrc {
    if (j < visit.n_reg) {
      const int kb = visit.block(j);
      const std::int64_t stride = value ? p.v_row_stride : p.k_row_stride;
      const std::uint16_t* base = value ? v_base : k_base;
      return {base + geo.key_begin(kb) * stride, stride, static_cast<int>(geo.key_end(kb) - geo.key_begin(kb))};
    }
    const int c = s_chunks[j - visit.n_reg];
    const auto* mean = static_cast<const std::uint16_t*>(value ? p.v_mean : p.k_mean);
    const int valid = mean_blocks_seq - c * kBlockN;
    return {mean + mean_base + static_cast<std::int64_t>(c) * kBlockN * kD, kD, valid < kBlockN ? valid : kBlockN};
  };

  // ---- prologue: Q and K(0) in group 0, K(1) in group 1.
  {
    const TileSrc q_src{static_cast<const std::uint16_t*>(p.q) + seq.q_off + row0 * p.q_row_stride + h * p.q_head_stride,
                        p.q_row_stride, rows_valid};
    load_tile<Cfg, kBlockM>(s_q_tile, q_src, tid);
  }
  __syncthreads();  // publishes s_chunks / s_num_chunks
  const int n_visit = visit.n_reg + (means ? s_num_chunks : 0);
  if (n_visit > 0) load_tile<Cfg, kBlockN>(s_k_tile, tile_src(0, false), tid);
  ptx::cp_async_commit();
  if (n_visit > 1) load_tile<Cfg, kBlockN>(s_k_tile + Cfg::kKVBytes, tile_src(1, false), tid);
  ptx::cp_async_commit();
  ptx::cp_async_wait<1>();  // Q and K(0) have landed for this thread...
  __syncthreads();          // ...and for every thread

  // Q as A fragments of the warp's 16 rows (head dims kk·16 + {0..7, 8..15} by lane / 16).
  auto load_q_frag = [&](int kk, std::uint32_t (&a)[4]) {
    ptx::ldmatrix_x4(s_q_tile + swizzle<Cfg>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4)), a);
  };
  std::uint32_t qf[Cfg::kQInRegs ? Cfg::kKSteps : 1][4];
  if constexpr (Cfg::kQInRegs) {
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) load_q_frag(kk, qf[kk]);
  }

  float acc[kDFrags][4];
#pragma unroll
  for (int df = 0; df < kDFrags; ++df) acc[df][0] = acc[df][1] = acc[df][2] = acc[df][3] = 0.f;
  RowStats st;
  init_row_stats(st);
  float s[kNFrags][4];              // scores of the look-ahead position (raw q·k)
  std::uint32_t pf[Cfg::kPSteps][4];  // P of the current position, A fragments
  float mx[2];

  // S = Q·K(j)ᵀ from K stage `stage`, masked, and the row maxima.
  auto compute_scores = [&](int j, int stage) {
#pragma unroll
    for (int nf = 0; nf < kNFrags; ++nf) s[nf][0] = s[nf][1] = s[nf][2] = s[nf][3] = 0.f;
    const std::uint32_t k_stage = s_k_tile + stage * Cfg::kKVBytes;
#pragma unroll
    for (int kk = 0; kk < Cfg::kKSteps; ++kk) {
      std::uint32_t qa[4];
      if constexpr (Cfg::kQInRegs) {
        qa[0] = qf[kk][0], qa[1] = qf[kk][1], qa[2] = qf[kk][2], qa[3] = qf[kk][3];
      } else {
        load_q_frag(kk, qa);
      }
#pragma unroll
      for (int np = 0; np < kNFrags / 2; ++np) {
        std::uint32_t bk[4];
        // Keys np·16 + {0..7, 8..15} (lane / 16), head dims kk·16 + {0..7, 8..15} ((lane / 8) % 2).
        ptx::ldmatrix_x4(k_stage + swizzle<Cfg>(np * 16 + (lane >> 4) * 8 + (lane & 7), kk * 2 + ((lane >> 3) & 1)), bk);
        ptx::mma_16816<Cfg::kBf16>(s[2 * np], qa, bk[0], bk[1]);
        ptx::mma_16816<Cfg::kBf16>(s[2 * np + 1], qa, bk[2], bk[3]);
      }
    }
    if (j < visit.n_reg) {
      const int kb = visit.block(j);
      // Element mask only where needed: the causal diagonal band and the sequence's last,
      // short key block. Rows past s_q are left alone (never stored, excluded from gates).
      if (!geo.is_full(qb, kb) || geo.key_end(kb) - geo.key_begin(kb) < kBlockN) {
        // Column limit per row: the last key the row sees, relative to the block, clamped.
        int limit[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          limit[i] = static_cast<int>(geom::min64(geom::max64(last_key[i] - geo.key_begin(kb), -1), kBlockN));
        }
#pragma unroll
        for (int nf = 0; nf < kNFrags; ++nf) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (nf * 8 + 2 * t4 + (e & 1) > limit[e / 2]) s[nf][e] = -INFINITY;
          }
        }
      }
    } else {
      // Pooled blocks: a marked block j adds one pseudo-token of weight n_j, i.e. score
      // s̄ + ln n_j; stored here as a raw score shifted by log2(n_j) / scale_log2 so that the
      // softmax's exp2(raw · scale_log2 - m) yields n_j · e^{s̄ - max}. Unmarked: -inf.
      const int c = s_chunks[j - visit.n_reg];
      const std::uint32_t* bits = p.corrected_bits + mask_row * p.corrected_words + c * (kBlockN / 32);
      // Every pooled block holds mean_block keys except the sequence's last one.
      const int last = mean_blocks_seq - 1 - c * kBlockN;
      const float shift_full = __log2f(static_cast<float>(p.mean_block)) / p.scale_log2;
      const float shift_last =
          __log2f(static_cast<float>(seq.s_k - static_cast<std::int64_t>(mean_blocks_seq - 1) * p.mean_block)) / p.scale_log2;
#pragma unroll
      for (int w = 0; w < kBlockN / 32; ++w) {
        const std::uint32_t word = c * (kBlockN / 32) + w < p.corrected_words ? bits[w] : 0u;
#pragma unroll
        for (int nf = 4 * w; nf < 4 * w + 4; ++nf) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = nf * 8 + 2 * t4 + (e & 1);
            const bool marked = (word >> (col % 32)) & 1u;  // never set past the last block
            s[nf][e] = marked ? s[nf][e] + (col == last ? shift_last : shift_full) : -INFINITY;
          }
        }
      }
    }
    row_max(s, mx);
  };

  // The gate of position j, as one CTA-wide vote; also the barrier after which every warp is
  // done reading the K stage of j. Ungated positions keep.
  auto decide = [&](int j) -> bool {
    bool vote = true;
    if (exact_gate && j >= visit.n_a) {
      // keep iff !(max s < T) over the valid rows: ties keep, T = -inf keeps, NaN keeps.
      vote = false;
#pragma unroll
      for (int i = 0; i < 2; ++i) vote |= row_ok[i] && !(mx[i] * p.scale < threshold);
    } else if (skip_gate && j > 0) {
      // BLASST per row: skip iff tile_max - m_run < ln λ. A row that sees no key of the block
      // (tile max -inf) skips, or has no say if it has seen none before either; a row seeing
      // its first keys keeps; NaN fails the strict test and keeps.
      vote = false;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float tmax = mx[i] * p.scale_log2;
        const bool keep_row = tmax != -INFINITY && (st.m[i] == -INFINITY || !(tmax - st.m[i] < log2_lambda));
        vote |= row_ok[i] && keep_row;
      }
    } else {
      __syncthreads();
      return true;
    }
    return __syncthreads_or(vote) != 0;
  };
  auto gated = [&](int j) { return (exact_gate && j >= visit.n_a) || (skip_gate && j > 0); };
  auto record = [&](int j) {
    if (kept_row != nullptr && tid == 0 && j < visit.n_reg) {
      const int kb = visit.block(j);
      atomicOr(kept_row + kb / 32, 1u << (kb % 32));
    }
  };

  if (n_visit > 0) {
    // ---- position 0
    if (!gated(0)) load_tile<Cfg, kBlockN>(s_v_tile, tile_src(0, true), tid);
    compute_scores(0, 0);
    bool keep_cur = decide(0);
    if (gated(0) && keep_cur) load_tile<Cfg, kBlockN>(s_v_tile, tile_src(0, true), tid);
    ptx::cp_async_commit();  // group V(0)
    if (n_visit > 2) load_tile<Cfg, kBlockN>(s_k_tile, tile_src(2, false), tid);
    ptx::cp_async_commit();  // group K(2)
    if (keep_cur) {
      record(0);
      online_softmax<Cfg::kBf16>(s, mx, p.scale_log2, st, acc, pf);
    }

    // ---- steady state. Step j: Q·K(j+1)ᵀ and its gate (the look-ahead), then P(j)·V(j), then
    // the softmax of j+1. Loads in flight at the top of step j: V(j), K(j+1), K(j+2).
    for (int j = 0; j < n_visit; ++j) {
      ptx::cp_async_wait<1>();  // all but the newest group (K(j+2)): V(j) and K(j+1) landed
      __syncthreads();          // for every thread; also every warp finished P·V(j-1)
      const bool has_next = j + 1 < n_visit;
      bool keep_next = false;
      if (has_next) {
        const int stage = (j + 1) & 1;
        const std::uint32_t v_stage = s_v_tile + stage * Cfg::kKVBytes;
        // V stage (j+1)%2 was last read by P·V(j-1), finished before the barrier above.
        if (!gated(j + 1)) load_tile<Cfg, kBlockN>(v_stage, tile_src(j + 1, true), tid);
        compute_scores(j + 1, stage);
        keep_next = decide(j + 1);  // barrier: K stage (j+1)%2 is free after this
        if (gated(j + 1) && keep_next) load_tile<Cfg, kBlockN>(v_stage, tile_src(j + 1, true), tid);
        ptx::cp_async_commit();  // group V(j+1)
        if (j + 3 < n_visit) load_tile<Cfg, kBlockN>(s_k_tile + stage * Cfg::kKVBytes, tile_src(j + 3, false), tid);
        ptx::cp_async_commit();  // group K(j+3)
      }
      if (keep_cur) {
        const std::uint32_t v_stage = s_v_tile + (j & 1) * Cfg::kKVBytes;
#pragma unroll
        for (int kk = 0; kk < Cfg::kPSteps; ++kk) {
#pragma unroll
          for (int dp = 0; dp < kDFrags / 2; ++dp) {
            std::uint32_t bv[4];
            // Keys kk·16 + {0..7, 8..15} ((lane / 8) % 2), head dims dp·16 + {0..7, 8..15} (lane / 16).
            ptx::ldmatrix_x4_trans(v_stage + swizzle<Cfg>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 2 + (lane >> 4)), bv);
            ptx::mma_16816<Cfg::kBf16>(acc[2 * dp], pf[kk], bv[0], bv[1]);
            ptx::mma_16816<Cfg::kBf16>(acc[2 * dp + 1], pf[kk], bv[2], bv[3]);
          }
        }
      }
      if (keep_next) {
        record(j + 1);
        online_softmax<Cfg::kBf16>(s, mx, p.scale_log2, st, acc, pf);
      }
      keep_cur = keep_next;
    }
  }

  // ---- epilogue: O = acc / l through smem (the Q stage, free since the prologue) as 16-byte
  // row stores; LSE by the first thread of each quad.
  float o_scale[2], lse[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    float l = st.l[i];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    finalize_row(st.m[i], l, &o_scale[i], &lse[i]);
  }
  auto* s_o = reinterpret_cast<std::uint32_t*>(smem);
#pragma unroll
  for (int df = 0; df < kDFrags; ++df) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = warp * 16 + g + 8 * i;
      const std::uint32_t byte = swizzle<Cfg>(r, df) + t4 * 4;
      s_o[byte / 4] = ptx::pack2<Cfg::kBf16>(acc[df][2 * i] * o_scale[i], acc[df][2 * i + 1] * o_scale[i]);
    }
  }
  __syncwarp();  // each warp stores only the 16 rows it wrote
  auto* o_base = static_cast<std::uint16_t*>(p.o) + seq.o_off + row0 * p.o_row_stride + h * p.o_head_stride;
#pragma unroll
  for (int i = 0; i < 16 * Cfg::kChunks / 32; ++i) {
    const int idx = lane + 32 * i;
    const int r = warp * 16 + idx / Cfg::kChunks, c = idx % Cfg::kChunks;
    if (r < rows_valid) {
      const uint4 val = *reinterpret_cast<const uint4*>(smem + swizzle<Cfg>(r, c));
      *reinterpret_cast<uint4*>(o_base + r * p.o_row_stride + c * 8) = val;
    }
  }
  if (p.lse != nullptr && t4 == 0) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (row_ok[i]) {
        const std::int64_t r = row0 + warp * 16 + g + 8 * i;
        p.lse[seq.lse_off + h * p.lse_head_stride + r * p.lse_row_stride] = lse[i];
      }
    }
  }
}

// Host-side launch of one instance; returns a cudaError_t value (0 = success).
template <class Cfg>
int launch_fwd(const FwdParams& p, void* stream) {
  auto* kernel = fwd_kernel<Cfg>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  const unsigned grid = static_cast<unsigned>(p.num_q_blocks) * static_cast<unsigned>(p.batch) *
                        static_cast<unsigned>(p.h_q);
  if (grid == 0) return 0;
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, static_cast<cudaStream_t>(stream)>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm80
