// SPDX-License-Identifier: Apache-2.0
// The attention problem of DESIGN.md §2: tensors, layouts (batched, varlen, paged), causal
// alignment, GQA and scale; and the validation every backend runs first. Host-only.
#pragma once

#include <cstdint>
#include <vector>

#include "sparseprefill/types.h"

namespace sparseprefill {

// One forward attention call. Layouts follow FlashAttention:
//   batched: q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d]
//   varlen:  q [total_q, h_q, d] with cu_seqlens_q [b+1]; k/v [total_k, h_kv, d] with
//            cu_seqlens_k [b+1] (or paged)
//   paged:   k/v [num_pages, page_size, h_kv, d] with block_table [b, max_pages] and
//            seqused_k [b]; queries batched or varlen. Page size is independent of every
//            sparsity block size.
// Causal is bottom-right aligned: query i of a sequence with s_q queries and s_k keys sees keys
// j <= i + (s_k - s_q). GQA is contiguous: query head h reads kv head h / (h_q / h_kv).
// The last dimension of q, k and v must be contiguous; other strides are free.
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
  bool causal = true;
  double scale = 0.0;       // softmax scale; 0 means 1/sqrt(d)
};

// Where O and LSE go. O has q's layout, dtype (bf16 for FP8 inputs) and device. LSE is fp32
// (natural log), [b, h_q, s_q] for batched queries or [h_q, total_q] for varlen; it may be left
// undefined.
// A row that sees no key gets O = 0 and LSE = -inf.
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
  int d = 0;
  bool causal = true;
  double scale = 0.0;          // resolved (never 0)
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
