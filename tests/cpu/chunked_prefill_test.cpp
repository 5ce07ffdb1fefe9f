// SPDX-License-Identifier: Apache-2.0
// estimate_select under chunked prefill (docs/semantics.md §1, §3.5), what is the definition's
// rather than a backend's (tests/conformance runs the chunked scenarios on every backend): the
// tail counted over the prompt (prompt_len) and per call without it; on the oracle, a prompt
// prefilled in chunks with the cache of block means (boundaries at multiples of the block)
// decides exactly as the one-shot call and gives its outputs bit for bit, and the cache written
// back holds the recomputed means; malformed inputs are rejected with the argument named, on
// both host backends.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/cases.h"
#include "common/chunks.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/results.h"
#include "core/geometry.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {
namespace {

constexpr int kBlock = 8;
constexpr std::int64_t kPrompt = 96;  // 12 blocks

// ------------------------------------------------------------------ the tail rule

TEST(ChunkedTail, PromptRuleEqualsTheCallRuleForTheWholePrompt) {
  for (std::int64_t n : {1, 7, 8, 9, 95, 96, 97}) {
    const geom::BlockGeometry g = geometry(n, n, true, kBlock, kBlock);
    for (int tail : {0, 1, 2, 20}) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        EXPECT_EQ(g.is_tail_block(qb, tail, n), g.is_tail_block(qb, tail, 0)) << "n " << n << " tail " << tail << " qb " << qb;
      }
    }
  }
}

TEST(ChunkedTail, PromptRuleCountsTheLastBlocksOfThePrompt) {
  // A chunk of queries [32, 64) over 64 keys of a 100-token prompt (13 blocks of 8): with
  // tail 2 the prompt's tail is blocks 11 and 12, outside this chunk; the call rule would force
  // the chunk's last two tiles.
  const geom::BlockGeometry g = geometry(32, 64, true, kBlock, kBlock);
  for (int qb = 0; qb < 4; ++qb) EXPECT_FALSE(g.is_tail_block(qb, 2, 100)) << qb;
  EXPECT_TRUE(g.is_tail_block(3, 2, 0));
  EXPECT_TRUE(g.is_tail_block(2, 2, 0));
  // The last chunk [88, 100): tiles at absolute blocks 11 and 12 (partial).
  const geom::BlockGeometry last = geometry(12, 100, true, kBlock, kBlock);
  EXPECT_TRUE(last.is_tail_block(0, 2, 100));
  EXPECT_TRUE(last.is_tail_block(1, 2, 100));
  EXPECT_FALSE(last.is_tail_block(0, 1, 100));
  // Unaligned chunk start (rows at 30..37 straddle blocks 3 and 4): the tile's last row decides.
  const geom::BlockGeometry odd = geometry(10, 40, true, kBlock, kBlock);  // rows at 30..39
  EXPECT_TRUE(odd.is_tail_block(0, 1, 40));   // last row 37 in block 4 = the prompt's last
  EXPECT_FALSE(odd.is_tail_block(0, 1, 48));  // the prompt's last block is 5
}

// ------------------------------------------------------------------ chunked == one shot

Inputs prompt(int batch, std::uint64_t seed, DType dtype = DType::kBF16) {
  std::vector<SeqLen> lengths(static_cast<std::size_t>(batch), SeqLen{kPrompt, kPrompt});
  Inputs in = random_inputs(lengths, 4, 2, 16, dtype, seed, 2.0);
  // Every third block's keys shifted: their means stand out, so the energy rule prunes.
  for (SequenceData& s : in.seqs) {
    for (std::int64_t t = 0; t < kPrompt; ++t) {
      if ((t / kBlock) % 3 != 0) continue;
      for (std::int64_t i = t * in.h_kv * in.d; i < (t + 1) * in.h_kv * in.d; ++i) set(&s.k, i, get(s.k, i) + 0.75);
    }
  }
  return in;
}

EstimateSelectParams base_params(double alpha, bool correction, bool pack) {
  EstimateSelectParams p = small_estimate_select(alpha, kBlock, correction, pack);
  p.tail = 2;  // two forced tiles: per call they would multiply with the chunks
  return p;
}

Status call_oracle(TestProblem* tp, const Policy& policy, ref::Result* out) {
  return ref::run_reference(tp->problem(), policy, out);
}

struct Case {
  const char* name;
  bool correction;
  bool pack;
  LayoutOptions layout;
};

LayoutOptions paged(int page_size) {
  LayoutOptions o;
  o.layout = Layout::kPaged;
  o.page_size = page_size;
  return o;
}

// The oracle alone (tests/conformance runs the chunks on every backend at 128-token blocks):
// bit for bit the one-shot call, at chunk sizes that are multiples of the 8-token block but not
// of each other.
TEST(ChunkedEstimateSelect, OracleChunksWithCachedMeansEqualOneShotBitwise) {
  const Case cases[] = {{"contiguous", false, false, {}},
                        {"contiguous, mean correction", true, false, {}},
                        {"paged 4, mean correction, pack_gqa", true, true, paged(4)},
                        {"paged 16", false, false, paged(16)}};
  std::uint64_t seed = 30;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const Inputs full = prompt(2, seed++);
    const TestProblem one_shot = make_problem(full);
    const int units = c.pack ? full.h_kv : full.h_q;
    const double alpha = stable_parameter(one_shot, {0.3, 0.2, 0.5, 0.1, 0.05},
                                          [&](double x) -> Policy { return base_params(x, c.correction, c.pack); },
                                          some_skipped(visible_blocks({{kPrompt, kPrompt}, {kPrompt, kPrompt}}, units, true,
                                                                      kBlock, kBlock)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const EstimateSelectParams p = base_params(alpha, c.correction, c.pack);
    // The one-shot call: no prompt_len, no cache (today's behaviour).
    const ref::Result ref64 = oracle(one_shot, p);
    for (std::int64_t chunk : {32, 24, 40}) {
      SCOPED_TRACE("chunks of " + std::to_string(chunk));
      MeansCache cache(full, kBlock, kPrompt / kBlock + 1);
      const auto policy_for = [&](std::int64_t c0, std::int64_t) -> Policy {
        cache.advance(c0);
        return cache.attach(p);
      };
      ref::Result joined;
      EXPECT_TRUE(chunks_decide_as_one_shot(full, chunk, kBlock, c.layout, policy_for, call_oracle, ref64.decisions, &joined));
      // The same keys and pseudo-tokens per row, summed in the same order in fp64.
      EXPECT_TRUE(same_result(joined, ref64, 0.0));
      expect_cache_holds_recomputed_means(full, cache, p);
    }
  }
}

TEST(ChunkedEstimateSelect, WithoutPromptLenTheTailIsPerCall) {
  // The default (no prompt_len) keeps the per-call rule: the first chunk's last tiles keep
  // every visible block, unlike the one-shot call's rows.
  const Inputs full = prompt(1, 40);
  const EstimateSelectParams p = base_params(0.5, false, false);
  const ref::Result ref64 = oracle(make_problem(full), p);
  const TestProblem first = make_problem(chunk_of(full, 0, 32));
  const ref::Result per_call = oracle(first, p);
  const geom::BlockGeometry g = geometry(32, 32, true, kBlock, kBlock);
  for (int h = 0; h < full.h_q; ++h) {
    EXPECT_EQ(kept_blocks(per_call.decisions.kept, 0, h, 3).size(), static_cast<std::size_t>(g.visible_end(3)));
  }
  MeansCache cache(full, kBlock, kPrompt / kBlock);
  const ref::Result per_prompt = oracle(first, cache.attach(p));
  for (int h = 0; h < full.h_q; ++h) {
    for (int qb = 0; qb < 4; ++qb) {
      EXPECT_EQ(kept_blocks(per_prompt.decisions.kept, 0, h, qb), kept_blocks(ref64.decisions.kept, 0, h, qb));
    }
  }
}

// ------------------------------------------------------------------ hostile inputs

TEST(ChunkedEstimateSelect, MalformedInputsNameTheArgument) {
  const Inputs full = prompt(2, 60);
  const Inputs chunk = chunk_of(full, 32, 64);  // 8 complete blocks after the call
  TestProblem tp = make_problem(chunk);
  const EstimateSelectParams p = base_params(0.2, false, false);
  const auto expect_invalid = [&](const EstimateSelectParams& q, const std::string& name) {
    for (Backend backend : {Backend::kReference, Backend::kCPU}) {
      RunOptions opt;
      opt.backend = backend;
      const Status st = run(tp.problem(), q, tp.output(), opt);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << name << ": " << st.to_string();
      EXPECT_NE(st.message().find(name), std::string::npos) << st.message();
    }
  };
  MeansCache ok(full, kBlock, 8);
  {
    EstimateSelectParams q = ok.attach(p);
    q.v_block_means = TensorView{};
    expect_invalid(q, "block_means_valid");  // validate_policy: all three or none
  }
  {
    MeansCache small(full, kBlock, 7);  // the call completes 8 blocks
    expect_invalid(small.attach(p), "k_block_means");
  }
  {
    HostTensor wrong_d(DType::kBF16, {2, 2, 8, 8});
    EstimateSelectParams q = ok.attach(p);
    q.v_block_means = wrong_d.view();
    expect_invalid(q, "v_block_means");
  }
  {
    HostTensor wrong_dtype(DType::kFP16, {2, 2, 8, 16});
    EstimateSelectParams q = ok.attach(p);
    q.k_block_means = wrong_dtype.view();
    expect_invalid(q, "k_block_means");
  }
  {
    MeansCache beyond(full, kBlock, 8);
    beyond.valid.as<std::int32_t>()[1] = 9;  // 64 keys hold 8 complete blocks
    expect_invalid(beyond.attach(p), "block_means_valid[1]");
    beyond.valid.as<std::int32_t>()[1] = -1;
    expect_invalid(beyond.attach(p), "block_means_valid[1]");
  }
  {
    HostTensor short_valid(DType::kInt32, {1});
    EstimateSelectParams q = ok.attach(p);
    q.block_means_valid = short_valid.view();
    expect_invalid(q, "block_means_valid");
  }
  {
    MeansCache shorter(full, kBlock, 8);
    shorter.prompt_len.as<std::int32_t>()[0] = 63;  // fewer than the call's 64 keys
    expect_invalid(shorter.attach(p), "prompt_len[0]");
  }
  {
    HostTensor float_len(DType::kFP32, {2});
    EstimateSelectParams q = p;
    q.prompt_len = float_len.view();
    expect_invalid(q, "prompt_len");
  }
}

}  // namespace
}  // namespace sparseprefill::test
