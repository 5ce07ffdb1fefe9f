// SPDX-License-Identifier: Apache-2.0
// The attention problem of docs/semantics.md §1: tensors, layouts (batched, varlen, paged),
// causal alignment, GQA, scale, local windows, learned sinks, softcap and a V head dim of its
// own; and the validation every backend runs first. Host-only.
#pragma once

#include <cstdint>
#include <vector>

#include "sparseprefill/types.h"

namespace sparseprefill {

// One forward attention call. Layouts follow FlashAttention:
//   batched: q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v]
//   varlen:  q [total_q, h_q, d] with cu_seqlens_q [b+1]; k [total_k, h_kv, d] and
//            v [total_k, h_kv, d_v] with cu_seqlens_k [b+1] (or paged)
//   paged:   k [num_pages, page_size, h_kv, d], v [num_pages, page_size, h_kv, d_v] with
//            block_table [b, max_pages] and seqused_k [b]; queries batched or varlen. Page size
//            is independent of every sparsity block size.
// v has k's shape but for its last dimension d_v (MLA-style prefill: d = 192, d_v = 128); O
// has q's shape with d_v as its last dimension. The scale defaults to 1/sqrt(d).
// Causal is bottom-right aligned: query i of a sequence with s_q queries and s_k keys sits at
// position a = i + (s_k - s_q) and sees keys j <= a. GQA is contiguous: query head h reads kv
// head h / (h_q / h_kv). The last dimension of q, k and v must be contiguous; other strides are
// free.
//
// Local attention (FlashAttention's window_size = (window_left, window_right), -1 unbounded on
// that side): query i at position a sees key j iff a - window_left <= j <= a + window_right,
// and j <= a as well when causal (the two masks intersect; FlashAttention's causal is the
// window (-1, 0)). Chunked attention (FlashAttention's attention_chunk C > 0, Llama 4's local
// layers): query i at position a sees only keys of its own chunk, floor(a / C) · C <= j <
// floor(a / C) · C + C, intersected with causal and the window. Learned sinks (gpt-oss): one
// logit per query head added to every row's softmax denominator, in O and LSE. Softcap
// (Gemma 2): every score s becomes
// softcap · tanh(s / softcap) before the softmax and before every policy's rule reads it.
// docs/semantics.md §1 defines each, with their NaN and infinity behaviour.
//
// FP8 inputs (q, k and v all DType::kFP8E4M3, FlashAttention-3's call): attention runs on the
// dequantized values q · q_descale[b, h / group], k · k_descale[b, kv head] and
// v · v_descale[b, kv head] (fp32 descales [b, h_kv], any strides, on q's device; an undefined
// descale is 1); O is bf16. Descales are only accepted with FP8 inputs.
struct AttentionProblem {
  TensorView q;
  TensorView k;
  TensorView v;
  TensorView cu_seqlens_q;  // int32 [b+1], optional (varlen queries)
  TensorView cu_seqlens_k;  // int32 [b+1], optional (varlen keys; not with block_table)
  TensorView seqused_k;     // int32 [b], optional; required with block_table
  TensorView block_table;   // int32 [b, max_pages], optional (paged K/V)
  TensorView q_descale;     // fp32 [b, h_kv], optional (FP8 inputs only)
  TensorView k_descale;     // fp32 [b, h_kv], optional (FP8 inputs only)
  TensorView v_descale;     // fp32 [b, h_kv], optional (FP8 inputs only)
  TensorView sinks;         // fp32 [h_q], optional, on q's device: learned sink logits
  bool causal = true;
  double scale = 0.0;       // softmax scale; 0 means 1/sqrt(d)
  int window_left = -1;     // keys j >= a - window_left; -1: no bound
  int window_right = -1;    // keys j <= a + window_right; -1: no bound
  int attention_chunk = 0;  // 0: none; else > 0: keys of a's chunk of that many positions
  double softcap = 0.0;     // 0: none; else > 0 and finite
};

// Where O and LSE go. O has q's layout with last dimension d_v, q's dtype (bf16 for FP8 inputs)
// and device. LSE is fp32 (natural log), [b, h_q, s_q] for batched queries or [h_q, total_q]
// for varlen; it may be left undefined. A row that sees no key gets O = 0 and LSE = -inf (with
// sinks: the sink's logit).
struct AttentionOutput {
  TensorView o;
  TensorView lse;
};

enum class KvLayout : std::uint8_t { kBatched, kVarlen, kPaged };

// The resolved, validated shape of a problem: what every backend iterates over.
struct ProblemShape {
  int batch = 0;
  int h_q = 0;
  int h_kv = 0;
  int d = 0;                   // head dim of q and k
  int d_v = 0;                 // head dim of v and O
  bool causal = true;
  double scale = 0.0;          // resolved (never 0)
  int window_left = -1;        // as in AttentionProblem (validated: >= -1)
  int window_right = -1;
  int attention_chunk = 0;     // as in AttentionProblem (validated: >= 0)
  double softcap = 0.0;        // 0 or finite > 0
  bool sinks = false;          // AttentionProblem::sinks is given
  // Whether the window or the chunks hide keys that causal (or full) attention shows: a left
  // bound, a right bound without causal (causal already ends every row at its own position), or
  // chunks.
  bool local() const { return window_left >= 0 || (!causal && window_right >= 0) || attention_chunk > 0; }
  bool varlen_q = false;       // q is [total_q, h_q, d]
  KvLayout kv_layout = KvLayout::kBatched;
  int page_size = 0;           // paged only
  DType dtype = DType::kBF16;  // of q, k, v (all equal)
  DType out_dtype() const { return dtype == DType::kFP8E4M3 ? DType::kBF16 : dtype; }  // of O
  Device device{};
  std::vector<std::int64_t> seq_q;     // [b] queries per sequence
  std::vector<std::int64_t> seq_k;     // [b] keys per sequence (after seqused_k)
  std::vector<std::int64_t> q_start;   // [b] first row of sequence b in q's seq (or total) axis
  std::vector<std::int64_t> k_start;   // [b] first row in k/v (batched/varlen; 0 for paged)

  int group() const { return h_q / h_kv; }
  std::int64_t total_q() const;  // sum of seq_q
  std::int64_t max_seq_q() const;
  std::int64_t max_seq_k() const;
};

// Validates every argument of `problem` (and `output` when given) and resolves its shape.
// Errors name the argument and what was expected. Index tensors (cu_seqlens_*, seqused_k,
// block_table) must be readable from the host: host tensors always; device tensors only by
// backends that say so. Pass output == nullptr to validate the inputs alone.
Status validate_problem(const AttentionProblem& problem, const AttentionOutput* output,
                        ProblemShape* shape);

}  // namespace sparseprefill
