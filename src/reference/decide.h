// SPDX-License-Identifier: Apache-2.0
// The oracle's decision rules, one function per policy (docs/semantics.md is their prose), and
// the intermediate results that the rules and the expansion of decisions into key sets share
// (block means, permute_stop's orders). Each rule decides one sequence and writes into a
// Decisions already sized for the whole call by init_decisions. Host-only.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/sequence.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::ref {

// Sizes `decisions` for the call: an empty `kept` (and `corrected` with mean correction) with
// the policy's block sizes, or permute_stop's query_order [b, h_q, max s_q] filled with -1.
void init_decisions(const ProblemShape& shape, const Policy& policy, Decisions* decisions);

Status decide_exact_gate(const Sequence& seq, const ProblemShape& shape, const ExactGateParams& p,
                         Decisions* decisions);
Status decide_softmax_skip(const Sequence& seq, const ProblemShape& shape,
                           const SoftmaxSkipParams& p, Decisions* decisions);
Status decide_estimate_select(const Sequence& seq, const ProblemShape& shape,
                              const EstimateSelectParams& p, Decisions* decisions);
Status decide_permute_stop(const Sequence& seq, const ProblemShape& shape,
                           const PermuteStopParams& p, Decisions* decisions);

// estimate_select's pooled keys and values: block j's mean over its valid keys, accumulated in
// double and then rounded to fp32 and to the input dtype (what a kernel stores and scores
// with; the lead's binding decision).
struct BlockMeans {
  int block = 0;                     // keys per block
  int h_kv = 0;
  int d = 0;
  int d_v = 0;
  std::vector<double> k;             // [num_blocks, h_kv, d]
  std::vector<double> v;             // [num_blocks, h_kv, d_v]
  std::vector<std::int64_t> length;  // [num_blocks] valid keys: block, or fewer for the last

  const double* k_mean(int j, int hk) const { return &k[offset(j, hk, d)]; }
  const double* v_mean(int j, int hk) const { return &v[offset(j, hk, d_v)]; }

 private:
  std::size_t offset(int j, int hk, int dim) const {
    return (static_cast<std::size_t>(j) * static_cast<std::size_t>(h_kv) +
            static_cast<std::size_t>(hk)) * static_cast<std::size_t>(dim);
  }
};
// Blocks j < cached are read from the policy's cache of block means (k/v_block_means), the
// others computed from the sequence's keys and values.
BlockMeans block_means(const Sequence& seq, const EstimateSelectParams& p, std::int64_t cached);
// Writes the means of blocks begin .. end-1 into the policy's cache.
void store_block_means(const Sequence& seq, const EstimateSelectParams& p, const BlockMeans& means,
                       std::int64_t begin, std::int64_t end);

// permute_stop: one segment's orders for query head h (segments: geom::SegmentGeometry).
struct SegmentOrder {
  std::int64_t prefix = 0;            // keys t < prefix precede the segment: s·segment
  std::int64_t ranked_begin = 0;      // the ranked keys are ranked_begin .. prefix - 1
                                      // (geom::SegmentGeometry::ranked_begin)
  std::vector<std::int64_t> ranked;   // those keys by q̄·k_t descending, ties lower first
  std::vector<std::int64_t> rows;     // the segment's rows by q_r·u descending, ties lower first
};
SegmentOrder order_segment(const Sequence& seq, int h, std::int64_t segment,
                           const PermuteStopParams& p);

}  // namespace sparseprefill::ref
