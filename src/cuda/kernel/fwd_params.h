// SPDX-License-Identifier: Apache-2.0
// Parameters of the forward attention kernels, shared by the portable (sm80) path, the block
// means / selector kernels and the host dispatcher. Plain data: no CUDA headers, so host
// translation units (g++) fill it and kernel translation units read it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/rules/block_sparse.h"

namespace sparseprefill::cuda {

// Query rows per CTA: the block_q every policy must use on CUDA.
constexpr int kBlockQ = 128;
// The Hopper forward kernel's tensor maps travel as a kernel parameter for calls with at most
// this many sequence map sets (batch, plus one for paged K/V's cache maps); larger calls upload
// them (sm90/fwd_kernel.cuh, ParamMaps).
constexpr int kFwd90ParamSeqMaps = 4;
// Pooled blocks per mean-correction tile, and the tiles one query block can visit.
constexpr int kMeanChunk = 64;
constexpr int kMaxMeanChunks = 256;
// Pooled blocks the selector keeps energies for in shared memory (2M keys at block 128).
constexpr int kMaxSelectBlocks = 16384;

// What decides which key blocks a query block visits (DESIGN.md §3).
enum class PolicyMode : std::int32_t {
  kDense = 0,        // every visible block
  kBlockMask = 1,    // the blocks of a device BlockMask (block_sparse, estimate_select)
  kExactGate = 2,    // BSFA: full blocks gated by the exact tile max against T[h][p]
  kSoftmaxSkip = 3,  // BLASST: every block after the first gated against the running max
};

// The in-kernel gates: the modes the portable forward kernel's gated instances run (and only
// they: variants.py, axis gates).
constexpr bool gated_mode(PolicyMode mode) { return mode == PolicyMode::kExactGate || mode == PolicyMode::kSoftmaxSkip; }

// Per-sequence geometry and element offsets, [batch] on the device. Offsets are in elements of
// the tensor they index and point at the sequence's first row (head 0, dim 0).
struct SeqInfo {
  std::int64_t s_q;    // queries of the sequence
  std::int64_t s_k;    // keys of the sequence
  std::int64_t q_off;  // q (and o: same layout, own offset below)
  std::int64_t o_off;
  std::int64_t k_off;  // 0 for paged K/V (rows are found through the block table)
  std::int64_t v_off;
  std::int64_t lse_off;  // lse element of (head 0, row 0)
};

// Paged K/V (DESIGN.md §2): k/v [num_pages, page_size, h_kv, d]; key t of sequence b is row
// t % page_size of page block_table[b · table_stride + t / page_size]. block_table == nullptr:
// contiguous rows from SeqInfo::k_off / v_off. Every K/V load of the portable kernels goes
// through one addressor (sm80::KvRows), whatever the layout; the Hopper kernel's paged
// instances load TMA boxes of one page each (sm90::paged_box_rows) or, for the page sizes of
// hopper_gathers_pages (plan.h), gather the rows with cp.async (sm90::gather_tile).
struct PagedKv {
  const std::int32_t* block_table;  // [batch, table_stride] on the device, or nullptr
  std::int64_t table_stride;        // entries per sequence
  int page_size;                    // keys per page (any size >= 1)
  std::int64_t k_page_stride;       // elements between pages of k
  std::int64_t v_page_stride;       // and of v
  bool gather_rows;                 // hopper_gathers_pages(page_size)
};

// Gathered paged rows (sm90::gather_tile) pass a row's offset from the cache's base between
// threads as 32 bits in 16-byte units: the rows of `pages` pages (page_stride, row_stride in
// elements of 2 bytes) must lie at non-negative multiples of 8 elements below 2^35 elements
// (64 GiB) from the base. Otherwise the Hopper instance declines and the portable kernel runs.
constexpr bool gather_offsets_fit(std::int64_t pages, int page_size, std::int64_t page_stride, std::int64_t row_stride) {
  constexpr std::int64_t kLimit = std::int64_t{1} << 35;
  if (pages < 1 || page_size < 1 || page_stride < 0 || row_stride < 0 || page_stride % 8 != 0 || row_stride % 8 != 0) {
    return false;
  }
  if (row_stride > 0 && page_size - 1 >= kLimit / row_stride) return false;
  const std::int64_t last_row = (page_size - 1) * row_stride;
  if (page_stride > 0 && pages - 1 > (kLimit - 1 - last_row) / page_stride) return false;
  return (pages - 1) * page_stride + last_row < kLimit;
}

// One list of a block mask read in place (DeviceBlockMask, block_mask.h): FlexAttention's
// count [B, H, Q] and index [B, H, Q, K] tensors, strides in elements (0 for a broadcast
// dimension), the index's last dimension contiguous.
struct MaskListView {
  const std::int32_t* count;  // nullptr: the list is empty
  const std::int32_t* index;
  std::int64_t count_stride[3];
  std::int64_t index_stride[3];
  int capacity;  // K
};

// The check of a device block mask ahead of the forward call (kernel/mask_check.cuh): for each
// row (b, h, qb) of [batch, heads, num_q_blocks], the prefix of each list that the entry rule
// (core/rules/block_sparse.h) accepts, and where it starts in its index tensor, which the
// forward kernel then reads as a compact mask (FwdParams' start arrays). The first offence goes
// to `fault`.
struct MaskCheckParams {
  MaskListView list[2];            // 0: partial (Flex kv_*), 1: full (full_kv_*)
  const std::int32_t* csr_indptr;  // CSR form instead ([rows + 1]; list[1].index the indices)
  std::int64_t csr_nnz;
  const SeqInfo* seqs;             // [batch], device
  int batch;
  int heads;        // h_q, or h_kv for a mask per KV head
  int num_q_blocks;
  int block_q;
  int block_k;
  int bitmap_words;  // 32-bit words over the longest sequence's key blocks (shared memory per row)
  bool causal;
  int window_left = -1;  // the call's window and chunks (FwdParams): entries outside them are out of range
  int window_right = -1;
  int attention_chunk = 0;
  std::int32_t* count_out[2];  // [rows]
  std::int64_t* start_out[2];  // [rows]
  std::uint32_t* kept_bits;    // [rows, bitmap_words]: the accepted blocks, for decisions; or nullptr
  rules::MaskFaultRecord* fault;
};

// Paged K/V staged into contiguous rows before the call (plan_kv_staging, plan.h): the
// rows below s_k of every sequence, read through the block table and written to
// dst[i] [Σ s_k, h_kv, d] row-major at the forward call's own SeqInfo::k_off / v_off, which
// then reads them as varlen K/V. Element strides of the caches as in PagedKv.
struct StageKvParams {
  const void* src[2];                 // k, v caches [num_pages, page_size, h_kv, d or d_v]
  void* dst[2];                       // staged k, v
  std::int64_t page_stride[2];        // elements between pages
  std::int64_t row_stride[2];         // between rows of a page
  std::int64_t head_stride[2];        // between heads of a row
  const std::int32_t* block_table;    // compact_block_table, device
  std::int64_t table_stride;
  int page_size;
  const SeqInfo* seqs;                // [batch], device: s_k and the staged k_off / v_off
  int batch;
  int h_kv;
  int elem_bytes;                     // of the dtype
  int row_chunks[2];                  // 16-byte chunks per (row, head): d (K) or d_v (V) · elem_bytes / 16
  std::int64_t max_s_k;
};

struct FwdParams {
  // Tensors. q/o [.., s, h_q, d], k/v [.., s, h_kv, d] in the input dtype (bf16, fp16, or fp8
  // e4m3 with a bf16 o); row and head strides in elements; the last dimension is contiguous
  // and rows are 16-byte aligned (can_run checks).
  const void* q;
  const void* k;
  const void* v;
  void* o;
  float* lse;  // fp32 natural-log LSE; nullptr when not requested
  std::int64_t q_row_stride, q_head_stride;
  std::int64_t k_row_stride, k_head_stride;
  std::int64_t v_row_stride, v_head_stride;
  std::int64_t o_row_stride, o_head_stride;
  std::int64_t lse_head_stride, lse_row_stride;  // elements
  const SeqInfo* seqs;  // [batch], device
  PagedKv paged;        // block_table == nullptr: contiguous K/V

  int batch;
  int h_q;
  int h_kv;
  int group;          // h_q / h_kv (contiguous GQA: q head h reads kv head h / group)
  int num_q_blocks;   // max over the batch of ceil(s_q / kBlockM): the grid's extent
  int grid;           // CTAs of the forward launch, from the execution plan (portable_grid, hopper_grid)
  int q_pack;         // Hopper kernel: query heads per tile, 1 or the group (choose_q_pack)
  bool kv_major;      // grid order: KV head outermost instead of query heads fastest (kv_major_grid)
  bool causal;        // bottom-right aligned
  float scale;        // softmax scale (natural-log domain)
  float scale_log2;   // scale · log2(e): kernels work in the exp2 domain

  PolicyMode mode;
  int block_k;        // keys per sparsity block (64 or 128: one or two 64-key sub-tiles)

  // kBlockMask: BlockMask rows on the device, row (b, h_mask, qb) with
  // h_mask = per_kv_head ? h / group : h. Counts [batch, mask_heads, mask_q_blocks]; a row's
  // ascending indices start at partial_start[row] / full_start[row] (compact, uploaded from a
  // host mask), or at row · mask_k_blocks when the start arrays are null (capacity layout,
  // written by the GPU selector).
  const std::int32_t* full_count;
  const std::int32_t* full_index;
  const std::int32_t* partial_count;
  const std::int32_t* partial_index;
  const std::int64_t* full_start;
  const std::int64_t* partial_start;
  int mask_heads;
  bool mask_per_kv_head;
  int mask_q_blocks;
  int mask_k_blocks;

  // kExactGate: fp32 thresholds T[h_q][positions] with element strides (natural-log domain).
  const float* thresholds;
  std::int64_t thr_head_stride, thr_pos_stride;
  int thr_positions;

  // kSoftmaxSkip: λ = skip_a / s_k per sequence; skipping is off where s_k < skip_a.
  float skip_a;

  // Mean correction (kBlockMask only): block means k̄/v̄ [batch, h_kv, mean_blocks, d] in the
  // input dtype, and per mask row a bitmap of the blocks to add back as pseudo-tokens
  // [batch, mask_heads, mask_q_blocks, corrected_words]. k_mean == nullptr: no correction.
  const void* k_mean;
  const void* v_mean;
  const std::uint32_t* corrected_bits;
  int mean_blocks;      // capacity of the block axis of k_mean/v_mean
  int mean_block;       // keys per pooled block
  int corrected_words;  // 32-bit words per bitmap row

  // Decisions of the gates: per (b, h_q, qb) a bitmap of the computed key blocks
  // [batch, h_q, num_q_blocks, kept_words], zeroed by the host; nullptr = not recorded.
  std::uint32_t* kept_bits;
  int kept_words;

  // FP8 (e4m3) inputs, the Hopper kernel's fp8 instance only (docs/semantics.md §1): fp32
  // descales of q, k and v, [b, h_kv] with element strides (nullptr: 1), and V transposed for
  // the P·V operand: v_t [batch, h_kv, d, vt_stride] bytes, written by the launch
  // (sm90::transpose_v_kernel: keys permuted inside each 16-key group, zeros past s_k).
  const float* descale[3];             // q, k, v
  std::int64_t descale_stride[3][2];   // (batch, kv head)
  std::uint8_t* v_t;
  std::int64_t vt_stride;  // keys per (b, kv head, d) row: max s_k rounded up to 128

  // The model-family features (docs/semantics.md §1), run by the forward kernels' kFeatures
  // kernel (fwd_kernel<Cfg, true>) for dense and block masks without mean correction, 16-bit
  // inputs (check_support refuses them elsewhere; the launches check). The defaults are none,
  // so that a value-initialised FwdParams means plain causal or full attention. Last, so that
  // the other fields keep their parameter offsets (ptxas scheduled the feature-free kernels
  // differently when they moved).
  // FlashAttention's local window (geom::SeqGeometry; -1: no bound on that side) and chunks
  // (attention_chunk; 0: none), set only where they hide keys (ProblemShape::local()).
  int window_left = -1;
  int window_right = -1;
  int attention_chunk = 0;
  // Softcap c > 0: each score becomes rules::capped_score(cap_scale · q·k, c), and then scale is
  // 1 and scale_log2 log2(e) (the capped score is the logit); cap_scale is the call's scale.
  float softcap = 0.f;
  float cap_scale = 0.f;
  // Learned sinks: fp32 logits [h_q] (element stride sinks_stride), one more term of every
  // row's softmax denominator and maximum (finalize_row_sink); nullptr: none.
  const float* sinks = nullptr;
  std::int64_t sinks_stride = 0;

  // FP8 mean correction (the Hopper fp8 instances' mean tiles): k_mean/v_mean (bf16) requantized
  // to e4m3 in K's and V's descaled domain, e4m3(k̄ / k_descale) as k_mean8 [batch, h_kv,
  // mean_blocks, d] and e4m3(v̄ / v_descale) transposed as v_mean_t [batch, h_kv, d_v,
  // mean_stride] (blocks permuted as v_t's keys, zeros past mean_blocks), written by the launch
  // (sm90::quantize_means_kernel); nullptr otherwise. After the features, so that the fields
  // before keep their parameter offsets.
  std::uint8_t* k_mean8 = nullptr;
  std::uint8_t* v_mean_t = nullptr;
  std::int64_t mean_stride = 0;  // mean_blocks rounded up to 128
};

// Whether a call needs the kFeatures kernel (FwdParams' model-family features).
inline bool has_features(const FwdParams& p) {
  return p.window_left >= 0 || p.window_right >= 0 || p.attention_chunk > 0 || p.softcap > 0.f || p.sinks != nullptr;
}

// exact_gate's decisions ahead of the attention (plan.h, choose_gate_passes): the forward call's
// parameters (mode kExactGate, its q, k, geometry, thresholds and kept bitmap) and the
// BlockMask rows the decision kernel writes for the forward kernel to run as a block mask.
struct GateParams {
  FwdParams fwd;
  int heads_per_cta;  // query heads of one KV group scored against each loaded K tile
  int words;          // 32-bit words of a bitmap row over fwd.mask_k_blocks key blocks
  // Rows (b, h_q, qb) of [batch, h_q, num_q_blocks]: starts, counts, and ascending indices
  // from each row's start (policy.cuh, "exact_gate in two passes": room for the row's group A,
  // resp. for all its gated blocks). Partial: the blocks no gate decides (group A); full: the
  // gated blocks kept.
  std::int64_t* full_start;
  std::int64_t* partial_start;
  std::int32_t* full_count;
  std::int32_t* full_index;
  std::int32_t* partial_count;
  std::int32_t* partial_index;
  // [batch + 1]: the gated blocks per query head of the sequences before b (plan.h,
  // gate_seq_gated), for the rows' full-list starts.
  const std::int64_t* seq_gated;
};

// Whether the portable forward kernel's plain instances run a call (variants.py, axis loops):
// ungated, contiguous K/V (paged calls the launch did not stage into rows) and no mean
// correction. The other ungated instances run the rest.
constexpr bool plain_call(const FwdParams& p) {
  return !gated_mode(p.mode) && p.paged.block_table == nullptr &&
         !(p.mode == PolicyMode::kBlockMask && p.k_mean != nullptr);
}

// estimate_select under chunked prefill (EstimateSelectParams::prompt_len and the cache of
// block means; core/estimate_chunks.h reads them on the host), [batch] on the device.
struct SelectSeq {
  std::int64_t prompt_len;  // the tail counts the prompt's last tiles; 0: the call's
  std::int64_t cached;      // blocks j < cached: means read from the cache, not computed
};

// The caller's cache of block means [batch, h_kv, blocks, d] in the input dtype, element
// strides (the last dimension contiguous).
struct MeanCache {
  void* data;  // nullptr: no cache
  std::int64_t batch_stride, head_stride, block_stride;
};

// Parameters of the estimate_select selector (block means + per-tile energies), same tensors.
struct SelectParams {
  const void* q;
  const void* k;
  const void* v;
  std::int64_t q_row_stride, q_head_stride;
  std::int64_t k_row_stride, k_head_stride;
  std::int64_t v_row_stride, v_head_stride;
  const SeqInfo* seqs;  // [batch], device
  PagedKv paged;        // as FwdParams::paged
  int batch;
  int h_q;
  int h_kv;
  int group;
  float scale;        // natural-log domain
  int block;          // B: query tile, key block and pooling size
  int num_q_blocks;   // max over the batch of ceil(s_q / B)
  int num_k_blocks;   // max over the batch of ceil(s_k / B): capacity of every block axis
  float alpha;
  int sink;
  int window;
  int tail;
  bool pack_gqa;      // one selection per KV head (rows of the group's heads scored together)
  bool mean_correction;
  // Chunked prefill; select_seqs == nullptr: every sequence is its own prompt and nothing is
  // cached (the one-shot call). The means kernel reads blocks j < cached from the caches and
  // writes blocks cached <= j < s_k / block (complete after this call) into them.
  const SelectSeq* select_seqs;  // [batch], device, or nullptr
  MeanCache cache_k;
  MeanCache cache_v;

  // Outputs. Means [batch, h_kv, num_k_blocks, d] in the input dtype, bf16 for e4m3 (written by the means
  // kernel, read by the selector and the attention kernel).
  void* k_mean;
  void* v_mean;
  // BlockMask rows (b, unit, i), unit = pack_gqa ? kv head : q head: counts
  // [batch, units, num_q_blocks] and ascending indices [.., num_k_blocks].
  std::int32_t* full_count;
  std::int32_t* full_index;
  std::int32_t* partial_count;
  std::int32_t* partial_index;
  std::uint32_t* corrected_bits;  // [batch, units, num_q_blocks, corrected_words] or nullptr
  int corrected_words;
  // Calibration (compute_select_statistics): E_j / max E of every scored block j of each
  // mask row, [batch, units, num_q_blocks, num_k_blocks]; nullptr = not written.
  float* energy_ratio;

  // FP8 (e4m3) q/k/v, the Hopper selector's fp8 instance only: FwdParams::descale of the same
  // call (q's scales the scores, k's and v's the block means, which are bf16 then).
  const float* descale[3];             // q, k, v
  std::int64_t descale_stride[3][2];   // (batch, kv head)
};

// Parameters of the calibration statistics kernel (compute_block_statistics): the q/k of one
// layer, causal, and the per-block statistics it writes.
struct CalibParams {
  const void* q;
  const void* k;
  std::int64_t q_row_stride, q_head_stride;
  std::int64_t k_row_stride, k_head_stride;
  const SeqInfo* seqs;  // [batch], device
  int batch;
  int h_q;
  int group;          // h_q / h_kv
  float scale;        // natural-log domain
  int block_q;        // 64 or 128 query rows per block (one or two 64-row halves per CTA)
  int block_k;        // 64 or 128 keys per block (one or two 64-key sub-tiles)
  int num_q_blocks;   // max over the batch: the grid's extent and the capacity of the q axis
  int num_k_blocks;   // max over the batch: the capacity of the k axis
  // Outputs [batch, h_q, num_q_blocks, num_k_blocks], fp32; nullptr = not requested. Written
  // for every visible block; others are left as the host initialised them.
  // block_max: max of scale·q·k over the block's visible pairs.
  // skip_g: for every block visited after the first (BLASST order), the max over rows of
  //   scale·(tile_rowmax - m_run), +inf for a row seeing its first keys (ln s_k is added on
  //   the host).
  float* block_max;
  float* skip_g;
};

// permute_stop on the GPU (DESIGN.md §3, our definition of S2O). Segment slot `slot` of
// sequence b is its absolute segment first(b) + slot, first(b) = max(s_k - s_q, 0) / S (the
// segment of the first row at a position >= 0); item (b, h, slot) = (b·h_q + h)·max_segments
// + slot. Ranking arrays hold each item's prefix keys t < min(segment·S, s_k) contiguously
// (rank_offsets); the slot arrays are [batch, h_q, max_s_q] (Decisions::query_order's layout),
// cut into max_segments + 2 sort segments per (b, h): the rows at negative positions, each
// segment's rows, the slots past s_q (query_offsets).
struct PermuteParams {
  FwdParams fwd;          // tensors, strides, sequences, heads and scale (policy fields unused)
  int segment;            // S: absolute query positions per segment
  float tau;              // stop after a chunk whose largest row gain Δl / l' is below tau
  int block_k;            // keys per ranked chunk: 64 or 128 (one or two 64-key sub-tiles)
  int max_segments;       // segment slots per (b, h)
  int tiles_per_segment;  // query tiles of kBlockQ rows per segment slot: ceil(min(S, max s_q) / 128)
  int max_s_q;            // slots per (b, h) of the order arrays
  int max_prefix;         // the longest prefix of any item (grid extent of the score kernel)
  int rank_items;         // prefix keys over all items (CUB: int)
  int rank_segments;      // batch · h_q · max_segments
  int query_items;        // batch · h_q · max_s_q
  int query_segments;     // batch · h_q · (max_segments + 2)
  const std::int32_t* rank_offsets;   // [rank_segments + 1]
  const std::int32_t* query_offsets;  // [query_segments + 1]

  // Scratch. Sort buffers come in pairs (CUB double buffers); the launch sets `ranked` and
  // `query_order` to the buffer of each pair that holds the sorted result.
  double* q_mean;                // [rank_segments, d]: q̄ per item, fp64
  std::uint32_t* rank_keys[2];   // [rank_items]: rank_key(q̄·k_t) (kernel/rank_key.h)
  std::int32_t* rank_index[2];   // [rank_items]: t
  std::uint32_t* query_keys[2];  // [query_items]: rank_key(q·u) (0 where the order stays)
  std::int32_t* query_rows[2];   // [query_items]: call-relative rows; -1 past s_q
  void* sort_temp;
  std::size_t sort_temp_bytes;
  const std::int32_t* ranked;       // set by the launch: prefix keys of each item, best first
  const std::int32_t* query_order;  // set by the launch: rows in visit order per (b, h)
  std::int32_t* visited;  // [rank_segments, tiles_per_segment] chunks visited; nullptr = not recorded
};

}  // namespace sparseprefill::cuda
