// SPDX-License-Identifier: Apache-2.0
// The Hopper (sm_90a) forward attention kernel: a TMA producer warp streams Q and 128-key K/V
// tiles through a 2-stage mbarrier pipeline (1 at d 256); two consumer warpgroups of 64 query
// rows each issue wgmma (S = Q·Kᵀ from shared memory, O += P·V with P in registers), overlap the
// softmax of tile j with the P·V of tile j-1 (but at d_v 256: kSerialPv) and take turns issuing
// (ping-pong). Every policy of the portable kernel with 128-key blocks: dense, block masks (with
// mean-correction tiles) and the exact_gate / softmax_skip gates, whose skipped blocks never
// have their V requested. Promoted from dev/fwd_sm90_dense.cu v3. Included only by generated
// instance files.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "core/geometry.h"
#include "cuda/kernel/fwd_params.h"
#include "cuda/kernel/launch_types.h"  // HostUpload, kUploadRefused
#include "cuda/kernel/policy.cuh"
#include "cuda/kernel/ptx.cuh"
#include "cuda/kernel/sm90/hopper.cuh"
#include "cuda/kernel/softmax.cuh"
#include "cuda/kernel/tuning.h"

namespace sparseprefill::cuda::sm90 {

// Compile-time shape of one instance. A CTA is one query block of kBlockQ = 128 rows: warpgroup
// 0 produces (one thread issues TMA), warpgroups 1 and 2 own rows 0..63 and 64..127. Tiles are
// [128 rows][d] loaded as boxes of [128 rows][128 bytes] (one 128-byte swizzle row each: 64
// 16-bit elements, 128 e4m3), ceil(d / 64) boxes a tile: a head dim that is not a multiple of
// 64 (96) is stored at the next one's width, its last box's columns past d zero-filled by TMA
// (out of the map's bounds), so Q·Kᵀ runs d / 16 K steps and P·V writes zero columns past d_v,
// which the epilogue does not store. kHeadDimV (MLA-style prefill: q/k 192, v 128) sizes the V
// tiles and the output. kPaged instances read K/V through the block table, a key tile as boxes
// of whole 8-row groups (paged_box_rows) that compose into the same swizzled tile, or gathered
// row by row (gather_tile) where pages cannot be boxed that way or boxes would be small
// (hopper_gathers_pages). kFp8 instances (d = 128 or 256, contiguous K/V) read e4m3 Q/K/V and
// write a bf16 O (kBf16 then names the output); their V tile is V transposed ([d rows][128
// keys], transpose_v_kernel), the K-major B operand 8-bit wgmma needs.
template <bool kBf16_, int kHeadDim_, bool kPaged_ = false, bool kFp8_ = false, int kHeadDimV_ = kHeadDim_>
struct FwdConfig {
  static constexpr bool kBf16 = kBf16_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr bool kPaged = kPaged_;
  static constexpr bool kFp8 = kFp8_;
  static constexpr int kTileM = kBlockQ;
  static constexpr int kTileN = 128;  // keys per K/V tile
  static constexpr int kConsumers = 2;
  static constexpr int kThreads = 128 * (1 + kConsumers);
  // 16-bit: 3 measured slower (dev/ v4: 224 KB smem, 603-660 TFLOP/s vs 626-685). FP8: 2, 3, 4
  // and 6 measured equal (11.2-11.3 ms at 32K, record 2026-11-29-h200-fp8-stages).
  static constexpr int kStages = tuning::hopper_stages(kFp8, kHeadDim);
  static constexpr int kElemBytes = kFp8 ? 1 : 2;
  static constexpr int kRowBytes = 128;                  // one swizzle row
  static constexpr int kHalfDim = kRowBytes / kElemBytes;  // elements of a box row: 64, or 128 e4m3
  static constexpr int kHalves = (kHeadDim + kHalfDim - 1) / kHalfDim;    // boxes of a Q or K tile
  static constexpr int kHalvesV = (kHeadDimV + kHalfDim - 1) / kHalfDim;  // of a V tile
  static constexpr int kAtomBytes = 8 * kRowBytes;    // 1024: the 128B-swizzle period (8 rows)
  static constexpr int kHalfBytes = kTileN * kRowBytes;  // one [128][128 B] box: 16 KB
  static constexpr int kTileBytes = kHalves * kHalfBytes;
  static constexpr int kVTileBytes = kHalvesV * kHalfBytes;
  static constexpr int kDFrags = kHalvesV * kHalfDim / 8;  // n8 fragments of an accumulator row
  static constexpr int kOutFrags = kHeadDimV / 8;          // of them stored: the output's columns
  // An accumulator wider than 128 columns (d_v 256: 128 registers a thread) leaves no room for
  // S (64) and P (32) in flight together: a tile's P·V then completes before the next Q·Kᵀ is
  // issued (the other warpgroup's GEMMs still overlap this one's softmax: ping-pong).
  static constexpr bool kSerialPv = kDFrags > 16;
  // FP8 keeps its running max 2^kPLog2Offset below the true one, moving it lazily within its own
  // bound (tuning.h: e4m3's range).
  static constexpr int kPLog2Offset = kFp8 ? tuning::kFp8PLog2Offset : 0;
  static constexpr float kLazyMaxLog2 = kFp8 ? tuning::kFp8LazyMaxLog2 : tuning::kLazyMaxLog2;
  // wgmma K steps of 32 bytes: k16 of 16-bit elements, k32 of e4m3.
  static constexpr int kQkSteps = kHeadDim * kElemBytes / 32;
  static constexpr int kPvSteps = kTileN * kElemBytes / 32;
  // The 16-bit contiguous d = 128 instances keep Q in registers (32 per thread) as Q·Kᵀ's A
  // operand, so a Q·Kᵀ reads only K from shared memory: dense 1.6% faster at 16K, exact_gate
  // 20% 2% at 64K, block_sparse 20% 5% at 16K, while d = 64 (SmolLM2 8K) ran dense 2-3% slower
  // (record 2026-11-30-h200-hopper-q-in-registers-ab.log). FP8 with it (e4m3 wgmma RS) ran 3-5%
  // slower (2026-11-30-h200-fp8-q-in-registers-ab.log), and the paged instances' consumers (224
  // registers) spill 8 bytes with it.
  static constexpr bool kQInRegs = tuning::hopper_q_in_registers(kFp8, kPaged, kHeadDim);
  // setmaxnreg budgets: the warpgroups trade registers within the pool the CTA was launched
  // with, 384 threads at 168 (the most __launch_bounds__(384, 1) gives), so
  // 128·producer + 256·consumer <= 64512, not the SM's 65536 (an increase the pool cannot
  // serve waits forever: 32 / 240 hung, commit 232c583). 24 / 240 for the TMA producer; the
  // paged instances' producer may gather rows with cp.async (gather_tile), whose address chain
  // ran latency-bound at 24 (1.50x the contiguous time at 16-key pages, 1.28x at 56 / 224 with
  // the loop unrolled; record 2026-11-29-h200-paged-producer); 56 at d = 64 spills 16 bytes in
  // the consumers, 40 / 232 none.
  static constexpr int kProducerRegs = tuning::hopper_producer_regs(kPaged_, kHeadDim_);
  static constexpr int kConsumerRegs = tuning::hopper_consumer_regs(kPaged_, kHeadDim_);
  static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= kThreads * 168, "the CTA's register pool");
  // Gate decisions in flight: a slot is rewritten 4 gated blocks later, when every reader
  // (both consumer warpgroups, at most one ping-pong round apart, and the producer) is past it.
  static constexpr int kVoteSlots = 4;
  // Mean-correction tiles of kTileN pooled blocks one query block can visit.
  static constexpr int kMaxMeanTiles = kMaxMeanChunks * kMeanChunk / kTileN;
  // 64 and 128 everywhere; 96, 256 and q/k 192 with v 128 over contiguous K/V (the paged gather
  // copies whole 16-byte chunks of rows whose count divides its 128 threads).
  static_assert(kHeadDimV == kHeadDim
                    ? (kHeadDim == 64 || kHeadDim == 128 || ((kHeadDim == 96 || kHeadDim == 256) && !kPaged))
                    : (kHeadDim == 192 && kHeadDimV == 128 && !kPaged),
                "d = 64 or 128, contiguous 96, 256 or 192 with d_v 128");
  static_assert(!kFp8 || ((kHeadDim == 128 || kHeadDim == 256) && kHeadDimV == kHeadDim && !kPaged && kBf16),
                "fp8: d = 128 or 256, contiguous K/V, bf16 output");
  static_assert(kTileM == kConsumers * 64, "each consumer warpgroup owns one m64 slab of Q");
};

template <class Cfg>
struct alignas(1024) Smem {
  // Tiles as TMA writes them with 128B swizzle: [d-half][row][64], rows of 128 bytes; each tile
  // starts on a 1024-byte boundary (the swizzle is a function of the address bits).
  std::uint8_t q[Cfg::kTileBytes];
  std::uint8_t k[Cfg::kStages][Cfg::kTileBytes];
  std::uint8_t v[Cfg::kStages][Cfg::kVTileBytes];
  // mbarriers, named after the event they signal.
  std::uint64_t q_loaded;                 // TMA -> consumers, once
  std::uint64_t k_loaded[Cfg::kStages];   // TMA -> consumers (transaction bytes)
  std::uint64_t v_loaded[Cfg::kStages];
  std::uint64_t k_free[Cfg::kStages];     // consumers -> producer: 8 warp arrivals, S read done
  std::uint64_t v_free[Cfg::kStages];     // consumers -> producer: 8 warp arrivals, P·V read done
  // Gated blocks: each consumer warp writes its vote (any of its rows keeps) to its byte of
  // votes[slot] and arrives on decided[slot] (8 arrivals); the consumers and the producer (which
  // loads V only for a kept block) wait on it and read all 8 bytes.
  std::uint64_t decided[Cfg::kVoteSlots];
  alignas(8) std::uint8_t votes[Cfg::kVoteSlots][8];
  // Mean-correction tiles to visit (ascending tile indices), written by warp 1 before the start.
  int mean_tiles[Cfg::kMaxMeanTiles];
  int num_mean_tiles;
};

// Tensor maps of one sequence, in device memory: [batch] of these, 64-byte aligned. Each spans
// exactly the rows of the sequence it maps, so TMA zero-fills rows past s_q / s_k: q and, for
// contiguous K/V, k and v over the sequence's s_k rows. Paged K/V (kPaged instances): k and v
// map only the rows of the sequence's last page that hold keys (its tail,
// s_k - last_page · page_size rows: 1 to page_size), and one more SeqMaps follows the [batch]
// ones, whose k and v are 4-D maps (d, head, row in page, page) over the whole cache
// [num_pages, page_size, h_kv, d] with its own strides (q unused, zero). Paged boxes are
// [paged_box_rows][64].
struct SeqMaps {
  CUtensorMap q, k, v;
};

// The SeqMaps of a call with at most kParamSeqMaps of them (its [batch], and paged K/V's cache
// maps after them), passed by value as a kernel parameter: no upload and nothing to cache, so a
// call whose tensors have new addresses (each layer of a model) costs no copy and no device
// memory. 4 · 384 bytes keeps the parameters under the classic 4 KiB. Larger batches upload
// theirs (the launch's `upload`).
constexpr int kParamSeqMaps = kFwd90ParamSeqMaps;
struct ParamMaps {
  SeqMaps seq[kParamSeqMaps];
};

// Tensor maps of per-call scratch, passed by value as a kernel parameter: the scratch has a new
// address each call, so its maps must not go through the metadata cache. k_mean / v_mean: the
// block means k̄/v̄ [batch, h_kv, mean_blocks, d] (mean correction; zero without). v_t: FP8's
// transposed V (FwdParams::v_t) as (key, d, batch · h_kv + kv head) (zero for 16-bit inputs).
struct ScratchMaps {
  CUtensorMap k_mean, v_mean, v_t;
};

// Rows of one TMA box of paged K/V: gcd(page_size, 128), the largest power of two dividing
// both (page_size is a multiple of 8, launch_fwd checks). A box then never crosses a page, and
// the 128 / rows boxes of a tile's d-half start at multiples of 8 rows of its stage: 1024-byte
// aligned, where the 128B swizzle pattern restarts (it repeats every 8 rows of 128 bytes:
// 16-byte chunk c of row r lands at chunk c ^ (r % 8)), so they compose into exactly the
// layout one [128][64] box writes and the consumers' descriptors read.
__host__ __device__ __forceinline__ int paged_box_rows(int page_size) {
  const int low = page_size & -page_size;
  return low < 128 ? low : 128;
}

// ------------------------------------------------------------------ softmax pieces
// Numerics as in softmax.cuh (RowStats and finalize_row are used as they are): raw
// scores, the max in the log2 domain, a -inf running max exponentiated against 0.

// Row maxima of a raw [64 x 128] score tile (the thread's rows g and g + 8), NaN-propagating,
// reduced over the quad that shares the rows. The tree is written out stage by stage: the
// generic row_max<1, 16> of softmax.cuh leaves its halving loop rolled at 16 fragments and
// puts the tree in local memory (64-byte stack frame).
__device__ __forceinline__ void row_max_tile(const float (&s)[1][16][4], float (&mx)[2]) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float t[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) t[j] = ptx::max_nan(s[0][j][2 * half], s[0][j][2 * half + 1]);
#pragma unroll
    for (int i = 0; i < 8; ++i) t[i] = ptx::max_nan(t[i], t[i + 8]);
#pragma unroll
    for (int i = 0; i < 4; ++i) t[i] = ptx::max_nan(t[i], t[i + 4]);
#pragma unroll
    for (int i = 0; i < 2; ++i) t[i] = ptx::max_nan(t[i], t[i + 2]);
    mx[half] = ptx::max_nan(t[0], t[1]);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = ptx::max_nan(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = ptx::max_nan(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
}

// Moves the running statistics to include a raw score tile s whose row maxima are mx
// (row_max_tile) and turns s into p = exp2(s·scale_log2 - m_use) in place, adding p to l
// (m: Cfg::kPLog2Offset below the true max). The
// output accumulator may still be in flight (the previous P·V), so its factor
// alpha = exp2(m_old - m_use) is returned for scale_acc once that P·V has completed. A row that
// has seen no key (m = -inf) gets alpha = 0 and p = 0. lazy: a row keeps m, with alpha = 1,
// while row_must_move says it may (softmax.cuh); returns whether some row of the warp moved m,
// i.e. whether O needs scale_acc (warp-uniform).
template <class Cfg>
__device__ __forceinline__ bool softmax_tile(float (&s)[1][16][4], const float (&mx)[2], RowStats<1>& st,
                                             float scale_log2, bool lazy, float (&alpha)[2]) {
  // m sits kPLog2Offset below the true max, which lazy keeps within kLazyMaxLog2 of it.
  constexpr float kLazyMax = Cfg::kLazyMaxLog2 + static_cast<float>(Cfg::kPLog2Offset);
  float m_use[2];
  bool moved = false;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const bool move = !lazy || row_must_move(st.m[r], mx[r], scale_log2, kLazyMax);
    moved |= move;
    if (move) {
      move_row<Cfg::kPLog2Offset>(st.m[r], mx[r], scale_log2, m_use[r], alpha[r]);
      st.l[r] *= alpha[r];
    } else {
      m_use[r] = st.m[r];
      alpha[r] = 1.f;
    }
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[0][j][e] = ptx::exp2f_fast(fmaf(s[0][j][e], scale_log2, -m_use[e / 2]));
      st.l[e / 2] += s[0][j][e];
    }
  }
  return !lazy || __any_sync(0xffffffffu, moved);
}

template <int kDFrags>
__device__ __forceinline__ void scale_acc(float (&o)[kDFrags][4], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < kDFrags; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] *= alpha[e / 2];
  }
}

// p (fp32, accumulator layout) -> the A fragments of P·V, one per K step of keys, P rounded to
// the input dtype here (the rounding docs/numerics.md allows for). 16-bit: accumulator columns
// 16kk..16kk+15 are exactly the A fragment of k16 step kk. e4m3 (k32 steps): the thread holds
// columns 2t, 2t + 1, 8 + 2t, 9 + 2t of each 16 (t = lane % 4) and the fragment wants k indices
// 4t .. 4t + 3, so those four become them, in that order; V's keys are permuted alike
// (transpose_v_kernel), which leaves P·V unchanged.
template <class Cfg>
__device__ __forceinline__ void pack_p(const float (&s)[1][16][4], std::uint32_t (&p)[Cfg::kPvSteps][4]) {
#pragma unroll
  for (int kk = 0; kk < Cfg::kPvSteps; ++kk) {
    if constexpr (Cfg::kFp8) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {  // r: row g + 8·(r % 2), keys 32kk + 16·(r / 2) ..
        const int j = 4 * kk + 2 * (r / 2), e = 2 * (r % 2);
        p[kk][r] = hw::pack4_e4m3(s[0][j][e], s[0][j][e + 1], s[0][j + 1][e], s[0][j + 1][e + 1]);
      }
    } else {
      p[kk][0] = ptx::pack2<Cfg::kBf16>(s[0][2 * kk][0], s[0][2 * kk][1]);
      p[kk][1] = ptx::pack2<Cfg::kBf16>(s[0][2 * kk][2], s[0][2 * kk][3]);
      p[kk][2] = ptx::pack2<Cfg::kBf16>(s[0][2 * kk + 1][0], s[0][2 * kk + 1][1]);
      p[kk][3] = ptx::pack2<Cfg::kBf16>(s[0][2 * kk + 1][2], s[0][2 * kk + 1][3]);
    }
  }
}

// ------------------------------------------------------------------ consumer GEMMs
// Descriptors of a consumer warpgroup's operands. Q and K are K-major: rows of 128 B, 8-row
// groups 1024 B apart (SBO), the 32-byte K step kk at +32·(kk % 4) bytes inside d-half kk / 4.
// 16-bit V is N-major for P·V: d runs along the 128-byte rows, the d-halves are N chunks of 64
// one box apart (LBO), 8-key groups 1024 B apart (SBO); key step kk starts 16 rows = 2 KB
// further. FP8's Vᵀ tile is K-major like K (rows: d; key step kk at +32·kk bytes). Descriptor
// address fields are in 16-byte units.
template <class Cfg>
__device__ __forceinline__ std::uint64_t kmajor_desc(std::uint32_t addr) {
  static_assert(Cfg::kAtomBytes == 1024, "the 128-byte swizzle period");
  return hw::kmajor_desc_sw128(addr);
}
template <class Cfg>
__device__ __forceinline__ std::uint64_t v_desc(std::uint32_t addr) {
  if constexpr (Cfg::kFp8) return kmajor_desc<Cfg>(addr);
  return hw::desc_sw128(addr, Cfg::kHalfBytes, Cfg::kAtomBytes);
}
template <class Cfg>
__device__ __forceinline__ std::uint64_t k_step(int kk) {
  return hw::kmajor_k_step<Cfg::kHalfBytes>(kk);
}

// S = Q·Kᵀ of the warpgroup's 64 rows against a 128-key tile, as one commit group.
template <class Cfg>
__device__ __forceinline__ void wgmma_qk(float (&s)[1][16][4], std::uint64_t q, std::uint64_t k) {
  hw::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kQkSteps; ++kk) {
    if constexpr (Cfg::kFp8) {
      hw::wgmma_ss_e4m3(s[0], q + k_step<Cfg>(kk), k + k_step<Cfg>(kk), kk > 0);
    } else {
      hw::wgmma_ss<Cfg::kBf16>(s[0], q + k_step<Cfg>(kk), k + k_step<Cfg>(kk), kk > 0);
    }
  }
  hw::wgmma_commit();
}

// The same with Q in registers (load_q_frags).
template <class Cfg>
__device__ __forceinline__ void wgmma_qk(float (&s)[1][16][4], const std::uint32_t (&qf)[Cfg::kQkSteps][4],
                                         std::uint64_t k) {
  hw::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kQkSteps; ++kk) hw::wgmma_rs_kmajor<Cfg::kBf16>(s[0], qf[kk], k + k_step<Cfg>(kk), kk > 0);
  hw::wgmma_commit();
}

// The warpgroup's 64 Q rows as wgmma A fragments, from the tile TMA wrote ([d-half][row][64],
// 128B swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8)): ldmatrix.x4 per k-step, lane l
// addressing row 16·warp + l % 8 + 8·(l / 8 % 2) at chunk 2·kk + l / 16, so that registers 0-3
// are the m16n8k16 A fragment's a0-a3.
template <class Cfg>
__device__ __forceinline__ void load_q_frags(std::uint32_t (&qf)[Cfg::kQkSteps][4], std::uint32_t q_tile, int wg) {
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row = wg * 64 + warp * 16 + lane % 8 + 8 * (lane / 8 % 2);
  const std::uint32_t row_addr = q_tile + static_cast<std::uint32_t>(row * Cfg::kRowBytes);
#pragma unroll
  for (int kk = 0; kk < Cfg::kQkSteps; ++kk) {
    const int chunk = 2 * kk + lane / 16;
    const int half = chunk / 8, c = chunk % 8;
    ptx::ldmatrix_x4(row_addr + static_cast<std::uint32_t>(half * Cfg::kHalfBytes + ((c ^ (row % 8)) << 4)), qf[kk]);
  }
}

// O += P·V with P in registers (pack_p), as one commit group. An accumulator of 256 columns
// (d_v 256) is two n128 halves: 16-bit V's second starts two d-halves (boxes, the LBO) further,
// FP8's Vᵀ at its row (d) 128.
template <class Cfg>
__device__ __forceinline__ void wgmma_pv(float (&o)[Cfg::kDFrags][4], const std::uint32_t (&pf)[Cfg::kPvSteps][4],
                                         std::uint64_t v) {
  hw::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < Cfg::kPvSteps; ++kk) {
    if constexpr (Cfg::kFp8 && Cfg::kDFrags == 32) {
      using Half = float[16][4];
      hw::wgmma_rs_e4m3(*reinterpret_cast<Half*>(&o[0]), pf[kk], v + k_step<Cfg>(kk));
      hw::wgmma_rs_e4m3(*reinterpret_cast<Half*>(&o[16]), pf[kk], v + k_step<Cfg>(kk) + (Cfg::kHalfBytes >> 4));
    } else if constexpr (Cfg::kFp8) {
      hw::wgmma_rs_e4m3(o, pf[kk], v + k_step<Cfg>(kk));
    } else if constexpr (Cfg::kDFrags == 32) {
      using Half = float[16][4];
      const std::uint64_t step = v + ((kk * 16 * Cfg::kRowBytes) >> 4);
      hw::wgmma_rs<Cfg::kBf16>(*reinterpret_cast<Half*>(&o[0]), pf[kk], step);
      hw::wgmma_rs<Cfg::kBf16>(*reinterpret_cast<Half*>(&o[16]), pf[kk], step + ((2 * Cfg::kHalfBytes) >> 4));
    } else {
      hw::wgmma_rs<Cfg::kBf16>(o, pf[kk], v + ((kk * 16 * Cfg::kRowBytes) >> 4));
    }
  }
  hw::wgmma_commit();
}

template <int kN>
__device__ __forceinline__ void zero_acc(float (&o)[kN][4]) {
#pragma unroll
  for (int j = 0; j < kN; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  }
}

// Element mask of a partial or short key tile: key column c (tile-relative) is visible to the
// thread's row r iff c <= limit[r], the row's last visible key relative to the tile (causal:
// its position, bottom-right aligned; a right window bound: position + window_right; always:
// the sequence's last key), clamped to [-1, 128]. Keys past s_k were zero-filled by TMA; they
// get -inf here.
__device__ __forceinline__ void mask_tile(float (&s)[1][16][4], const int (&limit)[2]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (8 * j + 2 * t + e % 2 > limit[e / 2]) s[0][j][e] = -INFINITY;
    }
  }
}

// The other side under a left window bound: column c is hidden from row r iff c < first[r],
// the row's first visible key relative to the tile, clamped to [0, 128].
__device__ __forceinline__ void mask_tile_below(float (&s)[1][16][4], const int (&first)[2]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (8 * j + 2 * t + e % 2 < first[e / 2]) s[0][j][e] = -INFINITY;
    }
  }
}

// Where the producer finds the key rows of paged K/V (kPaged instances only).
struct PagedRows {
  const std::int32_t* table;  // the sequence's block-table row
  const SeqMaps* cache;       // its k and v map the whole cache: the SeqMaps after the [batch] ones
  int page_size;
  int box_rows;   // paged_box_rows(page_size)
  int keys;       // s_k (int32 for paged K/V: seqused_k)
  int last_page;  // the sequence's last page holding keys, (s_k - 1) / page_size
};

__device__ __forceinline__ PagedRows paged_rows(const FwdParams& p, const SeqMaps* maps, int b, std::int64_t s_k) {
  const int page_size = p.paged.page_size;
  const int keys = static_cast<int>(s_k);
  return {p.paged.block_table + b * p.paged.table_stride, maps + p.batch, page_size, paged_box_rows(page_size), keys,
          keys > 0 ? (keys - 1) / page_size : 0};
}

// Gather mode: where the rows of the 128-key tile kb that a producer thread looks up lie in the
// cache (thread t looks up row r0 + kRowStep·c of the tile, r0 = t / kChunks, c = t % kChunks,
// for the kChunks threads that copy rows r0 + kRowStep·i: see gather_tile). The producer reads
// it one position ahead, so the dependent table load overlaps the wait for a free stage and the
// copies of the tile before; K and V of a tile share it.
struct RowLookup {
  int entry;    // the row's block-table entry, or -1 past s_k (the row is zero-filled, never read)
  int in_page;  // row within that page
};

template <class Cfg>
__device__ __forceinline__ RowLookup row_lookup(const PagedRows& pages, int kb) {
  constexpr int kChunks = Cfg::kHeadDim / 8;
  constexpr int kRowStep = 128 / kChunks;
  const int t = threadIdx.x % 128;
  const int row = kb * Cfg::kTileN + t / kChunks + kRowStep * (t % kChunks);
  if (row >= pages.keys) return {-1, 0};
  const int page = row / pages.page_size;
  return {pages.table[page], row - page * pages.page_size};
}

// Gather mode: the K (value = false) or V tile of key block kb, copied by the producer
// warpgroup's 128 threads with cp.async into the layout TMA writes ([d-half][row][64], 128B
// swizzle: 16-byte chunk c of row r at chunk c ^ (r % 8) of its 128-byte row), rows past s_k
// zero-filled as the contiguous maps fill them. Thread t copies chunk c = t % kChunks of rows
// r0 + kRowStep·i (i < kChunks): a warp reads whole rows, and since kRowStep is a multiple of 8
// all rows of a thread share one swizzle, so its destinations are one base plus i row steps.
// The kChunks threads sharing r0 looked up one row each (`rows`, row_lookup) and pass its
// offset from the cache's base round by shuffles, 32 bits in 16-byte units (the launch checks
// gather_offsets_fit). Per copy: one shuffle, one wide multiply-add for the address, the bound
// test and the cp.async, unrolled (the form with 64-bit offsets, the swizzle and the bounds
// recomputed per copy, rolled at 24 registers, kept the gathered kernel at 1.8x the contiguous
// time: record 2026-11-29-h200-paged-producer).
template <class Cfg>
__device__ __forceinline__ void gather_tile(const FwdParams& p, const SeqInfo& seq, int keys, int hk, int kb, bool value,
                                            RowLookup rows, std::uint32_t dst) {
  constexpr int kChunks = Cfg::kHeadDim / 8;   // 16-byte chunks per row
  constexpr int kRowStep = 128 / kChunks;      // rows one pass of the 128 threads covers
  static_assert(Cfg::kTileN / kRowStep == kChunks, "each thread's rows are looked up by its row group");
  static_assert(kRowStep % 8 == 0, "the rows of a thread share their swizzle");
  const int t = threadIdx.x % 128, c = t % kChunks, r0 = t / kChunks;
  const int lane_base = (t % 32) - c;  // lane of this row group's chunk-0 thread
  // This thread's chunk of row 0 of the cache's base; rows are whole 16-byte units from it.
  const auto* base = reinterpret_cast<const uint4*>(static_cast<const std::uint16_t*>(value ? p.v : p.k) +
                                                    (value ? seq.v_off : seq.k_off) +
                                                    hk * (value ? p.v_head_stride : p.k_head_stride)) +
                     c;
  const std::uint32_t units =
      rows.entry < 0 ? 0u
                     : static_cast<std::uint32_t>(
                           (static_cast<std::int64_t>(rows.entry) * (value ? p.paged.v_page_stride : p.paged.k_page_stride) +
                            static_cast<std::int64_t>(rows.in_page) * (value ? p.v_row_stride : p.k_row_stride)) /
                           8);
  const int rows_left = keys - kb * Cfg::kTileN - r0;  // row r0 + kRowStep·i holds a key iff kRowStep·i < rows_left
  const std::uint32_t to = dst + static_cast<std::uint32_t>((c / 8) * Cfg::kHalfBytes + r0 * Cfg::kRowBytes +
                                                            (((c % 8) ^ (r0 & 7)) << 4));
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const std::uint32_t u = __shfl_sync(0xffffffffu, units, lane_base + i);
    ptx::cp_async_16_or_zero(to + static_cast<std::uint32_t>(i * kRowStep * Cfg::kRowBytes), ptx::offset_16b(base, u),
                             kRowStep * i < rows_left);
  }
}

// ------------------------------------------------------------------ the kernel
// The rounds an FP8 kernel compiles: dense and block masks (kPlain), exact_gate and softmax_skip
// (kGates), block masks with mean-correction tiles (kMeans). 16-bit kernels compile all three.
enum class Fp8Rounds { kPlain, kGates, kMeans };

// Grid: one CTA per (tile, batch, unit), units fastest so that the query heads of a KV group
// run on adjacent CTAs and share each K/V tile through L2, and the last tiles (the longest
// under causal) first. A unit is a query head and a tile a query block of 128 rows, or, with
// GQA packing (p.q_pack = G > 1, choose_q_pack), a KV group whose G query heads share the
// tile: 128 / G query rows of each, row r of the tile being query row r / G of head r % G, so
// the group's K/V tiles are loaded once. Packing applies to dense and per-KV-head block masks,
// whose visits are the same for every head of the group: the tile visits those of its query
// block, and masks each row at its own position. The CTA visits the positions of its VisitList
// (policy.cuh, over 128-key blocks: dense and the gates descend from the last visible block, a
// block mask walks its partial then its full list), then its mean-correction tiles. Only
// partial (the causal band, a local window's bands) and short (s_k tail) key tiles are masked.
//
// Gated positions (exact_gate's full blocks, softmax_skip's after the first): once S is in
// registers, every consumer warp votes (policy.cuh's per-row rule over its rows) and all wait
// for the 8 votes; a skipped block does no softmax and no P·V and leaves m, l and O untouched.
// The producer loads K one position ahead of the decision and V only after it, for kept blocks;
// the V ring therefore advances per loaded V tile, on both sides.
//
// kFeatures: the kernel of calls with a model-family feature (FwdParams: a local window, a
// softcap, learned sinks; launch_fwd picks it; dense and block masks without mean correction
// only, check_support): its geometry and element masks read the window, its scores are capped,
// its rows finalised with their head's sink. The feature-free kernel takes every feature as
// absent at compile time, so it compiles as it did before they ran (the same SASS: record
// 2026-12-02-cpu-window-kernels-sass). kFp8: which rounds an FP8 kernel compiles, one kind per
// kernel (with the gated rounds beside the plain ones FP8 dense ran 0.8% slower, record
// 2026-12-04-h200-fp8-gates-ab).
template <class Cfg, bool kFeatures, Fp8Rounds kFp8 = Fp8Rounds::kPlain>
__global__ void __launch_bounds__(Cfg::kThreads, 1)
    fwd_kernel(const __grid_constant__ FwdParams p, const SeqMaps* __restrict__ uploaded_maps,
               const __grid_constant__ ScratchMaps scratch_maps, const __grid_constant__ ParamMaps param_maps) {
  // The call's SeqMaps: uploaded to global memory (large batches), else the parameter's.
  const SeqMaps* maps = uploaded_maps != nullptr ? uploaded_maps : param_maps.seq;
  using S = Smem<Cfg>;
  constexpr int kTileN = Cfg::kTileN, kHalfBytes = Cfg::kHalfBytes, kRowBytes = Cfg::kRowBytes;
  extern __shared__ std::uint8_t smem_raw[];
  const std::uint32_t raw = hw::smem_u32(smem_raw);
  S& sm = *reinterpret_cast<S*>(smem_raw + ((1024 - (raw & 1023)) & 1023));

  const int pack = p.q_pack;
  const int units = p.h_q / pack;
  const auto gt = geom::grid_tile(static_cast<int>(blockIdx.x), units, p.group / pack, p.batch,
                                  static_cast<int>(gridDim.x) / (p.batch * units), p.kv_major);
  const int h = gt.unit * pack;  // the tile's (first) query head
  const int b = gt.b;
  const int tile_rev = gt.tile_rev;
  const int hk = h / p.group;
  const SeqInfo seq = p.seqs[b];
  const geom::BlockGeometry geo{{seq.s_q, seq.s_k, p.causal, kFeatures ? p.window_left : -1, kFeatures ? p.window_right : -1,
                                 kFeatures ? p.attention_chunk : 0},
                                Cfg::kTileM, kTileN};
  const int tile_rows = Cfg::kTileM / pack;  // query rows of one head in the tile
  const std::int64_t tiles = geom::ceil_div(seq.s_q, tile_rows);
  if (tile_rev >= tiles) return;
  const std::int64_t first_row = (tiles - 1 - tile_rev) * tile_rows;
  const int qb = static_cast<int>(first_row / Cfg::kTileM);  // the query block holding the tile
  const std::int64_t row0 = geo.row_begin(qb);
  const int rows_valid = static_cast<int>(geo.row_end(qb) - row0);
  const int tile_row0 = static_cast<int>(first_row - row0);  // 0 unpacked
  // Key tiles >= mask_lo are partial (the causal band, a local window's upper band) or short
  // (the s_k tail) and get an element mask; the ones below are full but for a left window
  // bound's lower band (mask_if_needed).
  const int full_tiles = static_cast<int>(seq.s_k / kTileN);
  const int mask_lo = geo.full_end(qb) < full_tiles ? geo.full_end(qb) : full_tiles;
  const int warpgroup = threadIdx.x / 128;

  const std::int64_t mask_row = mask_row_of(p, b, h, qb);
  const VisitList visit = make_visit_list(p, geo, qb, mask_row);
  const Gate gate = make_gate(p, geo, qb, h);
  const int first_gated = gate.first_gated(visit.n_a);
  const bool lazy = !gate.skip;  // softmax_tile's rescale (softmax.cuh, kLazyMaxLog2)
  const bool means = p.mode == PolicyMode::kBlockMask && p.k_mean != nullptr;
  const int mean_blocks_seq = means ? mean_blocks_of(p, seq.s_k) : 0;
  const std::uint32_t* mean_bits = means ? p.corrected_bits + mask_row * p.corrected_words : nullptr;

  // Paged K/V whose pages TMA boxes cannot tile, or only in boxes below 64 rows
  // (hopper_gathers_pages): the producer warpgroup gathers the key rows with cp.async
  // (gather_tile), and each of its 128 threads arrives on the loaded barriers.
  const bool gather = Cfg::kPaged && p.paged.gather_rows;
  if (threadIdx.x == 0) {
    hw::mbar_init(hw::smem_u32(&sm.q_loaded), 1);
#pragma unroll
    for (int st = 0; st < Cfg::kStages; ++st) {
      hw::mbar_init(hw::smem_u32(&sm.k_loaded[st]), gather ? 128 : 1);
      hw::mbar_init(hw::smem_u32(&sm.v_loaded[st]), gather ? 128 : 1);
      hw::mbar_init(hw::smem_u32(&sm.k_free[st]), 4 * Cfg::kConsumers);
      hw::mbar_init(hw::smem_u32(&sm.v_free[st]), 4 * Cfg::kConsumers);
    }
#pragma unroll
    for (int slot = 0; slot < Cfg::kVoteSlots; ++slot) hw::mbar_init(hw::smem_u32(&sm.decided[slot]), 4 * Cfg::kConsumers);
    hw::fence_mbar_init();
  }
  if (threadIdx.x / 32 == 1) {
    const int count = means ? collect_mean_tiles<kTileN>(p, mean_bits, mean_blocks_seq, threadIdx.x % 32, sm.mean_tiles) : 0;
    if (threadIdx.x % 32 == 0) sm.num_mean_tiles = count;
  }
  __syncthreads();
  // Positions 0 .. n_reg-1 are key blocks, then the mean tiles. n_visit = 0: every row of the
  // block sees no key (or the mask selects none).
  const int n_visit = visit.n_reg + sm.num_mean_tiles;

  // The decision of gated position j (all 8 consumer warps have voted), as every thread reads it.
  auto decision = [&](int j) -> bool {
    const int g = j - first_gated;
    hw::mbar_wait(hw::smem_u32(&sm.decided[g % Cfg::kVoteSlots]), (g / Cfg::kVoteSlots) & 1);
    return *reinterpret_cast<volatile std::uint64_t*>(sm.votes[g % Cfg::kVoteSlots]) != 0u;
  };

  if (warpgroup == 0) {
    // ---------------------------------------------------------------- producer
    hw::setmaxnreg_dec<Cfg::kProducerRegs>();
    // One thread issues every TMA copy; in gather mode all 128 run the loop and copy key rows.
    const bool leader = threadIdx.x == 0;
    if (n_visit > 0 && (leader || gather)) {
      const SeqMaps* m = maps + b;
      const PagedRows pages = Cfg::kPaged ? paged_rows(p, maps, b, seq.s_k) : PagedRows{};
      if (leader) {
        if (uploaded_maps != nullptr) {  // parameters need no acquire: no proxy wrote them
          hw::fence_tensormap(&m->q);
          hw::fence_tensormap(&m->k);
          hw::fence_tensormap(&m->v);
          if constexpr (Cfg::kPaged) {
            hw::fence_tensormap(&pages.cache->k);
            hw::fence_tensormap(&pages.cache->v);
          }
        }
        const std::uint32_t q_bar = hw::smem_u32(&sm.q_loaded);
        hw::mbar_expect_tx(q_bar, Cfg::kTileBytes);
        // Packed: the map's boxes are [128 / G rows][G heads][128 bytes], the tile's row order.
        for (int half = 0; half < Cfg::kHalves; ++half) {
          hw::tma_load_3d(hw::smem_u32(sm.q) + half * kHalfBytes, &m->q, q_bar, half * Cfg::kHalfDim, h,
                          static_cast<int>(first_row));
        }
      }
      // The K (value = false) or V tile of position j (key block kb) into `dst`, completing on
      // `bar`; `rows`: the tile's row_lookup in gather mode.
      auto load = [&](int j, int kb, bool value, std::uint32_t dst, std::uint32_t bar, RowLookup rows) {
        if (gather) {
          if (j < visit.n_reg) {
            if constexpr (Cfg::kPaged) gather_tile<Cfg>(p, seq, pages.keys, hk, kb, value, rows, dst);
            hw::cp_async_mbar_arrive(bar);
            return;
          }
          if (!leader) {  // a mean tile: the leader's TMA and these 127 arrivals complete it
            hw::mbar_arrive(bar);
            return;
          }
        }
        hw::mbar_expect_tx(bar, value ? Cfg::kVTileBytes : Cfg::kTileBytes);
        const int halves = value ? Cfg::kHalvesV : Cfg::kHalves;
        if (j < visit.n_reg) {
          const int row = kb * kTileN;
          if constexpr (Cfg::kPaged) {
            // Box by box (paged_box_rows): rows of pages before the last one holding keys come
            // from the cache map at (row in page, the page's table entry), those of the last
            // page from the sequence's tail map, which zero-fills its rows past s_k as the
            // contiguous maps do. A box starting at or past s_k (in the last page or after it)
            // re-reads the tail map's first box instead: finite keys of this sequence, and like
            // every box here at least partly inside its map (never the storage of other pages,
            // never a box wholly out of bounds). Such a box lies in the tile's columns past
            // s_k, which are masked to -inf (the tile is short), so its P is exactly 0, as for
            // the zero rows of contiguous K/V.
            const CUtensorMap* cache = value ? &pages.cache->v : &pages.cache->k;
            const CUtensorMap* tail = value ? &m->v : &m->k;
            int page = row / pages.page_size;
            int in_page = row - page * pages.page_size;
            for (int r = 0; r < kTileN; r += pages.box_rows) {
              const std::uint32_t box = dst + static_cast<std::uint32_t>(r * kRowBytes);
              if (row + r < pages.keys && page < pages.last_page) {
                const int entry = pages.table[page];
                for (int half = 0; half < halves; ++half) {
                  hw::tma_load_4d(box + half * kHalfBytes, cache, bar, half * Cfg::kHalfDim, hk, in_page, entry);
                }
              } else {
                const int tail_row = row + r < pages.keys ? in_page : 0;
                for (int half = 0; half < halves; ++half) {
                  hw::tma_load_3d(box + half * kHalfBytes, tail, bar, half * Cfg::kHalfDim, hk, tail_row);
                }
              }
              in_page += pages.box_rows;
              if (in_page == pages.page_size) {
                in_page = 0;
                ++page;
              }
            }
          } else if (Cfg::kFp8 && value) {
            // Vᵀ [d][128 keys] of this (batch, kv head): one box.
            hw::tma_load_3d(dst, &scratch_maps.v_t, bar, row, 0, b * p.h_kv + hk);
          } else {
            for (int half = 0; half < halves; ++half) {
              hw::tma_load_3d(dst + half * kHalfBytes, value ? &m->v : &m->k, bar, half * Cfg::kHalfDim, hk, row);
            }
          }
        } else {
          const int row = sm.mean_tiles[j - visit.n_reg] * kTileN;
          if (kFp8 == Fp8Rounds::kMeans && value) {
            // FP8's v̄ᵀ [d][128 blocks] of this (batch, kv head), as V's: one box. (The other FP8
            // kernels visit no mean tile, and keep the code they had before this one existed.)
            hw::tma_load_3d(dst, &scratch_maps.v_mean, bar, row, 0, b * p.h_kv + hk);
          } else {
            for (int half = 0; half < halves; ++half) {
              hw::tma_load_4d(dst + half * kHalfBytes, value ? &scratch_maps.v_mean : &scratch_maps.k_mean, bar,
                              half * Cfg::kHalfDim, row, hk, b);
            }
          }
        }
      };
      int v_count = 0;  // V tiles loaded: the V ring's position
      auto load_v = [&](int j, int kb, RowLookup rows) {
        const int st = v_count % Cfg::kStages;
        // Refills a V stage once both consumer warpgroups' P·V that read it completed.
        hw::mbar_wait(hw::smem_u32(&sm.v_free[st]), ((v_count / Cfg::kStages) & 1) ^ 1);
        load(j, kb, true, hw::smem_u32(sm.v[st]), hw::smem_u32(&sm.v_loaded[st]), rows);
        ++v_count;
      };
      // A block mask's indices are global loads: the next one is requested a position early,
      // and in gather mode the block-table rows of that block too.
      int kb_next = visit.n_reg > 0 ? visit.block(0) : 0;
      RowLookup rows_next{-1, 0};
      if constexpr (Cfg::kPaged) {
        if (gather && visit.n_reg > 0) rows_next = row_lookup<Cfg>(pages, kb_next);
      }
      int deferred = -1, deferred_kb = 0;  // a gated position whose V waits for its decision
      RowLookup deferred_rows{-1, 0};
      for (int it = 0; it < n_visit; ++it) {
        const int st = it % Cfg::kStages;
        const int kb = kb_next;
        const RowLookup rows = rows_next;
        if (it + 1 < visit.n_reg) {
          kb_next = visit.block(it + 1);
          if constexpr (Cfg::kPaged) {
            if (gather) rows_next = row_lookup<Cfg>(pages, kb_next);
          }
        }
        // Refills a K stage once both consumer warpgroups' S wgmma that read it completed.
        hw::mbar_wait(hw::smem_u32(&sm.k_free[st]), ((it / Cfg::kStages) & 1) ^ 1);
        load(it, kb, false, hw::smem_u32(sm.k[st]), hw::smem_u32(&sm.k_loaded[st]), rows);
        if (deferred >= 0 && decision(deferred)) load_v(deferred, deferred_kb, deferred_rows);
        deferred = -1;
        if (gate.gated(it, visit.n_a)) {
          deferred = it;
          deferred_kb = kb;
          deferred_rows = rows;
        } else {
          load_v(it, kb, rows);
        }
      }
      if (deferred >= 0 && decision(deferred)) load_v(deferred, deferred_kb, deferred_rows);
    }
    return;
  }

  // ------------------------------------------------------------------ consumers
  hw::setmaxnreg_inc<Cfg::kConsumerRegs>();
  const int wg = warpgroup - 1;  // 0 or 1: query rows 64·wg .. 64·wg + 63 of the block
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const int r0 = wg * 64 + warp * 16 + lane / 4;  // the thread's first tile row; also r0 + 8
  // The query rows (relative to row0) of the thread's two tile rows; their heads are computed
  // where the epilogue needs them (registers).
  int qrow[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) qrow[r] = tile_row0 + (r0 + 8 * r) / pack;
  std::uint32_t* kept_row = wg == 0 && warp == 0 && lane == 0 ? kept_row_of(p, b, h, qb) : nullptr;

  float s[1][16][4];            // scores, then p: [64 x 128] per warpgroup
  float o[Cfg::kDFrags][4];     // output accumulator [64 x d_v], at the V tile's width
  std::uint32_t pf[Cfg::kPvSteps][4];  // P as A fragments (16-bit or e4m3)
  RowStats<1> stats;
  init_row_stats(stats);
  zero_acc(o);
  // FP8: q's and k's descales scale every score, v's every output row (docs/semantics.md §1).
  const float scale_log2 =
      Cfg::kFp8 ? p.scale_log2 * ptx::descale_of(p, 0, b, hk) * ptx::descale_of(p, 1, b, hk) : p.scale_log2;
  const float o_descale = Cfg::kFp8 ? ptx::descale_of(p, 2, b, hk) : 1.f;
  const float score_descale = Cfg::kFp8 ? ptx::descale_of(p, 0, b, hk) * ptx::descale_of(p, 1, b, hk) : 1.f;
  const std::uint64_t q_desc = kmajor_desc<Cfg>(hw::smem_u32(sm.q) + wg * 64 * kRowBytes);
  std::uint32_t qf[Cfg::kQInRegs ? Cfg::kQkSteps : 1][4];  // Q's A fragments (kQInRegs)
  auto issue_qk = [&](int st) {
    if constexpr (Cfg::kQInRegs) {
      wgmma_qk<Cfg>(s, qf, kmajor_desc<Cfg>(hw::smem_u32(sm.k[st])));
    } else {
      wgmma_qk<Cfg>(s, q_desc, kmajor_desc<Cfg>(hw::smem_u32(sm.k[st])));
    }
  };
  auto issue_pv = [&](int st) { wgmma_pv<Cfg>(o, pf, v_desc<Cfg>(hw::smem_u32(sm.v[st]))); };
  // One arrival per warp on a free barrier: the warp's wgmma wait before it covered its lanes.
  auto release = [&](std::uint64_t& bar) {
    if (lane == 0) hw::mbar_arrive(hw::smem_u32(&bar));
  };
  // Masks key block `kb` if it is partial or short (uniform over the CTA: no divergence): the
  // rows' last keys (position + reach, or under chunks the geometry's per row:
  // SeqGeometry::last_key_at) and, under a left bound, their first keys (first_key_at); a row
  // whose range is empty has first > last, so the two masks together hide every column from
  // it. A block below mask_lo is full unless it lies in the lower band (full_below_end). kWindow: the rounds of
  // the kFeatures kernel (dense and block masks without mean correction: no other policy takes a
  // feature, check_support); the others compile none of it.
  const bool window_below = kFeatures && geo.seq.left_bounded();
  // Chunks: a row's chunk begins at position(row0) + chunk_begin_after(phase, row) (the phase
  // once per CTA: a 64-bit division per row spilled this kernel, 19 -> 68 local accesses).
  const bool chunked = kFeatures && geo.seq.chunk > 0;
  const int chunk_phase = chunked ? geo.seq.chunk_phase(geo.seq.position(row0)) : 0;
  auto mask_if_needed = [&](int kb, auto window_tag) {
    constexpr bool kWindow = decltype(window_tag)::value;
    if (kb < mask_lo && (!kWindow || !window_below || geo.full_below_end(qb, kb, chunk_phase))) return;
    const std::int64_t key0 = geo.key_begin(kb);
    const std::int64_t end_limit = geo.key_end(kb) - 1 - key0;
    const std::int64_t reach = geo.seq.reach();
    const std::int64_t diag = row0 + geo.seq.offset() - key0;  // + block row: the row's position
    int limit[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      std::int64_t lim = !kWindow    ? (p.causal ? geom::min64(diag + qrow[r], end_limit) : end_limit)
                         : reach >= 0 ? geom::min64(diag + reach + qrow[r], end_limit)
                                      : end_limit;
      // The chunk's last position (SeqGeometry::last_key_at), relative to the tile.
      if (kWindow && chunked) lim = geom::min64(lim, diag + geo.seq.chunk_begin_after(chunk_phase, qrow[r]) + geo.seq.chunk - 1);
      limit[r] = static_cast<int>(geom::min64(geom::max64(lim, -1), kTileN));
    }
    mask_tile(s, limit);
    if (kWindow && window_below) {
      int first[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const std::int64_t lo = geo.seq.first_key_after(geo.seq.position(row0), chunk_phase, qrow[r]) - key0;
        first[r] = static_cast<int>(geom::min64(geom::max64(lo, 0), kTileN));
      }
      mask_tile_below(s, first);
    }
  };
  // This warp's vote on gated position j from its rows' maxima (before the softmax moves m),
  // then the CTA's decision: the OR of the eight warps' votes, so a warp that votes keep knows it
  // without waiting for the others (the other warpgroup's S may still be in flight); every warp
  // of a warpgroup still reaches the same answer, which its P·V wgmma needs. Skipping the wait
  // leaves the slot safe to reuse: all warps stay within a round of each other (the turn
  // barriers), the producer within two positions (it reads a decision before the next K load),
  // and there are kVoteSlots = 4 slots.
  // FP8: the rules read the dequantized scores (the descales in both scales) and the true running
  // max, which m keeps kPLog2Offset below.
  const float gate_scale = Cfg::kFp8 ? p.scale * ptx::descale_of(p, 0, b, hk) * ptx::descale_of(p, 1, b, hk) : p.scale;
  auto vote = [&](int j, const float (&mx)[2]) -> bool {
    bool keep = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float m_run = Cfg::kFp8 ? stats.m[r] + static_cast<float>(Cfg::kPLog2Offset) : stats.m[r];
      keep |= gate.keeps_row(mx[r], m_run, qrow[r] < rows_valid, gate_scale, scale_log2);
    }
    keep = __any_sync(0xffffffffu, keep);
    const int g = j - first_gated;
    if (lane == 0) {
      sm.votes[g % Cfg::kVoteSlots][wg * 4 + warp] = keep ? 1 : 0;
      hw::mbar_arrive(hw::smem_u32(&sm.decided[g % Cfg::kVoteSlots]));  // release: orders the vote byte
    }
    return keep || decision(j);
  };

  const int my_turn = 1 + wg, other_turn = 2 - wg;
  // The rounds over the visit list, compiled once per kind of CTA (CTA-uniform): gated
  // (exact_gate, softmax_skip), with mean tiles (block masks with mean correction) or plain
  // (dense and block masks). Gates and mean tiles never meet (policy.cuh), so each copy carries
  // none of the others' tests and register moves, and the lazy rescale is a compile-time fact
  // outside the gated one.
  auto rounds = [&](auto gated_tag, auto means_tag) {
    constexpr bool kGated = decltype(gated_tag)::value, kMeans = decltype(means_tag)::value;
    constexpr bool kRegOnly = !kMeans;  // every position is a key block
    // A kept tile's P waits in pf for its P·V, issued in the next round with the next S
    // (pending); alpha rescales O just before it. A skipped tile leaves m, l, O and alpha as
    // they were.
    bool pending = false;
    int v_count = 0;  // V tiles consumed: the V ring's position
    for (int it = 0; it < n_visit; ++it) {
      const int st = it % Cfg::kStages;
      const int kb = kRegOnly || it < visit.n_reg ? visit.block(it) : -1;  // mask mode: a global load, issued early
      const int v_st = v_count % Cfg::kStages;
      if constexpr (!Cfg::kSerialPv) {
        hw::mbar_wait(hw::smem_u32(&sm.k_loaded[st]), (it / Cfg::kStages) & 1);
        if (gather) hw::fence_proxy_async();  // cp.async wrote the tile: the wgmma reads it
      }
      // Ping-pong: wait for the other warpgroup to have issued its GEMMs of this round, issue
      // ours, then let it go: its softmax overlaps our GEMMs and ours its next ones. Gated rounds
      // keep that order: passing the turn after Q·Kᵀ too (tensor order S0, S1, P·V0, P·V1, so a
      // skip vote waits for one Q·Kᵀ less) ran 2-8% slower for softmax_skip once a warp voting
      // keep no longer waited for the decision, and equal for exact_gate
      // (bench/records/2026-11-30-h200-gate-early-keep-ab.log).
      const bool gated = kGated && gate.gated(it, visit.n_a);
      hw::named_sync(my_turn);
      if constexpr (Cfg::kSerialPv) {
        // The previous tile's P·V completes before this S is issued (its P registers are then
        // free for S), the K wait after it so that the P·V runs meanwhile.
        if (pending) {
          hw::mbar_wait(hw::smem_u32(&sm.v_loaded[v_st]), (v_count / Cfg::kStages) & 1);
          issue_pv(v_st);
          hw::wgmma_wait<0>();
          hw::fence_regs(o);
          release(sm.v_free[v_st]);
          ++v_count;
        }
        hw::mbar_wait(hw::smem_u32(&sm.k_loaded[st]), (it / Cfg::kStages) & 1);
        issue_qk(st);
      } else {
        issue_qk(st);
        if (pending) {
          hw::mbar_wait(hw::smem_u32(&sm.v_loaded[v_st]), (v_count / Cfg::kStages) & 1);
          if (gather) hw::fence_proxy_async();
          issue_pv(v_st);
        } else {
          hw::wgmma_fence();
          hw::wgmma_commit();  // an empty group: the waits below count the same groups either way
        }
      }
      // The rounds balance: warpgroup 1 skips its last arrive, which warpgroup 0 would never consume.
      if (wg == 0 || it + 1 < n_visit) hw::named_arrive(other_turn);
      hw::wgmma_wait<Cfg::kSerialPv ? 0 : 1>();  // S of this tile done; the P·V may still run
      hw::fence_regs(s[0]);
      release(sm.k_free[st]);
      if (kRegOnly || it < visit.n_reg) {
        if constexpr (kFeatures && !Cfg::kFp8) {
          if (p.softcap > 0.f) cap_scores(s, p.cap_scale, p.softcap);
        }
        mask_if_needed(kb, std::bool_constant<kFeatures && !kGated && !kMeans>{});
      } else {
        // FP8: the block sizes' shift in raw e4m3 score units (the q and k descales).
        mask_mean_tile<1, 16, Cfg::kFp8>(p, s, mean_bits, sm.mean_tiles[it - visit.n_reg], seq.s_k, mean_blocks_seq,
                                          score_descale);
      }
      float mx[2];
      row_max_tile(s, mx);
      const bool keep = !gated || vote(it, mx);
      float alpha[2] = {1.f, 1.f};
      const bool moved = keep && softmax_tile<Cfg>(s, mx, stats, scale_log2, !kGated || lazy, alpha);
      // This warpgroup's previous P·V is still in flight; the wait for it ends the round. ptxas
      // hoists a wgmma wait to the top of its basic block, which in the plain and mean-tile
      // rounds put it before the row max: their softmax waited for the P·V it should overlap.
      // In branches of their own the waits stay after the softmax: dense 3.3-4.8% faster at
      // 16K-128K, block masks at 20% 2-6%, estimate_select + mean correction at 128K 1.5%
      // (bench/records/2026-11-30-h200-wait-after-softmax-ab.log). FP8 keeps one wait, which
      // ptxas hoists as before: the overlap made it 5% slower (same record; not profiled).
      // ptxas's schedule follows this exact form (a lambda for the wait, or the FP8 arm written
      // otherwise, gave other SASS): compare the SASS (scripts/profile/sass_local.sh) before
      // rewriting it.
      if constexpr (Cfg::kSerialPv) {
        if (moved) scale_acc(o, alpha);  // the previous P·V completed before this S
      } else if constexpr (Cfg::kFp8) {
        hw::wgmma_wait<0>();  // P·V done: its P registers and V stage are free
        hw::fence_regs(o);
        if (moved) scale_acc(o, alpha);  // for this tile's P·V, next round
      } else if (moved) {
        hw::wgmma_wait<0>();
        hw::fence_regs(o);
        scale_acc(o, alpha);
      } else {
        hw::wgmma_wait<0>();
        hw::fence_regs(o);
      }
      if (!Cfg::kSerialPv && pending) {
        release(sm.v_free[v_st]);
        ++v_count;
      }
      // Packed whether kept or not (a skipped tile's pf is never read): a conditional write of
      // the P·V A-operand registers makes ptxas serialise every wgmma (C7518, measured on the
      // build: "WG.DP in divergent path").
      pending = keep;
      pack_p<Cfg>(s, pf);
      if (keep) {
        if (kRegOnly || it < visit.n_reg) record_kept(kept_row, kb);
      }
    }
    if (pending) {  // the last kept tile's P·V
      const int v_st = v_count % Cfg::kStages;
      hw::mbar_wait(hw::smem_u32(&sm.v_loaded[v_st]), (v_count / Cfg::kStages) & 1);
      if (gather) hw::fence_proxy_async();
      issue_pv(v_st);
      hw::wgmma_wait<0>();
      hw::fence_regs(o);
      release(sm.v_free[v_st]);
    }
  };
  if (n_visit > 0) {
    if (wg == 1) hw::named_arrive(1);  // warpgroup 0 issues first
    hw::mbar_wait(hw::smem_u32(&sm.q_loaded), 0);
    if constexpr (Cfg::kQInRegs) load_q_frags<Cfg>(qf, hw::smem_u32(sm.q), wg);
    if constexpr (kFeatures) {
      // A feature: dense and block masks without mean correction (check_support).
      rounds(std::false_type{}, std::false_type{});
    } else if constexpr (Cfg::kFp8) {
      // FP8: one kind of rounds per kernel (kFp8), which launch_fwd picks.
      rounds(std::bool_constant<kFp8 == Fp8Rounds::kGates>{}, std::bool_constant<kFp8 == Fp8Rounds::kMeans>{});
    } else if (gate.exact || gate.skip) {
      rounds(std::true_type{}, std::false_type{});
    } else if (n_visit > visit.n_reg) {
      rounds(std::false_type{}, std::true_type{});
    } else {
      rounds(std::false_type{}, std::false_type{});
    }
  }

  // ---------------------------------------------------------------- epilogue: O and LSE
  // Rows past s_q are not stored. The accumulator's zero columns past d_v (d = 96) stay live to
  // here: dead wgmma outputs made ptxas serialise every wgmma (C7511) and spill.
#pragma unroll
  for (int j = Cfg::kOutFrags; j < Cfg::kDFrags; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" ::"f"(o[j][e]));
  }
  auto* o_base = static_cast<std::uint16_t*>(p.o) + seq.o_off + row0 * p.o_row_stride;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float o_scale, lse;
    if constexpr (kFeatures && !Cfg::kFp8) {
      const int sink_head = h + (r0 + 8 * r) % pack;  // the row's query head
      finalize_row_sink(stats.m[r], stats.l[r], head_sink_log2(p.sinks, p.sinks_stride, sink_head), &o_scale, &lse);
    } else {
      finalize_row(stats.m[r], stats.l[r], &o_scale, &lse);
    }
    o_scale *= o_descale;
    const int row = qrow[r];
    const int qhead = h + (r0 + 8 * r) % pack;
    if (row >= rows_valid) continue;
    std::uint16_t* o_row = o_base + row * p.o_row_stride + qhead * p.o_head_stride;
#pragma unroll
    for (int j = 0; j < Cfg::kOutFrags; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<std::uint32_t*>(o_row + col) =
          ptx::pack2<Cfg::kBf16>(o[j][2 * r] * o_scale, o[j][2 * r + 1] * o_scale);
    }
    if (p.lse != nullptr && lane % 4 == 0) {
      p.lse[seq.lse_off + qhead * p.lse_head_stride + (row0 + row) * p.lse_row_stride] = lse;
    }
  }
}

// ------------------------------------------------------------------ FP8's V
// A [128 keys][kD] e4m3 tile in shared memory (rows kPitch bytes apart) -> its transpose at
// out ([kD rows][128 keys], rows `stride` bytes apart): column 16g + j of the tile's 128 holds
// key 16g + perm(j), perm(4t + i) = 2t + i for i < 2 and 8 + 2t + i - 2 otherwise, the order in
// which pack_p hands the e4m3 A fragment the S accumulator's columns. By all threads of the CTA.
template <int kD, int kPitch>
__device__ __forceinline__ void store_transposed(const std::uint8_t (&tile)[128][kPitch], std::uint8_t* out,
                                                 std::int64_t stride) {
  constexpr int kKeys = 128;
  for (int c = threadIdx.x; c < kD * kKeys / 16; c += blockDim.x) {
    const int dd = c / (kKeys / 16), g = c % (kKeys / 16);  // row d, 16 keys 16g ..
    std::uint32_t w[4];
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // bytes 4t .. 4t + 3: keys 16g + 2t, + 1, + 8, + 9
      const int k = 16 * g + 2 * t;
      w[t] = tile[k][dd] | (tile[k + 1][dd] << 8) | (tile[k + 8][dd] << 16) |
             (static_cast<std::uint32_t>(tile[k + 9][dd]) << 24);
    }
    *reinterpret_cast<uint4*>(out + dd * stride + 16 * g) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// V [.., s_k, h_kv, d] e4m3 -> v_t [batch, h_kv, d, vt_stride] (FwdParams::v_t, d: kHeadDimV),
// tile by tile of 128 keys (store_transposed); keys past s_k are zero (their P is 0: masked).
// Grid (vt_stride / 128, h_kv, batch), 256 threads; rows are 16-byte aligned
// (tma_describable). A template, as every kernel in this header: one copy per instance
// translation unit.
template <class Cfg>
__global__ void __launch_bounds__(256) transpose_v_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kKeys = 128, kD = Cfg::kHeadDimV, kPad = 16;  // padded rows keep 16-byte alignment
  __shared__ alignas(16) std::uint8_t tile[kKeys][kD + kPad];  // [key][d]
  const int b = blockIdx.z, hk = blockIdx.y;
  const std::int64_t key0 = static_cast<std::int64_t>(blockIdx.x) * kKeys;
  const SeqInfo seq = p.seqs[b];
  const auto* v = static_cast<const std::uint8_t*>(p.v) + seq.v_off + hk * p.v_head_stride;
  for (int c = threadIdx.x; c < kKeys * kD / 16; c += blockDim.x) {
    const int r = c / (kD / 16), chunk = c % (kD / 16);
    uint4 val = make_uint4(0u, 0u, 0u, 0u);
    if (key0 + r < seq.s_k) val = *reinterpret_cast<const uint4*>(v + (key0 + r) * p.v_row_stride + chunk * 16);
    *reinterpret_cast<uint4*>(&tile[r][chunk * 16]) = val;
  }
  __syncthreads();
  store_transposed<kD>(tile, p.v_t + (static_cast<std::int64_t>(b) * p.h_kv + hk) * kD * p.vt_stride + key0,
                       p.vt_stride);
}

// 8 bf16 (a 16-byte chunk) times `inv`, rounded to e4m3 (saturating at ±448): 8 bytes.
__device__ __forceinline__ uint2 e4m3_of_bf16x8(uint4 in, float inv) {
  const std::uint32_t w[4] = {in.x, in.y, in.z, in.w};
  float f[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = ptx::to_float<true>(static_cast<std::uint16_t>(w[e / 2] >> (16 * (e % 2)))) * inv;
  return make_uint2(hw::pack4_e4m3(f[0], f[1], f[2], f[3]), hw::pack4_e4m3(f[4], f[5], f[6], f[7]));
}

// The reciprocal of a descale, 0 where it is not finite (a descale of 0: every score or output
// term it scales is 0 whatever the requantized mean holds).
__device__ __forceinline__ float inverse_descale(float descale) {
  const float inv = 1.f / descale;
  return isfinite(inv) ? inv : 0.f;
}

// FP8 mean tiles' operands from the bf16 means of 128 pooled blocks (FwdParams::k_mean8,
// v_mean_t): k̄ / k_descale row-major, v̄ / v_descale through the tile transposed as V's
// (store_transposed; blocks past mean_blocks zero). Scores q·k̄₈ then take the q and k descales
// of the key tiles' scores, and P·v̄₈ᵀ V's descale of the output. Grid (mean_stride / 128, h_kv,
// batch), 256 threads.
template <class Cfg>
__global__ void __launch_bounds__(256) quantize_means_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kBlocks = 128, kD = Cfg::kHeadDim, kDV = Cfg::kHeadDimV, kPad = 16;
  __shared__ alignas(16) std::uint8_t tile[kBlocks][kDV + kPad];  // [block][d_v]
  const int b = blockIdx.z, hk = blockIdx.y;
  const int j0 = static_cast<int>(blockIdx.x) * kBlocks;
  const std::int64_t plane = static_cast<std::int64_t>(b) * p.h_kv + hk;
  const float k_inv = inverse_descale(ptx::descale_of(p, 1, b, hk)), v_inv = inverse_descale(ptx::descale_of(p, 2, b, hk));
  const auto* k_mean = static_cast<const uint4*>(p.k_mean) + plane * p.mean_blocks * (kD / 8);
  const auto* v_mean = static_cast<const uint4*>(p.v_mean) + plane * p.mean_blocks * (kDV / 8);
  auto* k_out = reinterpret_cast<uint2*>(p.k_mean8) + plane * p.mean_blocks * (kD / 8);
  for (int c = threadIdx.x; c < kBlocks * kD / 8; c += blockDim.x) {
    const int j = j0 + c / (kD / 8);
    if (j < p.mean_blocks) {
      const std::int64_t at = static_cast<std::int64_t>(j) * (kD / 8) + c % (kD / 8);
      k_out[at] = e4m3_of_bf16x8(k_mean[at], k_inv);
    }
  }
  for (int c = threadIdx.x; c < kBlocks * kDV / 8; c += blockDim.x) {
    const int r = c / (kDV / 8), chunk = c % (kDV / 8);
    const int j = j0 + r;
    const uint2 val = j < p.mean_blocks ? e4m3_of_bf16x8(v_mean[static_cast<std::int64_t>(j) * (kDV / 8) + chunk], v_inv)
                                        : make_uint2(0u, 0u);
    *reinterpret_cast<uint2*>(&tile[r][chunk * 8]) = val;
  }
  __syncthreads();
  store_transposed<kDV>(tile, p.v_mean_t + plane * kDV * p.mean_stride + j0, p.mean_stride);
}

// ------------------------------------------------------------------ host side
// The tensor maps' element type: e4m3 bytes travel as UINT8.
template <class Cfg>
constexpr CUtensorMapDataType map_dtype() {
  if (Cfg::kFp8) return CU_TENSOR_MAP_DATA_TYPE_UINT8;
  return Cfg::kBf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// cuTensorMapEncodeTiled from the driver through the runtime's entry-point query (no -lcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

// 3-D map (d, head, row) over one sequence's rows of a [s, h, d] tensor with element strides;
// boxes of [box_rows][box_heads][128 bytes] with 128B swizzle; rows past `rows` and columns
// past d (Cfg::kHeadDim, or kHeadDimV for V: `value`) read as zero. A dimension of extent 1 is
// never stepped over, so its stride is replaced by a valid one (TMA wants multiples of 16).
template <class Cfg>
bool encode_map(CUtensorMap* map, const void* base, bool value, std::int64_t rows, int heads, std::int64_t row_stride,
                std::int64_t head_stride, int box_rows = Cfg::kTileN, int box_heads = 1) {
  constexpr std::int64_t kElem = Cfg::kElemBytes;
  const int d = value ? Cfg::kHeadDimV : Cfg::kHeadDim;
  const std::int64_t row_bytes = d * kElem;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows > 0 ? rows : 1)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(heads > 1 ? head_stride * kElem : row_bytes),
                                 static_cast<cuuint64_t>(rows > 1 ? row_stride * kElem : row_bytes * heads)};
  const cuuint32_t box[3] = {Cfg::kHalfDim, static_cast<cuuint32_t>(box_heads), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      map, map_dtype<Cfg>(), 3, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// 4-D map (d, head, row in page, page) over a paged cache [pages, page_size, heads, d] with
// element strides; boxes of [paged_box_rows][128 bytes] (rows of one page) with 128B swizzle.
// Strides of extent-1 dimensions are replaced as in encode_map (paged instances: d_v = d).
template <class Cfg>
bool encode_cache_map(CUtensorMap* map, const void* base, std::int64_t pages, int page_size, int heads,
                      std::int64_t page_stride, std::int64_t row_stride, std::int64_t head_stride) {
  constexpr std::int64_t kElem = Cfg::kElemBytes;
  const std::int64_t row_bytes = Cfg::kHeadDim * kElem;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(Cfg::kHeadDim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(page_size), static_cast<cuuint64_t>(pages)};
  const cuuint64_t strides[3] = {
      static_cast<cuuint64_t>(heads > 1 ? head_stride * kElem : row_bytes),
      static_cast<cuuint64_t>(page_size > 1 ? row_stride * kElem : row_bytes * heads),
      static_cast<cuuint64_t>(pages > 1 ? page_stride * kElem : row_bytes * heads * page_size)};
  const cuuint32_t box[4] = {Cfg::kHalfDim, 1, static_cast<cuuint32_t>(paged_box_rows(page_size)), 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      map, map_dtype<Cfg>(), 4, const_cast<void*>(base), dims, strides, box, elem_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// 4-D map (d, block, head, batch) over the block means [batch, heads, blocks, d] (contiguous,
// written by the block-means kernel, FP8's k̄₈ by quantize_means_kernel; d: Q/K's for k̄, V's for
// v̄); boxes of [128 blocks][128 bytes] with 128B swizzle; blocks past the capacity and columns
// past d read as zero (the means kernel zeroes each sequence's unused blocks).
template <class Cfg>
bool encode_mean_map(CUtensorMap* map, const void* base, int d, int blocks, int heads, int batch) {
  const std::int64_t kRowBytes = std::int64_t{d} * Cfg::kElemBytes;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(blocks),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(kRowBytes), static_cast<cuuint64_t>(kRowBytes * blocks),
                                 static_cast<cuuint64_t>(kRowBytes * blocks * heads)};
  const cuuint32_t box[4] = {Cfg::kHalfDim, Cfg::kTileN, 1, 1};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  const CUresult r = tensor_map_encoder()(
      map, map_dtype<Cfg>(), 4, const_cast<void*>(base),
      dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// FP8's Vᵀ (FwdParams::v_t, [planes = batch · h_kv][d][vt_stride keys] bytes) as a 3-D map
// (key, d, plane) with boxes of [d rows][128 keys] (d <= 256, TMA's box bound) and 128B swizzle:
// the K-major B tile of P·V, laid out as a K tile.
inline bool encode_vt_map(CUtensorMap* map, const void* base, std::int64_t vt_stride, int d, int planes) {
  const auto kD = static_cast<cuuint64_t>(d);
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(vt_stride), kD, static_cast<cuuint64_t>(planes)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(vt_stride), static_cast<cuuint64_t>(vt_stride) * kD};
  const cuuint32_t box[3] = {128, static_cast<cuuint32_t>(d), 1};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult r = tensor_map_encoder()(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<void*>(base), dims, strides,
                                          box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

// Host-side launch of one instance; returns a cudaError_t value (0 = success) or the
// uploader's kUploadRefused. `seqs` is the host copy of p.seqs and, for paged K/V, `table` the
// host copy of p.paged.block_table ([batch, table_stride], the compact table: entries past a
// sequence's pages are 0); `upload` places the tensor maps (batch · sizeof(SeqMaps) bytes, one
// SeqMaps more for paged K/V) in device memory. Returns cudaErrorNotSupported, having
// enqueued nothing, when the driver cannot encode a tensor map for these tensors (the
// dispatcher then takes the portable path).
template <class Cfg>
int launch_fwd(const FwdParams& p, const SeqInfo* seqs, const std::int32_t* table, const HostUpload& upload,
               void* stream) {
  if (tensor_map_encoder() == nullptr) return static_cast<int>(cudaErrorNotSupported);
  // Policies other than dense run on 128-key blocks, the kernel's tile; K/V are paged exactly
  // in the kPaged instances (choose_fwd_path). The host table decides (a plan caches the maps
  // of a paged call before any device table exists); the device table must be there by the
  // launch. Gathered pages (hopper_gathers_pages) need no K/V maps.
  const bool paged = table != nullptr;
  const bool gather = paged && p.paged.gather_rows;
  if ((p.mode != PolicyMode::kDense && p.block_k != Cfg::kTileN) || paged != Cfg::kPaged ||
      (!paged && p.paged.block_table != nullptr) || (paged && p.paged.page_size < 1) ||
      (paged && !gather && p.paged.page_size % 8 != 0)) {
    return static_cast<int>(cudaErrorNotSupported);
  }
  // The model-family features only where the kFeatures kernel compiles them: dense and block
  // masks without mean correction, a softcap and sinks on 16-bit inputs (check_support;
  // make_fwd_params passes a window only where it hides keys).
  const bool features = has_features(p);
  if (features && (gated_mode(p.mode) || p.k_mean != nullptr || (Cfg::kFp8 && (p.softcap > 0.f || p.sinks)))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  // GQA packing only as choose_q_pack gives it: the group, for visits shared by its heads.
  const int pack = p.q_pack;
  if (pack < 1 || (pack > 1 && (pack != p.group || Cfg::kTileM % pack != 0 || p.kept_bits != nullptr ||
                                !(p.mode == PolicyMode::kDense || (p.mode == PolicyMode::kBlockMask && p.mask_per_kv_head))))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  ScratchMaps scratch_maps{};
  if (p.k_mean != nullptr) {
    if constexpr (Cfg::kFp8) {
      // The requantized means are the call's scratch, as v_t (a plan caching its maps has none yet).
      if (p.k_mean8 == nullptr || p.v_mean_t == nullptr || p.mean_stride < Cfg::kTileN ||
          p.mean_stride % Cfg::kTileN != 0 || p.mean_stride < p.mean_blocks) {
        return static_cast<int>(cudaErrorInvalidValue);
      }
      if (!(encode_mean_map<Cfg>(&scratch_maps.k_mean, p.k_mean8, Cfg::kHeadDim, p.mean_blocks, p.h_kv, p.batch) &&
            encode_vt_map(&scratch_maps.v_mean, p.v_mean_t, p.mean_stride, Cfg::kHeadDimV, p.batch * p.h_kv))) {
        return static_cast<int>(cudaErrorNotSupported);
      }
    } else if (!(encode_mean_map<Cfg>(&scratch_maps.k_mean, p.k_mean, Cfg::kHeadDim, p.mean_blocks, p.h_kv, p.batch) &&
                 encode_mean_map<Cfg>(&scratch_maps.v_mean, p.v_mean, Cfg::kHeadDimV, p.mean_blocks, p.h_kv, p.batch))) {
      return static_cast<int>(cudaErrorNotSupported);
    }
  }
  std::vector<SeqMaps> maps(static_cast<std::size_t>(p.batch) + (paged ? 1 : 0));
  using Elem = std::conditional_t<Cfg::kFp8, std::uint8_t, std::uint16_t>;
  const auto* k = static_cast<const Elem*>(p.k);
  const auto* v = static_cast<const Elem*>(p.v);
  const int page_size = p.paged.page_size;
  std::int32_t pages = 1;  // every used table entry is below it (the cache maps' page extent)
  for (int b = 0; b < p.batch; ++b) {
    const SeqInfo& s = seqs[b];
    SeqMaps& m = maps[static_cast<std::size_t>(b)];
    bool ok = encode_map<Cfg>(&m.q, static_cast<const Elem*>(p.q) + s.q_off, false, s.s_q, p.h_q, p.q_row_stride,
                              p.q_head_stride, Cfg::kTileM / pack, pack);
    if (!paged) {
      // FP8 reads V through scratch_maps.v_t (the transposed copy), not through m.v.
      ok = ok && encode_map<Cfg>(&m.k, k + s.k_off, false, s.s_k, p.h_kv, p.k_row_stride, p.k_head_stride) &&
           (Cfg::kFp8 || encode_map<Cfg>(&m.v, v + s.v_off, true, s.s_k, p.h_kv, p.v_row_stride, p.v_head_stride));
    } else {
      const std::int64_t used = (s.s_k + page_size - 1) / page_size;
      for (std::int64_t i = 0; i < used; ++i) pages = std::max(pages, table[b * p.paged.table_stride + i] + 1);
      if (!gather) {
        // TMA boxes: the tail map over the rows of the last page holding keys (a sequence
        // without keys maps one row of page 0, never read: it visits no key tile).
        const std::int64_t last = used > 0 ? used - 1 : 0;
        const std::int64_t entry = used > 0 ? table[b * p.paged.table_stride + last] : 0;
        const std::int64_t tail_rows = used > 0 ? s.s_k - last * page_size : 1;
        const int box_rows = paged_box_rows(page_size);
        ok = ok &&
             encode_map<Cfg>(&m.k, k + entry * p.paged.k_page_stride, false, tail_rows, p.h_kv, p.k_row_stride,
                             p.k_head_stride, box_rows) &&
             encode_map<Cfg>(&m.v, v + entry * p.paged.v_page_stride, true, tail_rows, p.h_kv, p.v_row_stride,
                             p.v_head_stride, box_rows);
      }
    }
    if (!ok) return static_cast<int>(cudaErrorNotSupported);
  }
  if (gather && !(gather_offsets_fit(pages, page_size, p.paged.k_page_stride, p.k_row_stride) &&
                  gather_offsets_fit(pages, page_size, p.paged.v_page_stride, p.v_row_stride))) {
    return static_cast<int>(cudaErrorNotSupported);
  }
  if (paged && !gather) {
    SeqMaps& cache = maps.back();
    const bool ok = encode_cache_map<Cfg>(&cache.k, k, pages, page_size, p.h_kv, p.paged.k_page_stride, p.k_row_stride,
                                          p.k_head_stride) &&
                    encode_cache_map<Cfg>(&cache.v, v, pages, page_size, p.h_kv, p.paged.v_page_stride, p.v_row_stride,
                                          p.v_head_stride);
    if (!ok) return static_cast<int>(cudaErrorNotSupported);
  }
  const auto st = static_cast<cudaStream_t>(stream);
  // One CTA per (tile of 128 / pack positions of the longest sequence, batch, unit of pack
  // heads): the plan's hopper_grid, which the kernel decodes through gridDim.
  const auto grid = static_cast<unsigned>(p.grid);
  if (p.grid <= 0) return 0;
  const void* map_device = nullptr;
  ParamMaps param_maps{};
  if (maps.size() <= static_cast<std::size_t>(kParamSeqMaps)) {
    std::copy(maps.begin(), maps.end(), param_maps.seq);
  } else {
    const int uploaded = upload.fn(upload.context, maps.data(), maps.size() * sizeof(SeqMaps), &map_device);
    if (uploaded != 0) return uploaded;
    // prefetch.tensormap and the TMA copies need each CUtensorMap 64-byte aligned.
    if (reinterpret_cast<std::uintptr_t>(map_device) % 64 != 0) return static_cast<int>(cudaErrorMisalignedAddress);
  }
  if (paged && p.paged.block_table == nullptr) return static_cast<int>(cudaErrorInvalidValue);
  if constexpr (Cfg::kFp8) {
    // The transposed V is the call's scratch (a plan caching its maps has none yet).
    if (p.v_t == nullptr || p.vt_stride < Cfg::kTileN || p.vt_stride % Cfg::kTileN != 0) {
      return static_cast<int>(cudaErrorInvalidValue);
    }
    if (!encode_vt_map(&scratch_maps.v_t, p.v_t, p.vt_stride, Cfg::kHeadDimV, p.batch * p.h_kv)) {
      return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  auto* kernel = features ? fwd_kernel<Cfg, true> : fwd_kernel<Cfg, false>;
  if constexpr (Cfg::kFp8) {
    if (!features && gated_mode(p.mode)) kernel = fwd_kernel<Cfg, false, Fp8Rounds::kGates>;
    if (!features && p.k_mean != nullptr) kernel = fwd_kernel<Cfg, false, Fp8Rounds::kMeans>;
  }
  const int smem = static_cast<int>(sizeof(Smem<Cfg>)) + 1024;  // + alignment slack
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  if constexpr (Cfg::kFp8) {
    const dim3 vt_grid(static_cast<unsigned>(p.vt_stride / Cfg::kTileN), static_cast<unsigned>(p.h_kv),
                       static_cast<unsigned>(p.batch));
    transpose_v_kernel<Cfg><<<vt_grid, 256, 0, st>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
    if (p.k_mean != nullptr) {
      const dim3 means_grid(static_cast<unsigned>(p.mean_stride / Cfg::kTileN), static_cast<unsigned>(p.h_kv),
                            static_cast<unsigned>(p.batch));
      quantize_means_kernel<Cfg><<<means_grid, 256, 0, st>>>(p);
      err = cudaGetLastError();
      if (err != cudaSuccess) return static_cast<int>(err);
    }
  }
  kernel<<<grid, Cfg::kThreads, smem, st>>>(p, static_cast<const SeqMaps*>(map_device), scratch_maps, param_maps);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace sparseprefill::cuda::sm90
