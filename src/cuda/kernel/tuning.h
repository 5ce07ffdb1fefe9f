// SPDX-License-Identifier: Apache-2.0
// The tuning table: every number (and tuned condition) that sets how fast the CUDA backend
// runs without changing what it computes, with the benchmark that reproduces it. One row
// each: the value, what it decides, and `reproduce:` the command (bench/run_benchmarks.sh is
// run on the GPU machine after scripts/gpu_check.sh's build; "A/B" is
// scripts/profile/ab_bench.sh with the patch that changes the row) and the record under
// bench/records/ whose figures chose it. Plain constexpr: the kernels and the host planning
// (plan.cpp, runtime.h) both read it; docs/cuda.md, "Tuning", points here. Limits that are
// correctness (capacities, hardware bounds) stay beside the code they bound.
#pragma once

#include <cstdint>

#include "core/geometry.h"  // SP_HD: the tuned conditions are evaluated in device code too

namespace sparseprefill::cuda::tuning {

// ---------------------------------------------------------------- host planning (plan.cpp)

// Paged K/V on the Hopper kernel: one TMA box per page for pages of at least this many keys
// (that tile the 128-key tile or hold whole tiles); smaller pages gather rows with cp.async
// (boxes of 8-32 rows cost the TMA unit more than gathering).
// reproduce: build/h200/src/cuda/sp_cuda_tiles paged 1 8 16 24 32 64 128 256
//            (record 2026-11-29-h200-paged-producer; end to end -paged-gathered-32-key-pages)
constexpr int kHopperBoxMinPageKeys = 64;

// GQA packing (choose_q_pack, auto): pack when the packed tiles are fewer than
// kPackGqaNum / kPackGqaDen of the unpacked ones (packing never costs time; the margin keeps
// calls whose tiles are full anyway where they always ran).
// reproduce: SPARSEPREFILL_PACK_GQA=always|never bench/run_benchmarks.sh OUT --lengths 8192,32768
//            --chunked-lengths 8192 --chunk 64 --impls sdpa_cudnn,ours_dense,ours_dense_chunked
//            (records 2026-11-30-h200-gqa-packing-always / -never, -batched-chunks-gqa-packing-32 / -64)
constexpr int kPackGqaNum = 9;
constexpr int kPackGqaDen = 10;

// exact_gate's Hopper decision kernel: query heads of one KV group per CTA, at most (shared
// memory holds this many Q tiles of d 128 beside two K stages).
// reproduce: bench/run_benchmarks.sh OUT --impls ours_dense,ours_exact_gate --gate-densities 0.2,0.5
//            (record 2026-11-30-h200-exact-gate-two-passes)
constexpr int kGateHeadsPerCta = 4;

// The key block dense attention runs with: every 64-key sub-tile is its own step whatever the
// block, and 64 keeps the per-block bookkeeping trivial (no effect on results).
constexpr int kDenseBlockK = 64;

// Staging paged K/V into rows (plan_kv_staging): dense FLOP/s over the copy's bytes/s on the
// H200 (561 TFLOP/s bf16 causal 128K over 3.3 TB/s), the lightest in-kernel page reading
// measured (1.10x contiguous), the density assumed for estimate_select and permute_stop, and
// the share of the free device memory the staged rows may take.
// reproduce: bench/run_benchmarks.sh OUT --lengths 32768,131072 --paged-lengths 32768,131072
//            --page-sizes 1,16,64 --gate-densities 0.2 (records 2026-11-29-h200-paged-staging,
//            -paged-gathered-32-key-pages, -portable-sm80-paged-tiles)
constexpr double kFlopsPerCopyByte = 170.0;
constexpr double kGatheredCost = 0.10;
constexpr double kSparseDensity = 0.05;
constexpr int kStagingFreeShare = 4;  // staged bytes <= free / this

// ---------------------------------------------------------------- memory (runtime.h)

// What the scratch pool keeps of freed memory between calls (steady calls cost no cudaMalloc;
// the rest returns to the device at the next synchronisation), and the metadata cache's
// default cap per device (SPARSEPREFILL_CUDA_CACHE_BYTES overrides it).
// reproduce: build/h200/tests/cuda/cuda_memory_test (the bound), bench/host_path.cpp (the cost)
constexpr std::uint64_t kScratchKeepBytes = std::uint64_t{256} << 20;
constexpr std::uint64_t kMetadataCacheBytes = std::uint64_t{64} << 20;

// ---------------------------------------------------------------- Hopper forward kernel

// Pipeline stages of K/V tiles: FP8's tiles are half the bytes, so 4 fit where 16-bit fits 2;
// at d 256 (64 KB a 16-bit tile, 32 KB an e4m3 one) Q and one 16-bit K and V stage fill 192 KB,
// two do not fit; e4m3 there takes 2 (160 KB; 2-6 measured equal at d 128).
// reproduce: bench_attention.py --lengths 32768 --impls ours_dense,ours_dense_fp8 over kStages
//            (record 2026-11-29-h200-fp8-stages; 16-bit -dev-sm90-dense)
SP_HD constexpr int hopper_stages(bool fp8, int head_dim) {
  return head_dim > 192 ? (fp8 ? 2 : 1) : (fp8 ? 4 : 2);
}

// Q kept in registers through the main loop (16-bit contiguous d 128 only: elsewhere the
// registers are needed more).
// reproduce: A/B qreg.patch --lengths 16384,65536 --small-lengths 8192 --densities 0.2 --gate-densities 0.2
//            (records 2026-11-30-h200-hopper-q-in-registers-ab.log, -fp8-q-in-registers-ab.log)
SP_HD constexpr bool hopper_q_in_registers(bool fp8, bool paged, int head_dim) {
  return !fp8 && !paged && head_dim == 128;
}

// Registers of the producer and consumer warpgroups (setmaxnreg): contiguous 24 / 240; paged
// (the producer gathers or walks the block table) 56 / 224 at d 128 and 40 / 232 at d 64.
// reproduce: scripts/gpu_check.sh OUT (resources.txt) and the paged rows of
//            bench/run_benchmarks.sh (record 2026-11-29-h200-paged-producer)
SP_HD constexpr int hopper_producer_regs(bool paged, int head_dim) {
  return !paged ? 24 : head_dim == 128 ? 56 : 40;
}
SP_HD constexpr int hopper_consumer_regs(bool paged, int head_dim) {
  return !paged ? 240 : head_dim == 128 ? 224 : 232;
}

// ---------------------------------------------------------------- portable forward kernel

// Keys per sub-tile and warps per CTA (128 query rows: 32 per warp).
// reproduce: build/h200/src/cuda/sp_cuda_tiles (record 2026-11-29-h200-portable-sm80-kernel-tiles)
constexpr int kPortableBlockN = 64;
constexpr int kPortableWarps = 4;
// Q/K head dims above 128 (192, 256): 8 warps of 16 rows, one CTA per SM. Not a timing choice:
// 32 rows of a d = 256 accumulator are 256 fp32 registers a thread, over the 255 a thread can
// hold; 16 rows are 128. q/k 192 (v 128) takes the same shape, untimed against 4 warps.
constexpr int kPortableWarpsWide = 8;

// XOR-swizzled fragment addresses and the next fragment's loads issued ahead: ungated
// instances only (the gates' vote needs the registers).
// reproduce: SPARSEPREFILL_CUDA_PATH=portable bench/run_benchmarks.sh OUT --lengths 8192,131072
//            --impls sdpa_flash,ours_dense,ours_exact_gate,ours_block_sparse
//            (records 2026-11-30-h200-portable-xor-fragment-addresses, -portable-dense-pipelined-fragments)
SP_HD constexpr bool portable_xor_fragments(bool gated) { return !gated; }
SP_HD constexpr bool portable_fragments_ahead(bool gated) { return !gated; }

// ---------------------------------------------------------------- softmax

// Lazy rescaling: the running maximum moves (and O is rescaled) only when a row's new maximum
// exceeds it by more than this, in log2 units (exact: the final O and LSE use the true max).
// reproduce: bench/run_benchmarks.sh OUT (records 2026-11-30-h200-lazy-rescale, -portable-lazy-rescale)
constexpr float kLazyMaxLog2 = 8.f;

// FP8 P: e4m3 keeps 3 mantissa bits from 2^-6 (subnormals to 2^-9) up to 448, so p = exp2(x - m)
// in [0, 1] loses the many small terms of a long row (at 32K keys of the uniform(-3, 3) test
// inputs a fifth of a row's mass: its LSE 0.22 low). The FP8 kernel keeps its running max
// kFp8PLog2Offset below the true one, so p comes out 2^offset times larger (O and l alike; the
// LSE is m + log2 l as ever), and moves it lazily only within kFp8LazyMaxLog2 of that, so that p
// stays below 2^(offset + lazy) = 2^8.5 = 362 < 448.
// reproduce: CudaFp8.ErrorDoesNotGrowWithTheKeyCount and bench/run_benchmarks.sh OUT
//            --impls sdpa_cudnn,ours_dense,ours_dense_fp8 (records 2026-12-01-h200-gpu-suite-redesign,
//            -redesign-ab)
constexpr int kFp8PLog2Offset = 7;
constexpr float kFp8LazyMaxLog2 = 1.5f;
static_assert(kFp8PLog2Offset + kFp8LazyMaxLog2 <= 8.5f, "p must stay below e4m3's 448");

// ---------------------------------------------------------------- estimate_select's selector

// Block means: threads per CTA (16-byte chunks of a key row each).
// reproduce: bench/run_benchmarks.sh OUT --structured-lengths 131072,32768
//            --impls ours_estimate_select_mc,ours_estimate_select_mc_packed --kernel-profile
//            (record 2026-11-30-h200-selector-block-means-vectorized)
constexpr int kMeansThreads = 128;

// The portable selector: warps per CTA, query halves, and the rounds of its keep scan.
// reproduce: the same command (records 2026-11-29-h200-selector-chunks-of-64-query-halves,
//            2026-11-30-h200-selector-one-scan)
constexpr int kSelectWarps = 8;
constexpr int kSelectHalves = 2;
constexpr int kSelectScanRounds = 4;

// The Hopper selector: pooled blocks per warpgroup step (wgmma M) and k̄ buffers per warpgroup.
// reproduce: the same command (records 2026-11-30-h200-selector-hopper-split-last-chunk, -in-step)
constexpr int kSelect90Chunk = 64;
constexpr int kSelect90Stages = 2;

// ---------------------------------------------------------------- other kernels

// permute_stop's prefix scores: query heads scored per pass over a key tile.
// reproduce: bench/run_benchmarks.sh OUT --structured-lengths 131072 --impls ours_permute_stop
//            (record 2026-11-29-h200-permute-ranking-one-read)
constexpr int kPermuteScoreHeads = 8;

// Threads per CTA of the paged K/V staging copy and warps per CTA of the device mask check
// (memory-bound passes: any full CTA does).
constexpr int kStageKvThreads = 256;
constexpr int kMaskCheckWarps = 8;

}  // namespace sparseprefill::cuda::tuning
