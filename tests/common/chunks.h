// SPDX-License-Identifier: Apache-2.0
// Chunked prefill in tests: the call a chunk makes (its queries over the prefix so far plus
// itself), and estimate_select's cache of block means kept beside it across the chunks.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "common/inputs.h"
#include "reference/reference.h"
#include "sparseprefill/policy.h"

namespace sparseprefill::test {

// Rows [c0, c1) of the queries and the first c1 keys and values of every sequence of `full`
// (each sequence at least c1 long): the call a chunked prefill makes for that chunk.
Inputs chunk_of(const Inputs& full, std::int64_t c0, std::int64_t c1);

// Host tensors of estimate_select's chunked-prefill inputs for the prompts of `full`: caches
// k/v [b, h_kv, max_blocks, d] in full's dtype, NaN until a call writes them (so reading an
// entry that no call wrote shows), valid = 0 and prompt_len = each prompt's length.
struct MeansCache {
  HostTensor k, v, valid, prompt_len;
  int block = 0;

  MeansCache(const Inputs& full, int block, std::int64_t max_blocks);
  // p with prompt_len and the cache attached (host views of the tensors above).
  EstimateSelectParams attach(EstimateSelectParams p) const;
  // After a call over the first s_k keys of every sequence: its complete blocks are valid.
  void advance(std::int64_t s_k);
};

// The cache's blocks [0, s_k / block) of every sequence of `in` equal the oracle's recomputed
// means bitwise; the entries past them were never written (still NaN).
void expect_cache_holds_recomputed_means(const Inputs& in, const MeansCache& cache, const EstimateSelectParams& p);

// One call of a backend under test: runs `policy` on tp and returns its output in the oracle's
// layout with its decisions.
using ChunkCall = std::function<Status(TestProblem* tp, const Policy& policy, ref::Result* out)>;

// Prefills the prompts of `full` (batch of equal lengths n, s_q = s_k) in chunks of `chunk`
// queries (a multiple of the policy's block), each chunk one `call` on the layout `layout` with
// the policy policy_for(c0, c1). Every chunk's decisions must equal the one-shot decisions
// `one_shot`: block policies (block_q = `block_q`) the kept (and corrected) blocks of its rows;
// permute_stop (chunks of whole segments) the tiles of its segments and its query order shifted
// by c0. *joined gets the chunks' outputs put together in the one-shot layout.
::testing::AssertionResult chunks_decide_as_one_shot(const Inputs& full, std::int64_t chunk, int block_q,
                                                     const LayoutOptions& layout,
                                                     const std::function<Policy(std::int64_t, std::int64_t)>& policy_for,
                                                     const ChunkCall& call, const Decisions& one_shot,
                                                     ref::Result* joined);

}  // namespace sparseprefill::test
