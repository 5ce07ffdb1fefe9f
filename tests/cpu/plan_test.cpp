// SPDX-License-Identifier: Apache-2.0
// select() and plans (include/sparseprefill/plan.h) where the dispatch layer, not a backend,
// decides (tests/conformance checks select() and run(plan) against run() on every backend):
// dense and block_sparse selections, in-kernel decisions refused with a reason, a problem that
// does not match its plan refused with the field that differs, a plan that keeps its own policy
// and serves threads at once.
#include "sparseprefill/plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "common/cases.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/poison.h"

namespace sparseprefill::test {
namespace {

// Two sequences with s_q != s_k (chunked prefill) and unequal key lengths, GQA group 2.
const std::vector<SeqLen> kLengths = {{37, 53}, {37, 64}};

Inputs inputs(std::uint64_t seed) { return random_inputs(kLengths, 4, 2, 16, DType::kBF16, seed); }

RunOptions cpu_options() {
  RunOptions o;
  o.backend = Backend::kCPU;
  o.num_threads = 1;  // deterministic bits for the comparisons below
  return o;
}

void expect_same_stats(const RunStats& a, const RunStats& b) {
  ASSERT_EQ(a.heads.size(), b.heads.size());
  for (std::size_t i = 0; i < a.heads.size(); ++i) {
    EXPECT_EQ(a.heads[i].visible_blocks, b.heads[i].visible_blocks) << "head " << i;
    EXPECT_EQ(a.heads[i].kept_blocks, b.heads[i].kept_blocks) << "head " << i;
    EXPECT_EQ(a.heads[i].corrected_blocks, b.heads[i].corrected_blocks) << "head " << i;
    EXPECT_EQ(a.heads[i].computed_pairs, b.heads[i].computed_pairs) << "head " << i;
  }
}

// A block_sparse mask keeping about half of the visible 16 x 16 blocks, at random.
BlockSparseParams half_mask(const TestProblem& tp) {
  ProblemShape shape;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  BlockSparseParams p;
  p.mask = BlockMask::empty(shape, 16, 16, false);
  const BlockMask all = BlockMask::all_visible(shape, 16, 16, false);
  std::uint64_t state = 5;
  for (int b = 0; b < shape.batch; ++b) {
    for (int h = 0; h < shape.h_q; ++h) {
      for (int qb = 0; qb < all.num_q_blocks; ++qb) {
        for (int kb = 0; kb < all.num_k_blocks; ++kb) {
          state = state * 6364136223846793005ull + 1442695040888963407ull;
          if (all.contains(b, h, qb, kb) && (state >> 62) != 0) EXPECT_TRUE(p.mask.add(shape, b, h, qb, kb).ok());
        }
      }
    }
  }
  return p;
}

TEST(Select, DenseSelectsEveryVisibleBlock) {
  const TestProblem tp = make_problem(inputs(2));
  Decisions d;
  RunStats stats;
  const Status st = select(tp.problem(), DenseParams{}, cpu_options(), &d, &stats);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  Decisions expected;
  expected.policy = "dense";
  expected.kept = BlockMask::all_visible(shape, 128, 128, false);
  EXPECT_TRUE(same_decisions(expected, d));
  EXPECT_EQ(stats.density(), 1.0);
  EXPECT_EQ(stats.heads.size(), 2u * 4u);
  EXPECT_EQ(stats.heads[0].visible_blocks, 1);  // 37 queries, 53 keys: one 128 x 128 block
}

TEST(Select, BlockSparseReturnsItsMask) {
  const TestProblem tp = make_problem(inputs(3), true, Layout::kVarlen);
  const BlockSparseParams policy = half_mask(tp);
  Decisions d;
  RunStats stats, run_stats;
  ASSERT_TRUE(select(tp.problem(), policy, cpu_options(), &d, &stats).ok());
  EXPECT_EQ(d.kept.full_index, policy.mask.full_index);
  EXPECT_EQ(d.kept.partial_count, policy.mask.partial_count);
  TestProblem out = tp;
  ASSERT_TRUE(run(out.problem(), policy, out.output(), cpu_options(), &run_stats).ok());
  expect_same_stats(run_stats, stats);
  EXPECT_GT(stats.density(), 0.2);
  EXPECT_LT(stats.density(), 0.9);
}

TEST(Select, InKernelDecisionsAreUnsupportedWithAReason) {
  const TestProblem tp = make_problem(inputs(4));
  HostTensor table(DType::kFP32, {4, 8});
  for (std::int64_t i = 0; i < table.numel(); ++i) table.as<float>()[i] = 0.3f;
  ExactGateParams gate;
  gate.thresholds = table.view();
  for (const Policy& policy : {Policy{gate}, Policy{SoftmaxSkipParams{}}, Policy{PermuteStopParams{}}}) {
    Decisions d;
    const Status st = select(tp.problem(), policy, cpu_options(), &d);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << policy_name(policy);
    EXPECT_NE(st.message().find(policy_name(policy)), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("run()"), std::string::npos) << st.message();
  }
  Decisions d;
  EXPECT_EQ(select(tp.problem(), DenseParams{}, cpu_options(), nullptr).code(), StatusCode::kInvalidArgument);
  RunOptions bad = cpu_options();
  bad.backend = Backend::kCUDA;
  EXPECT_NE(select(tp.problem(), DenseParams{}, bad, &d).code(), StatusCode::kOk);
}

// inputs(seed) with one sink logit per query head.
Inputs with_sinks(Inputs in) {
  in.sinks.assign(static_cast<std::size_t>(in.h_q), 0.5);
  return in;
}

// inputs(1) laid out with the options `edit` sets.
TestProblem with(const std::function<void(LayoutOptions*)>& edit) {
  LayoutOptions o;
  edit(&o);
  return build_problem(inputs(1), o);
}

TEST(Plan, ProblemMustMatchThePlan) {
  const TestProblem base = make_problem(inputs(20));
  Plan plan;
  ASSERT_TRUE(make_plan(base.problem(), DenseParams{}, cpu_options(), &plan).ok());
  struct Case {
    const char* what;
    TestProblem tp;
  };
  const std::vector<Case> cases = {
      {"key lengths", make_problem(random_inputs({{37, 54}, {37, 64}}, 4, 2, 16, DType::kBF16, 1))},
      {"query lengths", make_problem(random_inputs({{36, 53}, {36, 64}}, 4, 2, 16, DType::kBF16, 1))},
      {"batch", make_problem(random_inputs({{37, 53}}, 4, 2, 16, DType::kBF16, 1))},
      {"h_q", make_problem(random_inputs(kLengths, 8, 2, 16, DType::kBF16, 1))},
      {"h_kv", make_problem(random_inputs(kLengths, 4, 4, 16, DType::kBF16, 1))},
      {"head_dim", make_problem(random_inputs(kLengths, 4, 2, 32, DType::kBF16, 1))},
      {"dtype", make_problem(random_inputs(kLengths, 4, 2, 16, DType::kFP16, 1))},
      {"causal", make_problem(inputs(1), false)},
      {"q layout", make_problem(inputs(1), true, Layout::kVarlen)},
      {"v head_dim", make_problem(random_inputs(kLengths, 4, 2, 16, DType::kBF16, 1, 1.0, Distribution::kUniform, 8))},
      {"window", with([](LayoutOptions* o) { o->window_left = 7; })},
      {"softcap", with([](LayoutOptions* o) { o->softcap = 5.0; })},
      {"sinks", make_problem(with_sinks(inputs(1)))},
  };
  for (const Case& c : cases) {
    TestProblem tp = c.tp;
    const Status st = run(plan, tp.problem(), tp.output(), cpu_options());
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(st.message().find(std::string("does not match the plan: ") + c.what), std::string::npos)
        << c.what << ": " << st.message();
  }
  // Another backend than the plan's, and an empty plan, are refused too.
  TestProblem tp = base;
  RunOptions reference = cpu_options();
  reference.backend = Backend::kReference;
  EXPECT_EQ(run(plan, tp.problem(), tp.output(), reference).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(run(Plan{}, tp.problem(), tp.output(), cpu_options()).code(), StatusCode::kInvalidArgument);
}

TEST(Plan, InvalidPolicyFailsAtCreation) {
  const TestProblem tp = make_problem(inputs(30));
  const TestProblem other = make_problem(random_inputs({{200, 200}, {200, 200}}, 4, 2, 16, DType::kBF16, 1));
  Plan plan;
  // A mask made for another geometry: refused once, at creation, naming the mask.
  const Status st = make_plan(tp.problem(), half_mask(other), cpu_options(), &plan);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("mask"), std::string::npos) << st.message();
  EXPECT_FALSE(plan.valid());
  // A plan keeps its own copy of the policy.
  BlockSparseParams policy = half_mask(tp);
  ASSERT_TRUE(make_plan(tp.problem(), policy, cpu_options(), &plan).ok());
  const std::int64_t selected = policy.mask.selected_blocks();
  policy.mask = BlockMask{};
  EXPECT_EQ(std::get<BlockSparseParams>(plan.policy()).mask.selected_blocks(), selected);
}

// A plan is immutable: threads running one plan at once each get run()'s result for their own
// inputs.
TEST(Plan, ThreadsShareOnePlan) {
  const TestProblem base = make_problem(inputs(40));
  const BlockSparseParams policy = half_mask(base);
  Plan plan;
  ASSERT_TRUE(make_plan(base.problem(), policy, cpu_options(), &plan).ok());
  constexpr int kThreads = 4;
  std::vector<TestProblem> planned, direct;
  for (int t = 0; t < kThreads; ++t) {
    planned.push_back(make_problem(inputs(41 + static_cast<std::uint64_t>(t))));
    direct.push_back(planned.back());
  }
  std::vector<Status> results(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const auto u = static_cast<std::size_t>(t);
      for (int repeat = 0; repeat < 3 && results[u].ok(); ++repeat) {
        results[u] = run(plan, planned[u].problem(), planned[u].output(), cpu_options());
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    const auto u = static_cast<std::size_t>(t);
    EXPECT_TRUE(results[u].ok()) << results[u].to_string();
    ASSERT_TRUE(run(direct[u].problem(), policy, direct[u].output(), cpu_options()).ok());
    EXPECT_EQ(std::memcmp(planned[u].o.data(), direct[u].o.data(), direct[u].o.nbytes()), 0) << "thread " << t;
  }
}

}  // namespace
}  // namespace sparseprefill::test
