// SPDX-License-Identifier: Apache-2.0
// The fp64 oracle on hand-computed cases of the model-family features of docs/semantics.md §1:
// the local window (causal and not, chunks), learned sinks, softcap and a V head dim unlike
// Q/K's; their NaN and infinity behaviour; and each policy under a local window (what it keeps
// of the visible blocks), worked out in the comments on tiny fp32 inputs (values on a grid,
// d = 2 and 4-token blocks). The outputs of the policy cases are checked against the naive
// masked softmax over the expanded mask (tests/common/naive.h), their decisions by hand.
#include <cmath>
#include <initializer_list>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/inputs.h"
#include "common/naive.h"
#include "common/results.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill {
namespace {

using test::Inputs;
using test::kept_blocks;
using test::kLn2;
using test::put;
using test::same_result;
using test::kInf;
using test::kNaN;
using test::kExact;
using test::SeqLen;

struct Call {
  double scale = kLn2;
  bool causal = true;
  int left = -1;
  int right = -1;
  double softcap = 0.0;
  int chunk = 0;
};

ref::Result run_ok(const Inputs& in, const Policy& policy, const Call& c) {
  test::LayoutOptions opt;
  opt.scale = c.scale;
  opt.causal = c.causal;
  opt.window_left = c.left;
  opt.window_right = c.right;
  opt.attention_chunk = c.chunk;
  opt.softcap = c.softcap;
  const test::TestProblem tp = test::build_problem(in, opt);
  ref::Result r;
  const Status st = ref::run_reference(tp.problem(), policy, &r);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return r;
}

// The naive masked softmax of `in` under the call's causal mask and window, further limited to
// keep(h, r, t) (the expanded decisions of a policy).
template <class F>
ref::Result naive(const Inputs& in, const Call& c, F keep) {
  return test::masked_softmax(
      in, c.scale,
      [&](int b, int h, std::int64_t r, std::int64_t t) {
        return test::window_visible(in.s_q(b), in.s_k(b), c.causal, c.left, c.right, r, t, c.chunk) && keep(h, r, t);
      },
      c.softcap);
}
constexpr auto kAll = [](int, std::int64_t, std::int64_t) { return true; };

// The kept (and corrected) blocks of a block policy expanded into keys: row r of head h reads
// key t iff t's block is kept for r's query block (the window clips it further).
auto kept_keys(const Decisions& d) {
  return [&d](int h, std::int64_t r, std::int64_t t) {
    return d.kept.contains(0, d.kept.per_kv_head ? 0 : h, static_cast<int>(r / d.kept.block_q),
                           static_cast<int>(t / d.kept.block_k));
  };
}

void expect_rows(const ref::Result& r, const std::vector<double>& o, const std::vector<double>& lse) {
  ASSERT_EQ(r.o.size(), o.size());
  for (std::size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(r.o[i], o[i], kExact) << "O " << i;
  for (std::size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(r.lse[i], lse[i], kExact) << "LSE " << i;
}

// q0 = (1,0), q1 = (0,1), q2 = (1,1); k0 = (1,0), k1 = (0,1), k2 = (1,1);
// v0 = (1,2), v1 = (3,-1), v2 = (-2,4); scale ln 2, so each weight is 2^(q·k). d_v = 3 adds a
// third value column (0.5, 2, -1).
Inputs dense_case(int d_v = 2, int s_q = 3) {
  Inputs in = test::empty_inputs({{s_q, 3}}, 1, 1, 2, DType::kFP32, d_v);
  test::SequenceData& s = in.seqs[0];
  const double q[3][2] = {{1, 0}, {0, 1}, {1, 1}};
  for (int r = 0; r < s_q; ++r) put(&s.q, r, 0, {q[r + 3 - s_q][0], q[r + 3 - s_q][1]});
  put(&s.k, 0, 0, {1, 0});
  put(&s.k, 1, 0, {0, 1});
  put(&s.k, 2, 0, {1, 1});
  if (d_v == 2) {
    put(&s.v, 0, 0, {1, 2});
    put(&s.v, 1, 0, {3, -1});
    put(&s.v, 2, 0, {-2, 4});
  } else {
    put(&s.v, 0, 0, {1, 2, 0.5});
    put(&s.v, 1, 0, {3, -1, 2});
    put(&s.v, 2, 0, {-2, 4, -1});
  }
  return in;
}

// ---------------------------------------------------------------- local window

TEST(ReferenceFeatures, CausalWindowKeepsTheLastKeysOfEachRow) {
  // window_left 1: row 0 sees k0 (O = v0, LSE = ln 2); row 1 sees k0, k1 (weights 1, 2:
  // O = (7/3, 0), LSE = ln 3); row 2 sees k1, k2 only (q·k = 1, 2, weights 2, 4:
  // O = (2 v1 + 4 v2) / 6 = (-1/3, 7/3), LSE = ln 6).
  Call c;
  c.left = 1;
  const ref::Result r = run_ok(dense_case(), DenseParams{}, c);
  expect_rows(r, {1, 2, 7.0 / 3, 0, -1.0 / 3, 7.0 / 3}, {std::log(2.0), std::log(3.0), std::log(6.0)});
  // window_left 0: every row sees its own key alone: O = v_r, LSE = ln 2^(q_r·k_r).
  c.left = 0;
  expect_rows(run_ok(dense_case(), DenseParams{}, c), {1, 2, 3, -1, -2, 4},
              {std::log(2.0), std::log(2.0), std::log(4.0)});
  // A right bound changes nothing under causal: (1, 5) is (1, -1).
  c.left = 1;
  c.right = 5;
  EXPECT_TRUE(same_result(run_ok(dense_case(), DenseParams{}, c), r, 0.0));
}

TEST(ReferenceFeatures, NonCausalWindowIsBottomRightAligned) {
  // window (0, 1), causal false: row 0 sees k0, k1 (weights 2, 1: O = (5/3, 1), LSE = ln 3),
  // row 1 sees k1, k2 (weights 2, 2: O = (1/2, 3/2), LSE = ln 4), row 2 sees k2 (O = v2, ln 4).
  Call c;
  c.causal = false;
  c.left = 0;
  c.right = 1;
  expect_rows(run_ok(dense_case(), DenseParams{}, c), {5.0 / 3, 1, 0.5, 1.5, -2, 4},
              {std::log(3.0), std::log(4.0), std::log(4.0)});
  // (-1, 0) without causal is FlashAttention's causal.
  Call causal_window;
  causal_window.causal = false;
  causal_window.right = 0;
  EXPECT_TRUE(same_result(run_ok(dense_case(), DenseParams{}, causal_window), run_ok(dense_case(), DenseParams{}, Call{}), 0.0));
  // A chunk (the last two queries over the three keys) sits at positions 1 and 2: its rows are
  // rows 1 and 2 of the full call.
  const ref::Result chunk = run_ok(dense_case(2, 2), DenseParams{}, c);
  expect_rows(chunk, {0.5, 1.5, -2, 4}, {std::log(4.0), std::log(4.0)});
}

TEST(ReferenceFeatures, AWindowThatHidesEveryKeyLeavesAnEmptyRow) {
  // Non-causal window (-1, 0) with 4 queries over 2 keys puts rows 0 and 1 at negative
  // positions (-2, -1): they see nothing (O = 0, LSE = -inf) even without causal.
  Inputs in = test::empty_inputs({{4, 2}}, 1, 1, 2, DType::kFP32);
  for (int r = 0; r < 4; ++r) put(&in.seqs[0].q, r, 0, {1, 0});
  put(&in.seqs[0].k, 0, 0, {1, 0});
  put(&in.seqs[0].k, 1, 0, {2, 0});
  put(&in.seqs[0].v, 0, 0, {1, 1});
  put(&in.seqs[0].v, 1, 0, {3, 3});
  Call c;
  c.causal = false;
  c.right = 0;
  const ref::Result r = run_ok(in, DenseParams{}, c);
  EXPECT_EQ(r.lse[0], -kInf);
  EXPECT_EQ(r.lse[1], -kInf);
  EXPECT_EQ(r.o[0], 0.0);
  EXPECT_NEAR(r.lse[2], kLn2, kExact);  // row 2 at position 0: k0 alone, 2^1
  EXPECT_NEAR(r.o[4], 1.0, kExact);
}

// ---------------------------------------------------------------- chunks

TEST(ReferenceFeatures, ChunksKeepEachRowToTheKeysOfItsChunk) {
  // attention_chunk 2, causal: positions 0, 1 form chunk 0 and 2 chunk 1. Row 0 sees k0 (O = v0,
  // LSE = ln 2), row 1 k0, k1 (weights 1, 2: O = (7/3, 0), LSE = ln 3), row 2 k2 alone (O = v2,
  // LSE = ln 4).
  Call c;
  c.chunk = 2;
  expect_rows(run_ok(dense_case(), DenseParams{}, c), {1, 2, 7.0 / 3, 0, -2, 4},
              {std::log(2.0), std::log(3.0), std::log(4.0)});
  // Non-causal, chunk 2: rows 0 and 1 see k0, k1 (row 0: weights 2, 1: O = (5/3, 1), LSE ln 3;
  // row 1: weights 1, 2: O = (7/3, 0), LSE ln 3), row 2 k2 alone.
  c.causal = false;
  expect_rows(run_ok(dense_case(), DenseParams{}, c), {5.0 / 3, 1, 7.0 / 3, 0, -2, 4},
              {std::log(3.0), std::log(3.0), std::log(4.0)});
  // A chunk wider than the sequence changes nothing; chunk 1 is window (0, 0).
  c.causal = true;
  c.chunk = 5;
  EXPECT_TRUE(same_result(run_ok(dense_case(), DenseParams{}, c), run_ok(dense_case(), DenseParams{}, Call{}), 0.0));
  c.chunk = 1;
  Call own;
  own.left = 0;
  EXPECT_TRUE(same_result(run_ok(dense_case(), DenseParams{}, c), run_ok(dense_case(), DenseParams{}, own), 0.0));
}

TEST(ReferenceFeatures, ChunksWithWindowsAndCachedPrefixesMatchTheNaiveMask) {
  // Random inputs against the naive mask (FlashAttention's definition, test::window_visible):
  // chunks with and without a window, causal and not, a chunk of queries over a cached prefix
  // (s_q < s_k: bottom-right positions) and more queries than keys (negative positions).
  for (const SeqLen len : {SeqLen{37, 90}, SeqLen{40, 25}, SeqLen{64, 64}}) {
   const Inputs in = test::random_inputs({len}, 2, 1, 8, DType::kFP32, 3100 + static_cast<std::uint64_t>(len.s_k), 1.0);
   for (const bool causal : {true, false}) {
    for (const auto& [chunk, left, right] : std::vector<std::tuple<int, int, int>>{
             {1, -1, -1}, {7, -1, -1}, {16, -1, -1}, {30, 5, -1}, {9, -1, 3}, {12, 20, 4}, {100, -1, -1}}) {
      Call c;
      c.causal = causal;
      c.chunk = chunk;
      c.left = left;
      c.right = right;
      SCOPED_TRACE(std::to_string(len.s_q) + "x" + std::to_string(len.s_k) + " chunk " + std::to_string(chunk) +
                   " window (" + std::to_string(left) + ", " + std::to_string(right) + ")" + (causal ? " causal" : ""));
      EXPECT_TRUE(same_result(run_ok(in, DenseParams{}, c), naive(in, c, kAll), kExact));
    }
   }
  }
}

// ---------------------------------------------------------------- sinks

TEST(ReferenceFeatures, SinkAddsOneTermToEveryDenominator) {
  // Sink 0 (weight e^0 = 1, value 0; sinks are fp32, and ln 2 is not). Row 0: weights {2} + 1:
  // O = 2 v0 / 3 = (2/3, 4/3), LSE = ln 3. Row 1: {1, 2} + 1: O = (v0 + 2 v1) / 4 = (7/4, 0),
  // LSE = ln 4. Row 2: {2, 2, 4} + 1: O = (2 v0 + 2 v1 + 4 v2) / 9 = (0, 2), LSE = ln 9.
  Inputs in = dense_case();
  in.sinks = {0.0};
  expect_rows(run_ok(in, DenseParams{}, Call{}), {2.0 / 3, 4.0 / 3, 7.0 / 4, 0, 0, 2},
              {std::log(3.0), std::log(4.0), std::log(9.0)});
  // A sink of -inf adds e^-inf = 0: no sink at all, exactly.
  in.sinks = {-kInf};
  EXPECT_TRUE(same_result(run_ok(in, DenseParams{}, Call{}), run_ok(dense_case(), DenseParams{}, Call{}), 0.0));
}

TEST(ReferenceFeatures, SinkOfARowThatSeesNoKeyIsItsLse) {
  // 4 queries over 2 keys: rows 0, 1 see nothing. Head 0's sink 0.75 makes their LSE 0.75 with
  // O = 0; head 1's sink -inf leaves them empty (LSE -inf). Row 2 (k0, score 1 · ln 2) with
  // sink 0.75: LSE = ln(2 + e^0.75), O = 2 v0 / (2 + e^0.75).
  Inputs in = test::empty_inputs({{4, 2}}, 2, 1, 2, DType::kFP32);
  for (int r = 0; r < 4; ++r) {
    put(&in.seqs[0].q, r, 0, {1, 0});
    put(&in.seqs[0].q, r, 1, {1, 0});
  }
  put(&in.seqs[0].k, 0, 0, {1, 0});
  put(&in.seqs[0].k, 1, 0, {0, 1});
  put(&in.seqs[0].v, 0, 0, {1, 3});
  put(&in.seqs[0].v, 1, 0, {5, 7});
  in.sinks = {0.75, -kInf};
  const ref::Result r = run_ok(in, DenseParams{}, Call{});
  // LSE [h_q, rows]; O [rows, h_q, 2].
  EXPECT_EQ(r.lse[0], 0.75);
  EXPECT_EQ(r.lse[1], 0.75);
  EXPECT_EQ(r.lse[4], -kInf);
  EXPECT_EQ(r.lse[5], -kInf);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(r.o[static_cast<std::size_t>(i)], 0.0) << i;
  const double den = 2 + std::exp(0.75);
  EXPECT_NEAR(r.lse[2], std::log(den), kExact);
  EXPECT_NEAR(r.o[8], 2.0 / den, kExact);
  EXPECT_NEAR(r.o[9], 6.0 / den, kExact);
  EXPECT_NEAR(r.lse[6], kLn2, kExact);  // head 1: no sink term
}

TEST(ReferenceFeatures, NaNOrInfiniteSinkMakesItsHeadNaNAndNoOtherHead) {
  // Head 0's sink NaN, head 1's +inf (e^(inf - inf)), head 2's finite: heads 0 and 1 are NaN in
  // every row (O and LSE), head 2 is finite.
  Inputs in = test::random_inputs({{5, 5}}, 3, 1, 4, DType::kFP32, 7);
  in.sinks = {kNaN, kInf, 0.5};
  const ref::Result r = run_ok(in, DenseParams{}, Call{});
  for (int row = 0; row < 5; ++row) {
    for (int h = 0; h < 3; ++h) {
      const double lse = r.lse[static_cast<std::size_t>(h * 5 + row)];
      const double o = r.o[static_cast<std::size_t>((row * 3 + h) * 4)];
      EXPECT_EQ(std::isnan(lse), h < 2) << "row " << row << " head " << h;
      EXPECT_EQ(std::isnan(o), h < 2) << "row " << row << " head " << h;
    }
  }
}

// ---------------------------------------------------------------- softcap

TEST(ReferenceFeatures, SoftcapTanhCapsEveryScoreBeforeTheSoftmax) {
  // Scale 1, softcap 1: the scores q·k in {0, 1, 2} become tanh(0), tanh(1), tanh(2). Row 1
  // (q·k = 0, 1): O = (v0 + e^tanh1 v1) / (1 + e^tanh1), LSE = ln(1 + e^tanh1). Row 2
  // (q·k = 1, 1, 2): weights a = e^tanh1 (twice) and b = e^tanh2.
  Call c;
  c.scale = 1.0;
  c.softcap = 1.0;
  const ref::Result r = run_ok(dense_case(), DenseParams{}, c);
  const double a = std::exp(std::tanh(1.0)), b = std::exp(std::tanh(2.0));
  expect_rows(r, {1, 2, (1 + 3 * a) / (1 + a), (2 - a) / (1 + a), (a + 3 * a - 2 * b) / (2 * a + b),
                  (2 * a - a + 4 * b) / (2 * a + b)},
              {std::tanh(1.0), std::log(1 + a), std::log(2 * a + b)});
}

TEST(ReferenceFeatures, SoftcapMakesAnInfiniteScoreFinite) {
  // q = (inf, 1) against k0 = (1, 1), k1 = (1, 2): both scores are +inf, capped to 3 each:
  // equal weights, O = (v0 + v1) / 2, LSE = 3 + ln 2. Without softcap, inf - inf is NaN.
  Inputs in = test::empty_inputs({{1, 2}}, 1, 1, 2, DType::kFP32);
  put(&in.seqs[0].q, 0, 0, {kInf, 1});
  put(&in.seqs[0].k, 0, 0, {1, 1});
  put(&in.seqs[0].k, 1, 0, {1, 2});
  put(&in.seqs[0].v, 0, 0, {1, 5});
  put(&in.seqs[0].v, 1, 0, {3, -1});
  Call c;
  c.scale = 1.0;
  c.softcap = 3.0;
  expect_rows(run_ok(in, DenseParams{}, c), {2, 2}, {3 + std::log(2.0)});
  c.softcap = 0.0;
  const ref::Result raw = run_ok(in, DenseParams{}, c);
  EXPECT_TRUE(std::isnan(raw.o[0]));
  EXPECT_TRUE(std::isnan(raw.lse[0]));
}

TEST(ReferenceFeatures, ExactGateComparesTheCappedMaximum) {
  // 8 rows over 8 keys, blocks 4 x 4, scale 1: query block 1's full block 0 has raw maximum
  // q·k = 2 (row 4 · key 0), capped by softcap 1 to tanh 2 = 0.964. A threshold of 1.5 keeps the
  // raw block and skips the capped one; 0.9 keeps both.
  Inputs in = test::empty_inputs({{8, 8}}, 1, 1, 2, DType::kFP32);
  for (int t = 0; t < 8; ++t) {
    put(&in.seqs[0].q, t, 0, {t == 4 ? 2.0 : 0.5, 0});
    put(&in.seqs[0].k, t, 0, {t == 0 ? 1.0 : 0.25, 0});
    put(&in.seqs[0].v, t, 0, {static_cast<double>(t), 1});
  }
  const auto gate_with = [&](double threshold) {
    HostTensor table(DType::kFP32, {1, 2});
    test::set(&table, 0, threshold);
    test::set(&table, 1, threshold);
    ExactGateParams p;
    p.block_q = 4;
    p.block_k = 4;
    p.thresholds = table.view();
    return std::make_pair(std::move(table), p);
  };
  Call capped;
  capped.scale = 1.0;
  capped.softcap = 1.0;
  Call raw = capped;
  raw.softcap = 0.0;
  {
    auto [table, p] = gate_with(1.5);
    p.thresholds = table.view();
    EXPECT_EQ(kept_blocks(run_ok(in, p, raw).decisions.kept, 0, 0, 1), (std::vector<int>{0, 1}));
    const ref::Result r = run_ok(in, p, capped);
    EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 1), (std::vector<int>{1}));
    EXPECT_TRUE(same_result(r, naive(in, capped, kept_keys(r.decisions)), 1e-12));
  }
  {
    auto [table, p] = gate_with(0.9);
    p.thresholds = table.view();
    EXPECT_EQ(kept_blocks(run_ok(in, p, capped).decisions.kept, 0, 0, 1), (std::vector<int>{0, 1}));
  }
}

// ---------------------------------------------------------------- V head dim

TEST(ReferenceFeatures, ValueHeadDimOfItsOwn) {
  // d = 2, d_v = 3: the weights are dense_case's, the third value column (0.5, 2, -1) is
  // averaged with them: row 0 0.5, row 1 (0.5 + 2·2) / 3 = 1.5, row 2 (0.5 + 2 - 2) / 4 = 0.125.
  const ref::Result r = run_ok(dense_case(3), DenseParams{}, Call{});
  expect_rows(r, {1, 2, 0.5, 7.0 / 3, 0, 1.5, 0, 2.25, 0.125}, {std::log(2.0), std::log(3.0), std::log(8.0)});
}

// ---------------------------------------------------------------- policies under a window

// 16 rows over 16 keys, one head, d = 2, values on a grid (k_t = (t mod 5 - 2, 1) / 4, q_r =
// (1, (r mod 3) - 1) / 2, v_t = (t, 16 - t) / 8): inputs for checking outputs against the
// naive softmax under each policy's expanded decisions.
Inputs grid_case(std::int64_t n = 16) {
  Inputs in = test::empty_inputs({{n, n}}, 1, 1, 2, DType::kFP32);
  for (std::int64_t t = 0; t < n; ++t) {
    put(&in.seqs[0].q, t, 0, {0.5, static_cast<double>(t % 3 - 1) / 2});
    put(&in.seqs[0].k, t, 0, {static_cast<double>(t % 5 - 2) / 4, 0.25});
    put(&in.seqs[0].v, t, 0, {static_cast<double>(t) / 8, static_cast<double>(n - t) / 8});
  }
  return in;
}

TEST(ReferenceFeatures, BlockSparseUnderAWindowListsOnlyVisibleBlocks) {
  // Window left 5, blocks 4 x 4: query block 3 (rows 12..15) sees keys 7..15, blocks 1..3; block
  // 0 is not visible, so a mask listing it is refused; every visible block is dense attention
  // under the window.
  const Inputs in = grid_case();
  Call c;
  c.left = 5;
  test::LayoutOptions opt;
  opt.window_left = 5;
  const test::TestProblem tp = test::build_problem(in, opt);
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  BlockSparseParams all;
  all.mask = BlockMask::all_visible(shape, 4, 4, false);
  EXPECT_EQ(kept_blocks(all.mask, 0, 0, 3), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(all.mask.partial_count[3], 3);  // no block of query block 3 is full
  EXPECT_TRUE(same_result(run_ok(in, all, c), run_ok(in, DenseParams{}, c), kExact));
  BlockSparseParams bad;
  bad.mask = BlockMask::empty(shape, 4, 4, false);
  EXPECT_FALSE(bad.mask.add(shape, 0, 0, 3, 0).ok());
  std::vector<std::uint8_t> map(16, 0);
  map[3 * 4 + 0] = 1;
  const Status st = BlockMask::from_dense(shape, 4, 4, false, map, &bad.mask);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("not visible"), std::string::npos) << st.message();
}

TEST(ReferenceFeatures, ExactGateUnderAWindowGatesTheFullBlocksOnly) {
  // Window left 9: query block 3 (rows 12..15, seeing from keys 3..6) has partial blocks 0 and 1
  // (the window's edge), full block 2 and the diagonal block 3. A threshold of +inf skips every
  // gated block: only block 2 goes. Query block 2 (rows 8..11, from keys 0..2): block 0 partial,
  // block 1 full and skipped, block 2 the diagonal.
  const Inputs in = grid_case();
  Call c;
  c.left = 9;
  HostTensor table(DType::kFP32, {1, 1});
  test::set(&table, 0, kInf);
  ExactGateParams p;
  p.block_q = 4;
  p.block_k = 4;
  p.thresholds = table.view();
  const ref::Result r = run_ok(in, p, c);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 3), (std::vector<int>{0, 1, 3}));
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 2), (std::vector<int>{0, 2}));
  EXPECT_TRUE(same_result(r, naive(in, c, kept_keys(r.decisions)), kExact));
}

TEST(ReferenceFeatures, SoftmaxSkipUnderAWindowVisitsTheDiagonalBandFirst) {
  // 8 rows over 8 keys, blocks 4 x 4, window left 2, scale 1: query block 1 (rows 4..7) sees keys
  // 2..7 (row 4 from 2, row 5 from 3, rows 6, 7 from 4, 5): block 1 (the diagonal band) is
  // visited first and kept, then block 0 (the window's lower band, keys 2, 3). Keys 2, 3 score
  // -10 against q = (1, 0) and the others 5, so rows 4 and 5 see margins -15 < ln(1/8) in block 0
  // and rows 6, 7 see none of it: block 0 is skipped. Without the window block 0 would hold keys
  // 0, 1 too (scoring 5) and be kept.
  Inputs in = test::empty_inputs({{8, 8}}, 1, 1, 2, DType::kFP32);
  for (int t = 0; t < 8; ++t) {
    put(&in.seqs[0].q, t, 0, {1, 0});
    put(&in.seqs[0].k, t, 0, {t == 2 || t == 3 ? -10.0 : 5.0, 0});
    put(&in.seqs[0].v, t, 0, {static_cast<double>(t), 1});
  }
  SoftmaxSkipParams p;
  p.block_q = 4;
  p.block_k = 4;
  p.a = 1.0;  // λ = 1/8
  Call c;
  c.scale = 1.0;
  c.left = 2;
  const ref::Result r = run_ok(in, p, c);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 1), (std::vector<int>{1}));
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 0), (std::vector<int>{0}));
  EXPECT_TRUE(same_result(r, naive(in, c, kept_keys(r.decisions)), kExact));
  c.left = -1;
  EXPECT_EQ(kept_blocks(run_ok(in, p, c).decisions.kept, 0, 0, 1), (std::vector<int>{0, 1}));
}

// 20 rows over 20 keys, block 4: q = (1, 0) for every row, and key block j holds keys (x_j, 0)
// with x = (5, 0, 0, 1, 0): block 0 scores highest, block 3 next.
Inputs select_case() {
  Inputs in = test::empty_inputs({{20, 20}}, 1, 1, 2, DType::kFP32);
  const double x[5] = {5, 0, 0, 1, 0};
  for (int t = 0; t < 20; ++t) {
    put(&in.seqs[0].q, t, 0, {1, 0});
    put(&in.seqs[0].k, t, 0, {x[t / 4], 0});
    put(&in.seqs[0].v, t, 0, {static_cast<double>(t), 1});
  }
  return in;
}

EstimateSelectParams select_params(bool correction) {
  EstimateSelectParams p;
  p.block = 4;
  p.alpha = 0.5;
  p.sink = 1;
  p.window = 1;
  p.tail = 0;
  p.mean_correction = correction;
  return p;
}

TEST(ReferenceFeatures, EstimateSelectForcedBlocksOutsideTheWindowAreNotKept) {
  // Scale 1, window left 6: tile 4 (rows 16..19) sees keys 10..19 (row 16 from 10, row 19 from
  // 13), blocks 2..4. The sink block 0 is forced but hidden: not kept. Scored blocks 2..4:
  // block 2 has the contributing rows 16, 17 (x = 0), blocks 3 and 4 all four rows (x = 1 and
  // 0): M = 1, E = (2/e, 4, 4/e); alpha 0.5 keeps block 3; block 4 is the forced diagonal.
  const Inputs in = select_case();
  Call c;
  c.scale = 1.0;
  c.left = 6;
  const ref::Result r = run_ok(in, select_params(false), c);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 4), (std::vector<int>{3, 4}));
  EXPECT_TRUE(same_result(r, naive(in, c, kept_keys(r.decisions)), kExact));
  // Without the window block 0 (sink, and x = 5: the peak) is kept, and block 3 falls below
  // alpha · peak.
  c.left = -1;
  EXPECT_EQ(kept_blocks(run_ok(in, select_params(false), c).decisions.kept, 0, 0, 4), (std::vector<int>{0, 4}));
}

TEST(ReferenceFeatures, EstimateSelectCorrectsOnlyPrunedBlocksEveryRowSeesWhole) {
  // Window left 11: tile 4 sees keys 5..19 (row 16 from 5, row 19 from 8), blocks 1..4. Block 1
  // (4..7) has the contributing rows 16..18 (E = 3/e), block 2 (8..11) all four (4/e): both fall
  // below alpha · peak (the peak is block 3's 4) and are pruned. Block 2 is full for the tile and
  // is corrected; block 1 is partial (row 19 starts at key 8) and is not. Block 0 is hidden.
  const Inputs in = select_case();
  Call c;
  c.scale = 1.0;
  c.left = 11;
  const ref::Result r = run_ok(in, select_params(true), c);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 4), (std::vector<int>{3, 4}));
  EXPECT_EQ(kept_blocks(r.decisions.corrected, 0, 0, 4), (std::vector<int>{2}));
  // Block 2's keys are identical, so its pseudo-token is the block itself: the output equals
  // attention over blocks 2..4 under the window.
  const ref::Result want = naive(in, c, [](int, std::int64_t row, std::int64_t t) { return row < 16 || t >= 8; });
  for (std::size_t i = 16 * 2; i < r.o.size(); ++i) EXPECT_NEAR(r.o[i], want.o[i], 1e-12) << i;
  for (std::size_t i = 16; i < r.lse.size(); ++i) EXPECT_NEAR(r.lse[i], want.lse[i], 1e-12) << i;
}

TEST(ReferenceFeatures, PermuteStopRanksOnlyThePrecedingKeysTheSegmentSees) {
  // 16 rows over 16 keys, segments of 8, block_k 2, window left 3: segment 1 (rows 8..15) ranks
  // the keys its first row sees before it, 5..7: 3 keys, 2 chunks; without the window all 8
  // preceding keys, 4 chunks. With tau 0 every chunk is visited and the output is dense
  // attention under the window.
  const Inputs in = grid_case();
  PermuteStopParams p;
  p.segment = 8;
  p.tau = 0.0;
  p.block_q = 4;
  p.block_k = 2;
  Call c;
  c.left = 3;
  const ref::Result r = run_ok(in, p, c);
  ASSERT_EQ(r.decisions.tiles.size(), 4u);  // two tiles per segment
  for (const PermuteTile& t : r.decisions.tiles) {
    EXPECT_EQ(t.chunks_total, t.segment == 0 ? 0 : 2) << "segment " << t.segment;
    EXPECT_EQ(t.chunks_visited, t.chunks_total);
  }
  EXPECT_TRUE(same_result(r, naive(in, c, kAll), kExact));
  c.left = -1;
  for (const PermuteTile& t : run_ok(in, p, c).decisions.tiles) EXPECT_EQ(t.chunks_total, t.segment == 0 ? 0 : 4);
}

}  // namespace
}  // namespace sparseprefill
