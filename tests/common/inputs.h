// SPDX-License-Identifier: Apache-2.0
// Test inputs: seeded splitmix64 values that are never zero, logical per-sequence Q/K/V, and
// builders that lay the same sequences out as batched, varlen or paged AttentionProblems (so
// layouts can be compared with each other), plus GQA repetition of K/V.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <vector>

#include "sparseprefill/problem.h"
#include "sparseprefill/types.h"

namespace sparseprefill::test {

// A stream over sparseprefill::splitmix64 (the generator's stream).
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next();
  // Uniform in (-1, 1): an odd multiple of 2^-24, so never 0 (also after rounding to bf16/fp16).
  double uniform();
  // Mean 0, variance 1 (Irwin–Hall: the sum of three uniforms); an odd multiple of 2^-24.
  double normal();
  // Uniform integer in [0, n).
  std::uint64_t below(std::uint64_t n);

 private:
  std::uint64_t state_;
};

enum class Distribution { kUniform, kNormal };

// Element i (row-major) of a contiguous host tensor as double / set to x rounded to its dtype.
double get(const HostTensor& t, std::int64_t i);
void set(HostTensor* t, std::int64_t i, double x);
// Writes `values` into row `row`, head h of a [s, heads, d] tensor (hand-written cases).
void put(HostTensor* t, std::int64_t row, int h, std::initializer_list<double> values);
// A softmax scale of ln 2 makes e^s = 2^(q·k): hand-written cases with exact powers of two.
constexpr double kLn2 = 0.69314718055994530942;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The hand-written cases' bound: their exact results, up to fp64 rounding.
constexpr double kExact = 1e-12;

// Fills t with scale · (uniform or normal) values, rounded to t's dtype; never zero.
void fill_random(HostTensor* t, std::uint64_t seed, double scale = 1.0,
                 Distribution dist = Distribution::kUniform);

// The logical inputs of a call: per sequence q [s_q, h_q, d], k [s_k, h_kv, d] and
// v [s_k, h_kv, d_v]; optionally the sink logits [h_q].
struct SequenceData {
  HostTensor q;
  HostTensor k;
  HostTensor v;
};
struct Inputs {
  DType dtype = DType::kBF16;
  int h_q = 1;
  int h_kv = 1;
  int d = 16;
  int d_v = 16;
  std::vector<SequenceData> seqs;
  std::vector<double> sinks;  // [h_q] (fp32 values); empty: no sinks
  std::int64_t s_q(int b) const { return seqs[static_cast<std::size_t>(b)].q.shape()[0]; }
  std::int64_t s_k(int b) const { return seqs[static_cast<std::size_t>(b)].k.shape()[0]; }
};

struct SeqLen {
  std::int64_t s_q;
  std::int64_t s_k;
};
// Random inputs for the given lengths (q, k and v from independent streams of `seed`); v's
// head dim is d_v (0: d).
Inputs random_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, DType dtype,
                     std::uint64_t seed, double scale = 1.0,
                     Distribution dist = Distribution::kUniform, int d_v = 0);
// Zero-filled inputs of the given shapes, for hand-written values (set()); d_v 0: d.
Inputs empty_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, DType dtype, int d_v = 0);

// The same sequences with K/V repeated for every query head (h_kv = h_q): equal attention.
Inputs repeat_kv(const Inputs& in);

enum class Layout : std::uint8_t {
  kBatched,  // q [b, s_q, h_q, d] (equal s_q); k/v [b, max s_k, h_kv, d], seqused_k if unequal
  kVarlen,   // q [total_q, h_q, d], k/v [total_k, h_kv, d] with cu_seqlens_q/k
  kPaged,    // q varlen; k/v [num_pages, page_size, h_kv, d] through a shuffled block_table
};

struct LayoutOptions {
  Layout layout = Layout::kBatched;
  int page_size = 16;          // kPaged
  std::uint64_t page_seed = 7; // kPaged: the physical page permutation
  bool causal = true;
  double scale = 0.0;          // 0: 1/sqrt(d)
  int window_left = -1;        // AttentionProblem's local window, chunks and softcap
  int window_right = -1;
  int attention_chunk = 0;
  double softcap = 0.0;
};

// Owns every tensor of one call and its output buffers. Storage that no valid element uses
// (K/V capacity past seqused_k, the tail of a sequence's last page, pages no sequence owns and
// the block table entries past a sequence's pages, which point at such a page) is NaN, so a
// backend that reads it shows NaN.
struct TestProblem {
  HostTensor q, k, v;
  HostTensor cu_seqlens_q, cu_seqlens_k, seqused_k, block_table;  // int32, when the layout uses them
  HostTensor q_descale, k_descale, v_descale;  // fp32 [b, h_kv], when set (fp8 inputs)
  HostTensor sinks;  // fp32 [h_q], when the inputs have sinks
  HostTensor o;    // q's shape with d_v last, q's dtype (bf16 for fp8 inputs)
  HostTensor lse;  // fp32 [b, h_q, s_q] or [h_q, total_q]
  bool causal = true;
  double scale = 0.0;
  int window_left = -1;
  int window_right = -1;
  int attention_chunk = 0;
  double softcap = 0.0;

  AttentionProblem problem() const;  // views into the tensors above
  AttentionOutput output() const;
};
TestProblem build_problem(const Inputs& in, const LayoutOptions& options = {});

// The shape of one causal sequence on CUDA device 0, scale 1, for the CUDA planning tests (which
// need no GPU).
ProblemShape cuda_shape_of(std::int64_t s_q, std::int64_t s_k, int h_q = 32, int h_kv = 8, int d = 128,
                           DType dtype = DType::kBF16);
// `s` with its K/V in pages of `page_size` keys.
ProblemShape with_pages(ProblemShape s, int page_size);

}  // namespace sparseprefill::test
