// SPDX-License-Identifier: Apache-2.0
// Host-side planning of a CUDA call, as pure functions (host-tested, no CUDA headers): what the
// compiled kernels support, which instance serves a call, the kernel parameters and the
// conversions between BlockMask and the kernels' device formats.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/estimate_chunks.h"
#include "cuda/kernel/fwd_params.h"
#include "sparseprefill/attention.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill::cuda {

// What the compiled kernels serve, as one line for messages.
std::string support_summary();

// Whether a compiled kernel serves (shape, policy); on success *block_k is the key-block size
// the kernel runs with (the policy's, or dense_block_k). Only shapes and parameters are
// checked (no pointers).
Status check_support(const ProblemShape& shape, const Policy& policy, int* block_k);

// Pointer alignment and strides the kernels need (16-byte rows for cp.async and the O stores).
Status check_layout(const AttentionProblem& problem, const AttentionOutput& output);

// The forward kernel family that serves a call.
enum class FwdPath {
  kPortable,  // sm80 kernels (mma.sync, cp.async): every policy, every sm_80+ device
  kHopper,    // sm90 kernel (TMA, wgmma; sm_90a code): 128-key blocks, compute capability 9.0 only
};

// Whether TMA tensor maps can describe q, k and v as (d, head, row) boxes: beyond
// check_layout (16-byte aligned pointers and strides), every row and head stride of a
// dimension with more than one element is positive and below 2^40 bytes.
bool tma_describable(const AttentionProblem& problem);
bool tma_describable(const TensorView& t);

// The key-block size of the Hopper kernel (its key tile): policies with other blocks run the
// portable kernel.
int hopper_block_k();

// Whether the Hopper kernel gathers the key rows of paged K/V with this page size (cp.async
// through the block table, any page size) instead of loading one TMA box per page (pages of
// 64 or 128 keys or a multiple of 128: smaller boxes cost the TMA unit more than gathering
// costs).
bool hopper_gathers_pages(int page_size);
// Whether the Hopper kernel's TMA boxes can load pages of this size at all (whole 8-row groups
// that tile the 128-key tile, or pages holding whole tiles): boxes of 8 to 32 rows work but
// lose to gathering (dev/tiles.cu `paged` times both).
bool hopper_can_box_pages(int page_size);

// The environment variable that overrides the path choice (docs/cuda.md, "Path selection"):
// unset, empty or "auto": choose_fwd_path decides; "portable": every call runs the portable
// kernels, also on compute capability 9.0 (to compare the paths, or to work around the Hopper
// kernels); "hopper": the Hopper kernels, and a call they cannot serve is an error. Anything
// else is an error naming the variable and the values it takes.
constexpr const char* kPathEnv = "SPARSEPREFILL_CUDA_PATH";
Status cuda_path_mode(const char* env_value, ExecutionOverrides::CudaPath* mode);

// The path of a call that check_support accepted, on a device of compute capability
// (cc_major, cc_minor): Hopper on 9.0 when an sm90 instance of (dtype, head_dim, contiguous or
// paged K/V) is compiled, the tensors are TMA-describable and the policy is dense or works on
// hopper_block_k() key blocks (block_sparse, exact_gate, softmax_skip, estimate_select, and
// permute_stop over contiguous K/V with its attention instance compiled); portable otherwise
// (block_k 64, paged permute_stop, every other device).
FwdPath choose_fwd_path(const ProblemShape& shape, const Policy& policy, bool tma_ok, int cc_major, int cc_minor);

// GQA packing on the Hopper kernel (docs/cuda.md, "GQA packing"): a tile of 128 rows holds
// 128 / G query positions of all G query heads of a KV group (rows ordered position-major), so
// each K/V tile is loaded once for the group and a short or ragged s_q fills its tiles. Results
// do not depend on it. The environment variable kPackGqaEnv chooses: unset, empty or "auto"
// (pack where it cuts the tile count by 10% or more: short chunks, decode-like steps, ragged
// varlen batches), "always" (wherever packing applies) or "never". Anything else is an error
// naming the variable and the values it takes.
using PackGqa = ExecutionOverrides::Choice;
constexpr const char* kPackGqaEnv = "SPARSEPREFILL_PACK_GQA";
Status pack_gqa_mode(const char* env_value, PackGqa* mode);

// Query heads per Hopper forward tile for a call (FwdParams::q_pack): the group G = h_q / h_kv
// when packing applies and `mode` asks for it, else 1. It applies to G > 1 dividing 128 and to
// the policies whose visits are shared by a KV group's heads: dense, and block masks with one
// row per KV head (mask_per_kv_head: estimate_select's pack_gqa, or a per-KV-head BlockMask);
// never to the gates, whose decisions are per query head. kAuto packs when
// Σ_b ceil(s_q,b · G / 128) · h_kv tiles are fewer than 0.9 · Σ_b ceil(s_q,b / 128) · h_q.
int choose_q_pack(const ProblemShape& shape, PolicyMode mode, bool mask_per_kv_head, PackGqa pack);

// The forward kernels' grid order (FwdParams::kv_major). Both start the longest query tiles
// (the last, under causal) first. Query heads fastest: the CTAs running at once are every head
// of a few query blocks, so they stream every KV head's K/V. KV head outermost: they are the
// heads of one KV group over a run of consecutive query blocks (about one wave), which load
// the same K/V tiles, so each tile is reused from L2 by all of them. True when the call's K and
// V (Σ_b seq_k,b · h_kv · d · 2 elements) exceed `l2_bytes`, the device's L2: there the other
// order makes every head group re-read its tiles from DRAM (docs/decisions/ holds the A/B:
// record 2026-11-30-h200-kv-major-grid-ab.log).
bool kv_major_grid(const ProblemShape& shape, std::int64_t l2_bytes);

// exact_gate's execution (docs/cuda.md, "exact_gate in two passes"): one pass, the forward
// kernel's in-loop gate (every gated block's S, a CTA-wide vote, then the softmax and P·V of
// the kept ones), or two: the path's decision kernel (kernel/sm90/gate_kernel.cuh,
// kernel/sm80/gate_kernel.cuh) computes every gated block's S and writes the kept blocks as a
// block mask, then the forward kernel runs that mask. The decisions, the blocks visited and
// their order are the same either way, and on the Hopper path the output bits too. The environment variable kGatePassesEnv chooses: unset, empty or "auto"
// (two passes wherever they apply), "1" or "2"; anything else is an error naming the variable
// and the values it takes.
enum class GatePasses { kAuto, kOne, kTwo };
constexpr const char* kGatePassesEnv = "SPARSEPREFILL_EXACT_GATE_PASSES";
Status gate_passes_mode(const char* env_value, GatePasses* mode);

// Whether an exact_gate call runs two passes: where they apply (contiguous 16-bit K/V, with the
// decision instance of the call's path and (dtype, head_dim) compiled: `instance`; paged K/V the
// launch stages into rows counts as contiguous) unless `mode` is kOne (two passes were faster
// everywhere measured: record 2026-11-30-h200-exact-gate-two-passes-ab.log).
bool choose_gate_passes(const ProblemShape& shape, bool instance, GatePasses mode);

// Query heads of one KV group the decision kernel scores against each K tile it loads: the
// largest divisor of the group that is at most 4 (its shared memory holds 4 Q tiles of d = 128
// beside two K stages).
int gate_heads_per_cta(int group);

// Entries of the decision kernels' block-mask lists (GateParams; policy.cuh, "exact_gate in two
// passes"), rows (b, h, qb) of [batch, h_q, num_q_blocks]: the partial lists hold
// BlockGeometry::ungated_room() entries per row, the full lists every row's gated blocks
// (gated_end) one after the other. About half of the capacity layout's num_k_blocks per row
// under causal: 64 MB against 128 MB of full list for the Llama shape at 128K, 4.3 GB against
// 8.6 at 1M.
struct GateListEntries {
  std::int64_t partial = 0;
  std::int64_t full = 0;
};
GateListEntries gate_list_entries(const ProblemShape& shape, int block_k, int num_q_blocks);

// The full lists' rows are sequence-major: row (b, h, qb)'s list starts at
// h_q · s[b] + h · (s[b + 1] − s[b]) + the gated blocks of sequence b's query blocks before qb,
// where s = this, [batch + 1]: s[b] the gated blocks per query head of the sequences before b
// (GateParams::seq_gated, uploaded with the call, so that a decision CTA sums its own
// sequence's blocks only, not every earlier sequence's).
std::vector<std::int64_t> gate_seq_gated(const ProblemShape& shape, int block_k);

// The instance family of estimate_select's selector (a launch of its own, before the attention
// kernel): Hopper (wgmma; no tensor maps, so any layout check_layout accepts) on compute
// capability 9.0 when an sm90 selector of (dtype, head_dim) is compiled and `portable` (the
// path override is set) is false; portable otherwise.
FwdPath choose_select_path(const ProblemShape& shape, int cc_major, int cc_minor, bool portable);

// The key-block size dense attention runs with (a tuning value, no effect on results).
int dense_block_k(int head_dim);

// Per-sequence geometry and element offsets of q, k, v, o and lse.
std::vector<SeqInfo> make_seq_infos(const AttentionProblem& problem, const ProblemShape& shape,
                                    const AttentionOutput& output);

// FwdParams with every tensor, stride and size of the problem filled in (paged: page size, page
// strides and the stride of compact_block_table); the policy fields are dense and every
// device-side table pointer (seqs, block table, masks, bitmaps) is null.
FwdParams make_fwd_params(const AttentionProblem& problem, const ProblemShape& shape,
                          const AttentionOutput& output, int block_k);

// Paged K/V: the block table the kernels read, [batch, block_table_stride(shape)] row-major,
// holding each sequence's first ceil(seq_k / page_size) entries of problem.block_table (a
// validated host tensor of any strides); the rest of a row is 0 and never read. The stride is
// the most pages any sequence uses (at least 1), so that a table with spare capacity uploads
// only what is read.
std::int64_t block_table_stride(const ProblemShape& shape);
std::vector<std::int32_t> compact_block_table(const AttentionProblem& problem, const ProblemShape& shape);

// Paged K/V staged into contiguous rows before the call (kernel/stage_kv.cuh; docs/cuda.md,
// "Paged K/V and chunked prefill", Staging): the forward call then reads [Σ seq_k, h_kv, d]
// varlen K/V, so it runs the contiguous kernels, bit for bit their results.
struct KvStaging {
  bool stage = false;
  std::vector<std::int64_t> k_start;  // [batch] first staged row of each sequence
  std::int64_t rows = 0;              // Σ seq_k
  std::size_t bytes = 0;              // staged K and V together
};
// Stages when the copy (read and write of every used K/V row) is estimated to cost less than
// the lightest block-table reading measured inside the kernels (kGatheredCost of the call's
// attention time), and the staged rows need at most a quarter of `free_bytes` (the device's
// free memory: a full device declines, and the kernels read the pages directly). The attention
// time counts the visible (query, key) pairs at the dense rate, times the policy's density:
// a block mask's own, an assumed 5% for estimate_select and permute_stop (the densities their
// papers run at), 1 for dense and the gates (which compute every Q·Kᵀ tile). Not paged, or an
// empty call: no staging.
KvStaging plan_kv_staging(const ProblemShape& shape, const Policy& policy, std::size_t free_bytes);
// The shape of the staged call: varlen K/V with rows from staging.k_start, no pages.
ProblemShape staged_shape(const ProblemShape& shape, const KvStaging& staging);

// A BlockMask in the kernels' compact layout: counts as in the mask, each row's indices
// packed after the previous row's (starts per row).
struct CompactMask {
  std::vector<std::int32_t> full_count;     // [rows]
  std::vector<std::int32_t> partial_count;  // [rows]
  std::vector<std::int64_t> full_start;     // [rows]
  std::vector<std::int64_t> partial_start;  // [rows]
  std::vector<std::int32_t> full_index;     // [sum of full counts]
  std::vector<std::int32_t> partial_index;  // [sum of partial counts]
};
CompactMask compact_mask(const BlockMask& mask);

// permute_stop's sizes and sort segments for a call (PermuteParams in kernel/fwd_params.h).
struct PermuteLayout {
  int max_segments = 0;       // segment slots per (b, h)
  int tiles_per_segment = 0;  // ceil(min(segment, max s_q) / kBlockQ)
  int max_s_q = 0;
  int max_prefix = 0;
  std::vector<std::int32_t> rank_offsets;   // [batch·h_q·max_segments + 1]: ranked keys per item
  std::vector<std::int32_t> query_offsets;  // [batch·h_q·(max_segments + 2) + 1]: sort segments of the slots
};
// kUnsupported when the call has more ranked prefix keys or order slots than a CUB sort takes
// (2^31 - 1), naming both.
Status permute_layout(const ProblemShape& shape, const PermuteStopParams& params, PermuteLayout* out);

// Decisions::tiles (sorted by batch, head, segment, tile) from the kernel's chunk counts
// visited [batch·h_q·max_segments, tiles_per_segment].
std::vector<PermuteTile> permute_tiles(const ProblemShape& shape, const PermuteStopParams& params,
                                       const PermuteLayout& layout, const std::vector<std::int32_t>& visited);

// Number of 32-bit words of one bitmap row over num_k_blocks blocks.
int bitmap_words(int num_k_blocks);

// estimate_select under chunked prefill: the selector's per-sequence table (prompt length, cached
// blocks), empty for a one-shot call (no prompt_len and no cache: SelectParams::select_seqs
// stays null, nothing is uploaded), and a cache of block means as the means kernel addresses it
// (data null for an undefined tensor).
std::vector<SelectSeq> make_select_seqs(const EstimateSelectParams& params, const detail::EstimateChunks& chunks);
MeanCache mean_cache(const TensorView& cache);

// The BlockMask whose rows are the set bits of `bits` [batch, heads, num_q_blocks, words]
// (block sizes and geometry from `shape`); every set bit must be a visible block.
Status mask_from_bits(const ProblemShape& shape, int block_q, int block_k, bool per_kv_head,
                      const std::vector<std::uint32_t>& bits, BlockMask* out);

// The BlockMask of capacity-layout device arrays copied back (the selector's output): counts
// [batch, heads, num_q_blocks], indices [.., num_k_blocks]; the arrays are moved into it.
Status mask_from_arrays(const ProblemShape& shape, int block, bool per_kv_head, std::vector<std::int32_t>&& full_count,
                        std::vector<std::int32_t>&& full_index, std::vector<std::int32_t>&& partial_count,
                        std::vector<std::int32_t>&& partial_index, BlockMask* out);

// ---- Calibration statistics (compute_block_statistics / compute_select_statistics on CUDA).

// Whether the calibration kernel serves (shape, block_q, block_k): bf16/fp16, a compiled
// (dtype, head_dim), block sizes 64 or 128, no paged K/V. The message names what is missing.
Status check_calib_support(const ProblemShape& shape, int block_q, int block_k);
// Whether the selector's statistics serve (shape, base): as estimate_select's support on CUDA
// (block 128, at most kMaxSelectBlocks key blocks, a compiled selector).
Status check_select_statistics_support(const ProblemShape& shape, const EstimateSelectParams& base);
// Pointer alignment and strides of q and k (as check_layout).
Status check_qk_layout(const AttentionProblem& problem);

// CalibParams with the tensors, strides and sizes of the problem; outputs and seqs null.
CalibParams make_calib_params(const AttentionProblem& problem, const ProblemShape& shape, int block_q, int block_k);
// SelectParams for statistics only: the selector's inputs (v = k: the means of v are unused),
// base's block and pack_gqa, no mask outputs; means, ratios and seqs null.
SelectParams make_select_statistics_params(const AttentionProblem& problem, const ProblemShape& shape,
                                           const EstimateSelectParams& base);

// The kernels' fp32 arrays [batch, heads, num_q_blocks, num_k_blocks] (capacity layout, max
// over the batch) as one record per sequence [heads, q_blocks, k_blocks] of its own geometry.
// g gets + ln s_k (the kernel writes max(tile_rowmax - m_run)). Either array may be empty.
std::vector<BlockStatistics> block_statistics_from_device(const ProblemShape& shape, int block_q, int block_k,
                                                          int num_q_blocks, int num_k_blocks,
                                                          const std::vector<float>& block_max,
                                                          const std::vector<float>& skip_g);
std::vector<SelectStatistics> select_statistics_from_device(const ProblemShape& shape, const EstimateSelectParams& base,
                                                            int num_q_blocks, int num_k_blocks,
                                                            const std::vector<float>& ratio);

}  // namespace sparseprefill::cuda
