// SPDX-License-Identifier: Apache-2.0
// The fp64 oracle on hand-computed cases: one tiny case per policy (4-token blocks, d = 2,
// values on a grid, fp32 so the inputs are exact) whose decisions and outputs are worked out
// in the comments, plus the decision rules' edge cases (ties, threshold rows, visit order,
// forced blocks, mean-correction eligibility, early stop, tie-breaking).
#include <cmath>
#include <initializer_list>
#include <vector>

#include <gtest/gtest.h>

#include "common/inputs.h"
#include "common/naive.h"
#include "reference/reference.h"
#include "common/results.h"
#include "sparseprefill/attention.h"

namespace sparseprefill {
namespace {

using test::Inputs;
using test::kept_blocks;
using test::kLn2;
using test::put;
using test::same_result;
using test::kInf;
using test::kExact;

// One fp32 sequence of hand-written values.
Inputs hand_inputs(std::int64_t s_q, std::int64_t s_k, int h_q = 1, int h_kv = 1) {
  return test::empty_inputs({{s_q, s_k}}, h_q, h_kv, 2, DType::kFP32);
}

ref::Result run_ok(const Inputs& in, const Policy& policy, double scale, bool causal = true) {
  test::LayoutOptions opt;
  opt.scale = scale;
  opt.causal = causal;
  const test::TestProblem tp = test::build_problem(in, opt);
  ref::Result r;
  const Status st = ref::run_reference(tp.problem(), policy, &r);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return r;
}

// Causal keys of the single sequence of `in`, further restricted by keep(r, t).
template <class F>
ref::Result naive(const Inputs& in, double scale, F keep, bool causal = true) {
  return test::masked_softmax(in, scale, [&](int, int h, std::int64_t r, std::int64_t t) {
    return (!causal || test::causally_visible(in.s_q(0), in.s_k(0), r, t)) && keep(h, r, t);
  });
}

// Thresholds fp32 [h_q, positions].
HostTensor thresholds(std::initializer_list<double> row) {
  HostTensor t(DType::kFP32, {1, static_cast<std::int64_t>(row.size())});
  std::int64_t i = 0;
  for (double x : row) test::set(&t, i++, x);
  return t;
}

// ---------------------------------------------------------------- dense

// q0 = (1,0), q1 = (0,1), q2 = (1,1); k0 = (1,0), k1 = (0,1), k2 = (1,1);
// v0 = (1,2), v1 = (3,-1), v2 = (-2,4); scale ln 2, so each weight is 2^(q·k).
Inputs dense_case() {
  Inputs in = hand_inputs(3, 3);
  test::SequenceData& s = in.seqs[0];
  put(&s.q, 0, 0, {1, 0});
  put(&s.q, 1, 0, {0, 1});
  put(&s.q, 2, 0, {1, 1});
  put(&s.k, 0, 0, {1, 0});
  put(&s.k, 1, 0, {0, 1});
  put(&s.k, 2, 0, {1, 1});
  put(&s.v, 0, 0, {1, 2});
  put(&s.v, 1, 0, {3, -1});
  put(&s.v, 2, 0, {-2, 4});
  return in;
}

TEST(ReferenceHand, DenseCausal) {
  const ref::Result r = run_ok(dense_case(), DenseParams{}, kLn2);
  // Row 0 sees k0: q·k = 1, O = v0, LSE = ln 2.
  // Row 1 sees k0, k1: q·k = 0, 1, weights 1, 2: O = (v0 + 2 v1) / 3 = (7/3, 0), LSE = ln 3.
  // Row 2 sees all: q·k = 1, 1, 2, weights 2, 2, 4: O = (v0 + v1 + 2 v2) / 4 = (0, 9/4), LSE = ln 8.
  const std::vector<double> o = {1, 2, 7.0 / 3, 0, 0, 2.25};
  const std::vector<double> lse = {std::log(2.0), std::log(3.0), std::log(8.0)};
  for (std::size_t i = 0; i < o.size(); ++i) EXPECT_NEAR(r.o[i], o[i], kExact) << i;
  for (std::size_t i = 0; i < lse.size(); ++i) EXPECT_NEAR(r.lse[i], lse[i], kExact) << i;
  EXPECT_EQ(r.decisions.policy, "dense");
}

TEST(ReferenceHand, DenseNonCausal) {
  const ref::Result r = run_ok(dense_case(), DenseParams{}, kLn2, /*causal=*/false);
  // Row 0 sees all: q·k = 1, 0, 1, weights 2, 1, 2: O = (2 v0 + v1 + 2 v2) / 5 = (0.2, 2.2), LSE = ln 5.
  EXPECT_NEAR(r.o[0], 0.2, kExact);
  EXPECT_NEAR(r.o[1], 2.2, kExact);
  EXPECT_NEAR(r.lse[0], std::log(5.0), kExact);
}

TEST(ReferenceHand, DenseChunkSeesThePrefix) {
  // The last two queries of dense_case as a chunk over all three keys (s_q = 2 < s_k = 3):
  // bottom-right alignment puts them at positions 1 and 2, so they are rows 1 and 2 above.
  const Inputs full = dense_case();
  Inputs chunk = hand_inputs(2, 3);
  chunk.seqs[0].k = full.seqs[0].k;
  chunk.seqs[0].v = full.seqs[0].v;
  put(&chunk.seqs[0].q, 0, 0, {0, 1});
  put(&chunk.seqs[0].q, 1, 0, {1, 1});
  const ref::Result r = run_ok(chunk, DenseParams{}, kLn2);
  EXPECT_NEAR(r.o[0], 7.0 / 3, kExact);
  EXPECT_NEAR(r.o[3], 2.25, kExact);
  EXPECT_NEAR(r.lse[1], std::log(8.0), kExact);
}

TEST(ReferenceHand, MoreQueriesThanKeysLeaveEmptyRows) {
  // s_q = 4 > s_k = 2: rows 0 and 1 sit at negative positions and see nothing.
  Inputs in = hand_inputs(4, 2);
  for (int r = 0; r < 4; ++r) put(&in.seqs[0].q, r, 0, {0.5, 0.25});
  put(&in.seqs[0].k, 0, 0, {1, 1});
  put(&in.seqs[0].k, 1, 0, {1, 1});
  put(&in.seqs[0].v, 0, 0, {1, 3});
  put(&in.seqs[0].v, 1, 0, {3, 5});
  const ref::Result r = run_ok(in, DenseParams{}, 1.0);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(r.o[static_cast<std::size_t>(i)], 0.0);
  EXPECT_EQ(r.lse[0], -kInf);
  EXPECT_EQ(r.lse[1], -kInf);
  // Row 2 sees k0: O = v0, LSE = 0.75. Row 3 sees both (equal scores): O = (2, 4), LSE = 0.75 + ln 2.
  EXPECT_NEAR(r.o[4], 1, kExact);
  EXPECT_NEAR(r.lse[2], 0.75, kExact);
  EXPECT_NEAR(r.o[6], 2, kExact);
  EXPECT_NEAR(r.o[7], 4, kExact);
  EXPECT_NEAR(r.lse[3], 0.75 + std::log(2.0), kExact);
}

// ---------------------------------------------------------------- block_sparse

TEST(ReferenceHand, BlockSparsePerKvHeadMask) {
  // s = 8, 4x4 blocks, h_q = 2 sharing one KV head. Every key is (1, 0) so every score of
  // head h is the constant q_x: O is the mean of V over the keys read, LSE = q_x + ln(count).
  // v_t = (t/8, -t/4). The per-KV-head mask selects nothing for query block 0 and only the
  // diagonal block 1 for query block 1, for both query heads.
  Inputs in = hand_inputs(8, 8, 2, 1);
  for (int t = 0; t < 8; ++t) {
    put(&in.seqs[0].k, t, 0, {1, 0});
    put(&in.seqs[0].v, t, 0, {t / 8.0, -t / 4.0});
    put(&in.seqs[0].q, t, 0, {0.25, t / 8.0});
    put(&in.seqs[0].q, t, 1, {0.5, -t / 8.0});
  }
  const test::TestProblem tp = test::build_problem(in, {test::Layout::kBatched, 16, 7, true, 1.0});
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  BlockSparseParams p;
  p.mask = BlockMask::empty(shape, 4, 4, /*per_kv_head=*/true);
  ASSERT_TRUE(p.mask.add(shape, 0, 0, 1, 1).ok());
  ref::Result r;
  ASSERT_TRUE(ref::run_reference(tp.problem(), p, &r).ok());
  // [rows, h_q, d] and [h_q, rows].
  const auto o = [&](int row, int h, int i) { return r.o[static_cast<std::size_t>((row * 2 + h) * 2 + i)]; };
  const auto lse = [&](int row, int h) { return r.lse[static_cast<std::size_t>(h * 8 + row)]; };
  for (int row = 0; row < 4; ++row) {
    for (int h = 0; h < 2; ++h) {
      EXPECT_EQ(o(row, h, 0), 0.0);
      EXPECT_EQ(lse(row, h), -kInf);
    }
  }
  // Row 4 reads k4: O = v4 = (0.5, -1). Row 5 reads k4, k5: O = (9/16, -9/8).
  // Row 7 reads k4..k7: O = (22/32, -22/16).
  for (int h = 0; h < 2; ++h) {
    const double qx = h == 0 ? 0.25 : 0.5;
    EXPECT_NEAR(o(4, h, 0), 0.5, kExact);
    EXPECT_NEAR(o(4, h, 1), -1.0, kExact);
    EXPECT_NEAR(lse(4, h), qx, kExact);
    EXPECT_NEAR(o(5, h, 0), 9.0 / 16, kExact);
    EXPECT_NEAR(o(5, h, 1), -9.0 / 8, kExact);
    EXPECT_NEAR(lse(5, h), qx + std::log(2.0), kExact);
    EXPECT_NEAR(o(7, h, 0), 22.0 / 32, kExact);
    EXPECT_NEAR(o(7, h, 1), -22.0 / 16, kExact);
    EXPECT_NEAR(lse(7, h), qx + std::log(4.0), kExact);
  }
  EXPECT_TRUE(r.decisions.kept.per_kv_head);
  EXPECT_EQ(r.decisions.kept.selected_blocks(), 1);
}

// ---------------------------------------------------------------- exact_gate

// s = 8, 4x4 blocks, scale 1. The only full block is (query block 1, key block 0). Rows 4..7
// have q = (1, 0), (1/2, 0), (1/4, 0), (1/8, 0); keys 0..3 have x = 1, 1/2, -1, 0, so the
// block's maximum is q4·k0 = 1.
Inputs gate_case(std::int64_t s_q = 8) {
  Inputs in = hand_inputs(s_q, 8);
  test::SequenceData& s = in.seqs[0];
  const std::int64_t first = 8 - s_q;  // position of row 0
  const double qx[8] = {0.5, 0.25, 0.75, 0.5, 1, 0.5, 0.25, 0.125};
  for (std::int64_t r = 0; r < s_q; ++r) put(&s.q, r, 0, {qx[first + r], first + r < 4 ? 0.5 : 0.0});
  const double kx[8] = {1, 0.5, -1, 0, 0.5, -0.5, 0.25, 0.75};
  for (int t = 0; t < 8; ++t) {
    put(&s.k, t, 0, {kx[t], t / 8.0});
    put(&s.v, t, 0, {1 + t / 8.0, (t % 3) / 4.0});
  }
  return in;
}

ExactGateParams gate(const HostTensor& table) {
  ExactGateParams p;
  p.block_q = 4;
  p.block_k = 4;
  p.thresholds = table.view();
  return p;
}

TEST(ReferenceHand, ExactGateKeepsAtTheThresholdAndSkipsAbove) {
  const Inputs in = gate_case();
  const auto skip_block0 = [](int, std::int64_t r, std::int64_t t) { return r < 4 || t >= 4; };
  const auto keep_all = [](int, std::int64_t, std::int64_t) { return true; };
  // T = 1 equals the maximum: ties keep. T = 1 + 1/8: skipped. T = -inf: kept.
  // (Position 0 is never read here: query block 0 has no full block.)
  for (const double t : {1.0, 1.125, -kInf}) {
    const HostTensor table = thresholds({1e30, t});
    const ref::Result r = run_ok(in, gate(table), 1.0);
    const bool kept = t != 1.125;
    EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 0), std::vector<int>({0}));
    EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 1), kept ? std::vector<int>({0, 1}) : std::vector<int>({1}));
    EXPECT_TRUE(same_result(r, kept ? naive(in, 1.0, keep_all) : naive(in, 1.0, skip_block0), kExact)) << t;
  }
}

TEST(ReferenceHand, ExactGateClampsToTheTablesLastRow) {
  // One position only: query block 1 reads T[0][0] = 1.125 and skips.
  const Inputs in = gate_case();
  const HostTensor table = thresholds({1.125});
  const ref::Result r = run_ok(in, gate(table), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 1), std::vector<int>({1}));
}

TEST(ReferenceHand, ExactGateReadsTheAbsolutePositionInAChunk) {
  // The last 4 queries as a chunk (s_q = 4, s_k = 8): the chunk's query block 0 sits at
  // absolute query block floor((0 + 8 - 4) / 4) = 1, so it reads T[0][1] = 1.125 and skips
  // key block 0. Reading the call-relative row T[0][0] = -inf would keep it.
  const Inputs in = gate_case(4);
  const HostTensor table = thresholds({-kInf, 1.125});
  const ref::Result r = run_ok(in, gate(table), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 0), std::vector<int>({1}));
  EXPECT_TRUE(same_result(r, naive(in, 1.0, [](int, std::int64_t, std::int64_t t) { return t >= 4; }), kExact));
}

TEST(ReferenceHand, ExactGateNaNMaximumKeeps) {
  // A NaN key in the full block makes its maximum NaN: kept, whatever T.
  Inputs in = gate_case();
  put(&in.seqs[0].k, 2, 0, {std::nan(""), 0});
  const HostTensor table = thresholds({1e30, 1e30});
  const ref::Result r = run_ok(in, gate(table), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 1), std::vector<int>({0, 1}));
  // Rows 2..7 read k2 and are NaN; rows 0 and 1 do not and stay finite.
  EXPECT_TRUE(std::isfinite(r.o[0]) && std::isfinite(r.o[2]) && std::isfinite(r.lse[1]));
  for (int row = 2; row < 8; ++row) EXPECT_TRUE(std::isnan(r.lse[static_cast<std::size_t>(row)])) << row;
}

TEST(ReferenceHand, ExactGateNonCausalAlwaysComputesTheLastKeyBlock) {
  // Non-causal, s_q = 4, s_k = 8: both key blocks are full; block 1 (the last) is always
  // computed, block 0 is gated (its max over rows at q = (1,0)..(1/8,0) is 1 < T = 100).
  const Inputs in = gate_case(4);
  const HostTensor table = thresholds({100, 100});
  const ref::Result r = run_ok(in, gate(table), 1.0, /*causal=*/false);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 0), std::vector<int>({1}));
  EXPECT_TRUE(same_result(r, naive(in, 1.0, [](int, std::int64_t, std::int64_t t) { return t >= 4; }, false), kExact));
}

// ---------------------------------------------------------------- softmax_skip

// s = 12, 4x4 blocks, scale 1, ln λ = ln(a / 12) = -2. Rows 8..11 have q = (1, 0). Key x
// values are constant per block: block 0: 5, block 1: kx1, block 2: 0. Query block 2 visits
// block 2 (partial), then 1, then 0 (full, descending).
Inputs skip_case(double kx1) {
  Inputs in = hand_inputs(12, 12);
  test::SequenceData& s = in.seqs[0];
  const double kx[3] = {5, kx1, 0};
  for (int t = 0; t < 12; ++t) {
    put(&s.q, t, 0, {t < 8 ? 0.125 : 1.0, 0});
    put(&s.k, t, 0, {kx[t / 4], 0.5});
    put(&s.v, t, 0, {t / 4.0, 1 - t / 8.0});
  }
  return in;
}

SoftmaxSkipParams skip_params(double a) {
  SoftmaxSkipParams p;
  p.block_q = 4;
  p.block_k = 4;
  p.a = a;
  return p;
}

const double kSkipA = 12 * std::exp(-2.0);

TEST(ReferenceHand, SoftmaxSkipVisitOrderIsPartialThenDescending) {
  // kx1 = -1.5. Our order 2, 1, 0: after block 2 the running max is 0; block 1 has
  // -1.5 - 0 >= -2 and is kept; block 0 (5) is kept. All three kept.
  // Ascending full blocks (2, 0, 1) would see block 1 after block 0: -1.5 - 5 < -2, skipped;
  // full blocks before partial ones (0, 1, 2) would also skip block 2 (0 - 5 < -2).
  const Inputs in = skip_case(-1.5);
  const ref::Result r = run_ok(in, skip_params(kSkipA), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 2), std::vector<int>({0, 1, 2}));
}

TEST(ReferenceHand, SoftmaxSkipSkipsWhenEveryRowSkips) {
  // kx1 = -2.5: -2.5 - 0 < -2 for every row of query block 2: block 1 skipped.
  const Inputs in = skip_case(-2.5);
  const ref::Result r = run_ok(in, skip_params(kSkipA), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 2), std::vector<int>({0, 2}));
  EXPECT_TRUE(same_result(r, naive(in, 1.0, [](int, std::int64_t row, std::int64_t t) {
    return row < 8 || t < 4 || t >= 8;
  }), kExact));
}

TEST(ReferenceHand, SoftmaxSkipOneRowThatDoesNotSkipKeepsTheBlock) {
  // As above, but row 9 has q = (1, 1) and block 1's keys have y = 2 (blocks 0 and 2 keep
  // y = 0): row 9 scores -2.5 + 2 = -0.5 on block 1 against a running max of 0: not skipped.
  Inputs in = skip_case(-2.5);
  for (int t = 0; t < 12; ++t) put(&in.seqs[0].k, t, 0, {t < 4 ? 5.0 : t < 8 ? -2.5 : 0.0, t >= 4 && t < 8 ? 2.0 : 0.0});
  put(&in.seqs[0].q, 9, 0, {1, 1});
  const ref::Result r = run_ok(in, skip_params(kSkipA), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 2), std::vector<int>({0, 1, 2}));
}

TEST(ReferenceHand, SoftmaxSkipIsOffWhenTheSequenceIsShorterThanA) {
  // a = 13 > s_k = 12: λ > 1, skipping off; block 1 (-2.5) is kept.
  const Inputs in = skip_case(-2.5);
  const ref::Result r = run_ok(in, skip_params(13), 1.0);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 2), std::vector<int>({0, 1, 2}));
}

// ---------------------------------------------------------------- estimate_select

// s = 16, B = 4, scale ln 2, q = (1, 0) for every row. All keys of block j are (c_j, y) with
// c = (-1, -3, 1, 0), so x[r, j] = c_j ln 2 and E_j = 4 · 2^(c_j - max c).
// v_t = ((t + 1)/8, -t/16): block means are exact in fp32.
Inputs select_case(std::initializer_list<double> c = {-1, -3, 1, 0}) {
  Inputs in = hand_inputs(16, 16);
  test::SequenceData& s = in.seqs[0];
  const std::vector<double> cs(c);
  for (int t = 0; t < 16; ++t) {
    put(&s.q, t, 0, {1, 0});
    put(&s.k, t, 0, {cs[static_cast<std::size_t>(t / 4)], (t % 4) / 8.0});
    put(&s.v, t, 0, {(t + 1) / 8.0, -t / 16.0});
  }
  return in;
}

EstimateSelectParams select_params(double alpha, int sink, int window, int tail) {
  EstimateSelectParams p;
  p.block = 4;
  p.alpha = alpha;
  p.sink = sink;
  p.window = window;
  p.tail = tail;
  return p;
}

std::vector<std::vector<int>> tiles_of(const BlockMask& m, int h = 0) {
  std::vector<std::vector<int>> out;
  for (int qb = 0; qb < m.num_q_blocks; ++qb) out.push_back(kept_blocks(m, 0, h, qb));
  return out;
}

TEST(ReferenceHand, EstimateSelectEnergyRule) {
  // alpha = 0.3, sink 0, window 1, tail 0.
  // Tile 0 (positions 0..3): A = 1, E = (4) -> {0}.
  // Tile 1 (4..7): A = 2, c = (-1, -3): E = (4, 1), threshold 1.2 -> {0}; window adds 1.
  // Tile 2 (8..11): A = 3, c = (-1, -3, 1): E = (1, 1/4, 4), threshold 1.2 -> {2}.
  // Tile 3 (12..15): A = 4: E = (1, 1/4, 4, 2) -> {2, 3}.
  const Inputs in = select_case();
  const ref::Result r = run_ok(in, select_params(0.3, 0, 1, 0), kLn2);
  EXPECT_EQ(tiles_of(r.decisions.kept), (std::vector<std::vector<int>>{{0}, {0, 1}, {2}, {2, 3}}));
  EXPECT_EQ(r.decisions.corrected.selected_blocks(), 0);
  // The output is the softmax over exactly those blocks.
  const std::vector<std::vector<int>> kept = {{0}, {0, 1}, {2}, {2, 3}};
  EXPECT_TRUE(same_result(r, naive(in, kLn2, [&](int, std::int64_t row, std::int64_t t) {
    for (int j : kept[static_cast<std::size_t>(row / 4)]) if (t / 4 == j) return true;
    return false;
  }), kExact));
}

TEST(ReferenceHand, EstimateSelectForcedBlocks) {
  const Inputs in = select_case();
  using Tiles = std::vector<std::vector<int>>;
  // sink = 1 adds block 0 everywhere.
  EXPECT_EQ(tiles_of(run_ok(in, select_params(0.3, 1, 1, 0), kLn2).decisions.kept),
            (Tiles{{0}, {0, 1}, {0, 2}, {0, 2, 3}}));
  // sink = 3 never reaches past the tile's last block: j <= lqb.
  EXPECT_EQ(tiles_of(run_ok(in, select_params(0.3, 3, 1, 0), kLn2).decisions.kept),
            (Tiles{{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}}));
  // window = 3 keeps fqb - 2 .. lqb.
  EXPECT_EQ(tiles_of(run_ok(in, select_params(0.3, 0, 3, 0), kLn2).decisions.kept),
            (Tiles{{0}, {0, 1}, {0, 1, 2}, {1, 2, 3}}));
  // tail = 1: the call's last tile keeps every visible block; tail = 2: the last two.
  EXPECT_EQ(tiles_of(run_ok(in, select_params(0.3, 0, 1, 1), kLn2).decisions.kept),
            (Tiles{{0}, {0, 1}, {2}, {0, 1, 2, 3}}));
  EXPECT_EQ(tiles_of(run_ok(in, select_params(0.3, 0, 1, 2), kLn2).decisions.kept),
            (Tiles{{0}, {0, 1}, {0, 1, 2}, {0, 1, 2, 3}}));
  // window = 0: nothing forced but j in (fqb, lqb], empty for these aligned tiles; the energy
  // rule alone: tile 1 loses block 1.
  EXPECT_EQ(tiles_of(run_ok(in, select_params(0.3, 0, 0, 0), kLn2).decisions.kept),
            (Tiles{{0}, {0}, {2}, {2, 3}}));
}

TEST(ReferenceHand, EstimateSelectEnergyTiesKeep) {
  // c = (1, -3, 1, 0), alpha = 1: in tile 3, E_0 and E_2 are both exactly 4 · e^0 = max E.
  const Inputs in = select_case({1, -3, 1, 0});
  const ref::Result r = run_ok(in, select_params(1.0, 0, 1, 0), kLn2);
  EXPECT_EQ(kept_blocks(r.decisions.kept, 0, 0, 3), std::vector<int>({0, 2, 3}));
}

TEST(ReferenceHand, EstimateSelectNaNEnergyKeepsOnlyForcedBlocks) {
  // A NaN in one query of tile 3 makes the tile's maximum, energies and peak NaN: E_j >=
  // alpha · peak fails for every j and only the window block 3 remains (it was {2, 3}).
  Inputs in = select_case();
  put(&in.seqs[0].q, 13, 0, {std::nan(""), 0});
  const ref::Result r = run_ok(in, select_params(0.3, 0, 1, 0), kLn2);
  EXPECT_EQ(tiles_of(r.decisions.kept), (std::vector<std::vector<int>>{{0}, {0, 1}, {2}, {3}}));
  EXPECT_TRUE(std::isnan(r.lse[13]));
  EXPECT_TRUE(std::isfinite(r.lse[12]) && std::isfinite(r.lse[14]));
}

TEST(ReferenceHand, EstimateSelectMeanCorrectionOfUniformBlocksIsExact) {
  // Same selection as EstimateSelectEnergyRule. Tiles 2 and 3 prune blocks 0 and 1, wholly
  // seen by their first rows (positions 8, 12): both corrected. Every key of a block scores
  // the same for a row, so n_j e^{s̄} v̄_j equals the block's exact contribution: the
  // corrected output equals dense attention.
  const Inputs in = select_case();
  EstimateSelectParams p = select_params(0.3, 0, 1, 0);
  p.mean_correction = true;
  const ref::Result r = run_ok(in, p, kLn2);
  EXPECT_EQ(tiles_of(r.decisions.corrected), (std::vector<std::vector<int>>{{}, {}, {0, 1}, {0, 1}}));
  EXPECT_TRUE(same_result(r, run_ok(in, DenseParams{}, kLn2), kExact));
}

// A chunk of 4 queries (B = 4) over s_k keys; blocks 0 and 1 have uniform keys with
// c = (1, -3) so the energy rule keeps block 0 and prunes block 1 (alpha = 0.3).
Inputs boundary_case(std::int64_t s_k) {
  Inputs in = hand_inputs(4, s_k);
  test::SequenceData& s = in.seqs[0];
  for (int r = 0; r < 4; ++r) put(&s.q, r, 0, {1, 0});
  for (std::int64_t t = 0; t < s_k; ++t) {
    put(&s.k, t, 0, {t < 4 ? 1.0 : t < 8 ? -3.0 : 0.25, 0.5});
    put(&s.v, t, 0, {t / 8.0, 0.25});
  }
  return in;
}

TEST(ReferenceHand, EstimateSelectMeanCorrectionEligibilityBoundary) {
  EstimateSelectParams p = select_params(0.3, 0, 0, 0);
  p.mean_correction = true;
  // s_k = 11: rows at positions 7..10, fqb = 1, lqb = 2, A = 2. Kept: block 0 (energy) and 2
  // (window 0 still forces (fqb, lqb]). Block 1's last key 7 is seen by the first row
  // (position 7): corrected.
  const ref::Result at = run_ok(boundary_case(11), p, kLn2);
  EXPECT_EQ(kept_blocks(at.decisions.kept, 0, 0, 0), std::vector<int>({0, 2}));
  EXPECT_EQ(kept_blocks(at.decisions.corrected, 0, 0, 0), std::vector<int>({1}));
  // s_k = 10: positions 6..9; key 7 is not seen by the first row: not corrected.
  const ref::Result before = run_ok(boundary_case(10), p, kLn2);
  EXPECT_EQ(kept_blocks(before.decisions.kept, 0, 0, 0), std::vector<int>({0, 2}));
  EXPECT_EQ(before.decisions.corrected.selected_blocks(), 0);
}

TEST(ReferenceHand, EstimateSelectPackGqaSharesOneSelection) {
  // s = 12, h_q = 2 over one KV head. Block means: k̄0 = (2, 0), k̄1 = (0, 2), k̄2 = (-1, -1).
  // Head 0 has q = (1, 0), head 1 q = (0, 1). alpha = 0.5, window 1. In tile 2:
  //   per head: head 0 E = 4 · (1, 1/4, 1/8) -> {0}; head 1 -> {1}; window adds 2.
  //   packed: M = 2 ln 2 over both heads, E = (4 + 1, 1 + 4, 1/2 + 1/2) = (5, 5, 1),
  //   threshold 2.5 -> {0, 1}, plus 2.
  Inputs in = hand_inputs(12, 12, 2, 1);
  test::SequenceData& s = in.seqs[0];
  const double kx[3] = {2, 0, -1}, ky[3] = {0, 2, -1};
  for (int t = 0; t < 12; ++t) {
    put(&s.q, t, 0, {1, 0});
    put(&s.q, t, 1, {0, 1});
    put(&s.k, t, 0, {kx[t / 4], ky[t / 4]});
    put(&s.v, t, 0, {t / 8.0, 1.0});
  }
  EstimateSelectParams p = select_params(0.5, 0, 1, 0);
  const ref::Result per_head = run_ok(in, p, kLn2);
  EXPECT_FALSE(per_head.decisions.kept.per_kv_head);
  EXPECT_EQ(kept_blocks(per_head.decisions.kept, 0, 0, 2), std::vector<int>({0, 2}));
  EXPECT_EQ(kept_blocks(per_head.decisions.kept, 0, 1, 2), std::vector<int>({1, 2}));
  p.pack_gqa = true;
  const ref::Result packed = run_ok(in, p, kLn2);
  EXPECT_TRUE(packed.decisions.kept.per_kv_head);
  EXPECT_EQ(packed.decisions.kept.heads, 1);
  EXPECT_EQ(kept_blocks(packed.decisions.kept, 0, 0, 2), std::vector<int>({0, 1, 2}));
}

// ---------------------------------------------------------------- permute_stop

// s = 8, segment 4, block_q = block_k = 2, scale ln 2. Segment 0 (rows 0..3) has no prefix.
// Segment 1 (rows 4..7): q4 = (1,0), q5 = (0,2), q6 = (1,0), q7 = (2,0), so q̄ = (1, 1/2).
// Prefix keys k0 = (0,1), k1 = (2,0), k2 = (1,0), k3 = (2,0): q̄·k = 1/2, 2, 1, 2, ranked
// 1, 3 (tie: lower index first), 2, 0. u = (k1 + k3)/2 = (2, 0): q·u = 2, 0, 2, 4, so the
// order is 7, 4, 6, 5 (rows 4 and 6 tie: lower first). Tiles {7, 4} and {6, 5}.
// Segment keys k4..k7 = (0, -1).
Inputs permute_case() {
  Inputs in = hand_inputs(8, 8);
  test::SequenceData& s = in.seqs[0];
  const double q[8][2] = {{0.5, 0.25}, {0.25, 0.5}, {-0.5, 0.25}, {0.75, -0.25}, {1, 0}, {0, 2}, {1, 0}, {2, 0}};
  const double k[8][2] = {{0, 1}, {2, 0}, {1, 0}, {2, 0}, {0, -1}, {0, -1}, {0, -1}, {0, -1}};
  for (int t = 0; t < 8; ++t) {
    put(&s.q, t, 0, {q[t][0], q[t][1]});
    put(&s.k, t, 0, {k[t][0], k[t][1]});
    put(&s.v, t, 0, {t / 4.0, 2 - t / 8.0});
  }
  return in;
}

PermuteStopParams permute_params(double tau, int block_k = 2) {
  PermuteStopParams p;
  p.segment = 4;
  p.tau = tau;
  p.block_q = 2;
  p.block_k = block_k;
  return p;
}

std::vector<int> visited(const Decisions& d) {
  std::vector<int> out;
  for (const PermuteTile& t : d.tiles) out.push_back(t.chunks_visited);
  return out;
}

TEST(ReferenceHand, PermuteStopOrdersAndStopRule) {
  // Tile {7, 4}: pass 1 gives (m, l) = (0, 4) for row 7 and (0, 1) for row 4. Chunk {k1, k3}:
  //   row 7 scores 4 ln 2 twice: Δl = 2, l' = 4 · 2^-4 + 2 = 2.25, gain 8/9;
  //   row 4 scores 2 ln 2 twice: Δl = 2, l' = 1 · 2^-2 + 2 = 2.25, gain 8/9.
  // Tile {6, 5}: row 6 has (0, 3), row 5 (-2 ln 2, 2). Chunk {k1, k3}:
  //   row 6: Δl = 2, l' = 3/4 + 2, gain 8/11; row 5 scores 0: Δl = 2, l' = 1/2 + 2, gain 0.8.
  // tau = 0.85: tile {7, 4} continues (8/9 >= tau) and visits both chunks; tile {6, 5} stops
  // after the first (0.8 < tau).
  const Inputs in = permute_case();
  const ref::Result r = run_ok(in, permute_params(0.85), kLn2);
  EXPECT_EQ(r.decisions.query_order, (std::vector<std::int32_t>{0, 1, 2, 3, 7, 4, 6, 5}));
  ASSERT_EQ(r.decisions.tiles.size(), 4u);
  EXPECT_EQ(r.decisions.tiles[2].segment, 1);
  EXPECT_EQ(r.decisions.tiles[2].tile, 0);
  EXPECT_EQ(r.decisions.tiles[3].tile, 1);
  EXPECT_EQ(r.decisions.tiles[0].chunks_total, 0);
  EXPECT_EQ(r.decisions.tiles[2].chunks_total, 2);
  EXPECT_EQ(visited(r.decisions), (std::vector<int>{0, 0, 2, 1}));
  // Rows 0..3: causal inside segment 0. Rows 7, 4: segment keys plus the whole prefix.
  // Rows 6, 5: segment keys plus the first chunk {1, 3}.
  EXPECT_TRUE(same_result(r, naive(in, kLn2, [](int, std::int64_t row, std::int64_t t) {
    if (row < 4 || t >= 4) return t >= (row / 4) * 4;
    return row == 4 || row == 7 || t == 1 || t == 3;
  }), kExact));
  // tau = 0.95 stops both tiles after one chunk; tau = 0.5 and 0 visit everything.
  EXPECT_EQ(visited(run_ok(in, permute_params(0.95), kLn2).decisions), (std::vector<int>{0, 0, 1, 1}));
  EXPECT_EQ(visited(run_ok(in, permute_params(0.5), kLn2).decisions), (std::vector<int>{0, 0, 2, 2}));
  EXPECT_EQ(visited(run_ok(in, permute_params(0.0), kLn2).decisions), (std::vector<int>{0, 0, 2, 2}));
}

TEST(ReferenceHand, PermuteStopRankingTiesGoToTheLowerKey) {
  // k3 = (1, 2) now ties k1 = (2, 0) on q̄·k = 2 with a different vector. With block_k = 1,
  // u is the single top key: k1 (lower index) gives q·u = 2, 0, 2, 4 and the order 7, 4, 6, 5;
  // k3 would give q·u = 1, 4, 1, 2 and the order 5, 7, 4, 6.
  Inputs in = permute_case();
  put(&in.seqs[0].k, 3, 0, {1, 2});
  const ref::Result r = run_ok(in, permute_params(0.0, 1), kLn2);
  EXPECT_EQ(r.decisions.query_order, (std::vector<std::int32_t>{0, 1, 2, 3, 7, 4, 6, 5}));
  EXPECT_EQ(visited(r.decisions), (std::vector<int>{0, 0, 4, 4}));
}

TEST(ReferenceHand, PermuteStopGainEqualToTauContinues) {
  // s = 4, segment 2, one-row tiles, one-key chunks, every score equal (identical keys, so the
  // ranking is by index). Row 2: pass 1 reads key 2 (l = 1); chunk {0} adds Δl = 1, l' = 2:
  // gain exactly 1/2 = tau, not below it, so chunk {1} is visited too (gain 1/3). Row 3: pass 1
  // reads keys 2, 3 (l = 2); chunk {0} has gain 1/3 < tau: stop after one chunk.
  Inputs in = hand_inputs(4, 4);
  for (int t = 0; t < 4; ++t) {
    put(&in.seqs[0].q, t, 0, {0.5, 0.5});
    put(&in.seqs[0].k, t, 0, {1, -1});
    put(&in.seqs[0].v, t, 0, {t / 2.0, 1});
  }
  PermuteStopParams p = permute_params(0.5, 1);
  p.segment = 2;
  p.block_q = 1;
  const ref::Result r = run_ok(in, p, 1.0);
  EXPECT_EQ(visited(r.decisions), (std::vector<int>{0, 0, 2, 1}));
}

TEST(ReferenceHand, PermuteStopNaNKeysRankLast) {
  // k1 = NaN: q̄·k1 is NaN and ranks after every number: 3, 2, 0, 1. With one-key chunks the
  // first chunk is {k3} (u = k3 = (2, 0), the same row order 7, 4, 6, 5); its gains are
  // 0.8, 0.8, 4/7, 2/3 < tau = 0.95, so every tile stops there and no row reads k1.
  Inputs in = permute_case();
  put(&in.seqs[0].k, 1, 0, {std::nan(""), 0});
  const ref::Result r = run_ok(in, permute_params(0.95, 1), kLn2);
  EXPECT_EQ(r.decisions.query_order, (std::vector<std::int32_t>{0, 1, 2, 3, 7, 4, 6, 5}));
  EXPECT_EQ(visited(r.decisions), (std::vector<int>{0, 0, 1, 1}));
  for (int row = 4; row < 8; ++row) EXPECT_TRUE(std::isfinite(r.lse[static_cast<std::size_t>(row)])) << row;
}

TEST(ReferenceHand, PermuteStopChunkWithNegativePositions) {
  // s_q = 10 > s_k = 8: rows 0, 1 sit at negative positions, see nothing and hold the first
  // slots; rows 2..9 are permute_case's rows 0..7.
  const Inputs base = permute_case();
  Inputs in = hand_inputs(10, 8);
  in.seqs[0].k = base.seqs[0].k;
  in.seqs[0].v = base.seqs[0].v;
  for (int r = 0; r < 10; ++r) {
    for (int i = 0; i < 2; ++i) {
      test::set(&in.seqs[0].q, r * 2 + i, r < 2 ? 0.5 : test::get(base.seqs[0].q, (r - 2) * 2 + i));
    }
  }
  const ref::Result r = run_ok(in, permute_params(0.85), kLn2);
  EXPECT_EQ(r.decisions.query_order, (std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 9, 6, 8, 7}));
  EXPECT_EQ(visited(r.decisions), (std::vector<int>{0, 0, 2, 1}));
  EXPECT_EQ(r.lse[0], -kInf);
  EXPECT_EQ(r.lse[1], -kInf);
  const ref::Result full = run_ok(base, permute_params(0.85), kLn2);
  for (int row = 2; row < 10; ++row) EXPECT_NEAR(r.lse[static_cast<std::size_t>(row)], full.lse[static_cast<std::size_t>(row - 2)], kExact);
}

// ---------------------------------------------------------------- errors

TEST(ReferenceErrors, BadArgumentsNameTheArgument) {
  const Inputs in = gate_case();
  const test::TestProblem tp = test::build_problem(in);
  ref::Result r;
  // Threshold table with the wrong number of heads.
  HostTensor table(DType::kFP32, {2, 2});
  Status st = ref::run_reference(tp.problem(), gate(table), &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("thresholds"), std::string::npos) << st.message();
  // estimate_select and permute_stop are defined on causal calls only.
  test::LayoutOptions opt;
  opt.causal = false;
  const test::TestProblem nc = test::build_problem(in, opt);
  EXPECT_EQ(ref::run_reference(nc.problem(), EstimateSelectParams{}, &r).code(), StatusCode::kUnsupported);
  EXPECT_EQ(ref::run_reference(nc.problem(), PermuteStopParams{}, &r).code(), StatusCode::kUnsupported);
  // A block mask of the wrong geometry.
  ProblemShape other;
  const test::TestProblem small = test::build_problem(hand_inputs(4, 4));
  ASSERT_TRUE(validate_problem(small.problem(), nullptr, &other).ok());
  BlockSparseParams bs;
  bs.mask = BlockMask::all_visible(other, 4, 4, false);
  st = ref::run_reference(tp.problem(), bs, &r);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("mask"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace sparseprefill
