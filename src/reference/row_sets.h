// SPDX-License-Identifier: Apache-2.0
// Expands a policy's Decisions into what each query row attends to: the exact set of keys its
// softmax reads and the mean-correction pseudo-tokens. The oracle computes its outputs from
// this expansion only, so any backend's decisions can be replayed by the oracle or by the
// test suite's low-precision reference. Host-only.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/decide.h"
#include "reference/reference.h"
#include "reference/sequence.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::ref {

// Checks that `decisions` (made by any backend) fit the problem and the policy: the policy
// name, the masks' geometry (validate_for, block sizes, per-KV-head layout), corrected blocks
// disjoint from kept ones and wholly visible to their tile, and for permute_stop a query order
// that permutes each segment's rows and exactly one tile record per tile.
Status check_decisions(const ProblemShape& shape, const Policy& policy, const Decisions& decisions);

struct RowAttention {
  std::vector<std::int64_t> keys;  // absolute key positions the softmax reads, each once
  std::vector<int> mean_blocks;    // key blocks added back as one pseudo-token each
};

class RowSets {
 public:
  // Prepares sequence `seq`'s expansion. Precondition: check_decisions passed. Keeps
  // references to `seq` and `decisions`; both must outlive this object.
  void init(const Sequence& seq, const ProblemShape& shape, const Policy& policy,
            const Decisions& decisions);
  // Row r (call-relative) of query head h.
  void row(int h, std::int64_t r, RowAttention* out) const;
  // The means that mean_blocks refer to; null unless the policy corrects.
  const BlockMeans* means() const { return has_means_ ? &means_ : nullptr; }

 private:
  enum class Kind { kDense, kBlocks, kPermute };
  const Sequence* seq_ = nullptr;
  const Decisions* decisions_ = nullptr;
  Kind kind_ = Kind::kDense;
  bool has_means_ = false;
  BlockMeans means_;
  // permute_stop
  geom::SegmentGeometry segments_;
  std::vector<std::vector<std::int64_t>> ranked_;  // [h_q, segments_.count()] ranked prefix keys
  std::vector<std::int64_t> prefix_visited_;       // [h_q, s_q] ranked keys each row reads
};

// The oracle's compute stage on its own: O and LSE in fp64 for the key sets that `decisions`
// (from any backend; checked with check_decisions) imply. run_reference is decide + this.
// `result->decisions` is left untouched.
Status attend_decisions(const AttentionProblem& problem, const Policy& policy,
                        const Decisions& decisions, Result* result);

}  // namespace sparseprefill::ref
