// SPDX-License-Identifier: Apache-2.0
// Host-side element access shared by the host backends (oracle, CPU backend), calibration and
// the CLI: gathers one sequence's Q/K/V into contiguous arrays whatever the layout (batched,
// varlen, paged; any strides; bf16/fp16/fp32, fp8 with descales), and stores O/LSE back. Host
// tensors only.
#pragma once

#include <cstdint>
#include <vector>

#include "sparseprefill/problem.h"

namespace sparseprefill::detail {

// q of sequence b as [s_q, h_q, d], converted exactly to T (float or double); FP8 inputs
// multiplied by their descale (q_descale[b, h / group]) in double, so exactly for double.
template <class T>
void gather_q(const AttentionProblem& p, const ProblemShape& s, int b, std::vector<T>* out);
// k (value = false) as [s_k, h_kv, d] or v (value = true) as [s_k, h_kv, d_v] of sequence b,
// through the block table when paged; FP8 inputs multiplied by k_descale / v_descale[b, kv head]
// as q is.
template <class T>
void gather_kv(const AttentionProblem& p, const ProblemShape& s, int b, bool value,
               std::vector<T>* out);
// The sink logits [h_q] (exact; p.sinks defined, host).
void gather_sinks(const AttentionProblem& p, const ProblemShape& s, std::vector<double>* out);
// Stores sequence b's O ([s_q, h_q, d_v], rounded to o's dtype, s.out_dtype()) and LSE ([h_q, s_q],
// fp32) into `out` (LSE only when out.lse is defined).
template <class T>
void store_output(const AttentionOutput& out, const ProblemShape& s, int b, const T* o,
                  const T* lse);

// estimate_select's cache of block means [b, h_kv, max_blocks, d] (EstimateSelectParams):
// block j of sequence b, KV head hk, as d floats (exact: the cache holds the input dtype), and
// stored from d floats that are already rounded to the cache's dtype (so stored exactly).
void load_block_mean(const TensorView& cache, int b, int hk, std::int64_t j, int d, float* out);
void store_block_mean(const TensorView& cache, int b, int hk, std::int64_t j, int d, const float* in);

extern template void gather_q<float>(const AttentionProblem&, const ProblemShape&, int,
                                     std::vector<float>*);
extern template void gather_q<double>(const AttentionProblem&, const ProblemShape&, int,
                                      std::vector<double>*);
extern template void gather_kv<float>(const AttentionProblem&, const ProblemShape&, int, bool,
                                      std::vector<float>*);
extern template void gather_kv<double>(const AttentionProblem&, const ProblemShape&, int, bool,
                                       std::vector<double>*);
extern template void store_output<float>(const AttentionOutput&, const ProblemShape&, int,
                                         const float*, const float*);
extern template void store_output<double>(const AttentionOutput&, const ProblemShape&, int,
                                          const double*, const double*);

}  // namespace sparseprefill::detail
