// SPDX-License-Identifier: Apache-2.0
// The shared test support (tests/common) has teeth: the calibrated check fails on a wrong,
// NaN or unwritten output and passes on a correctly rounded one; the low-precision reference
// is not exact; decision checks and diffs catch a single difference; inputs are never zero and
// layouts hide their unused storage behind NaN.
#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "common/decisions.h"
#include "common/inputs.h"
#include "common/poison.h"
#include "common/tolerance.h"
#include "core/tensor_access.h"
#include "reference/reference.h"
#include "reference/row_sets.h"

namespace sparseprefill {
namespace {

// Writes an oracle result (rounded to the output dtype) into `out`, skipping sequence `skip`.
void store_result(const ref::Result& r, const ProblemShape& s, const AttentionOutput& out, int skip = -1) {
  const std::int64_t rows = s.total_q();
  for (int b = 0; b < s.batch; ++b) {
    if (b == skip) continue;
    const std::int64_t row0 = s.q_start[static_cast<std::size_t>(b)], s_q = s.seq_q[static_cast<std::size_t>(b)];
    std::vector<double> lse(static_cast<std::size_t>(s.h_q * s_q));
    for (int h = 0; h < s.h_q; ++h) {
      for (std::int64_t q = 0; q < s_q; ++q) lse[static_cast<std::size_t>(h * s_q + q)] = r.lse[static_cast<std::size_t>(h * rows + row0 + q)];
    }
    detail::store_output<double>(out, s, b, &r.o[static_cast<std::size_t>(row0 * s.h_q * s.d)], lse.data());
  }
}

struct Fixture {
  test::TestProblem tp;
  ProblemShape shape;
  ref::Result ref64;
  ref::Result lowp;
};

// Three sequences, one with s_q > s_k (empty rows), bf16, under `policy`.
Fixture make(const Policy& policy) {
  Fixture f;
  const test::Inputs in = test::random_inputs({{33, 33}, {12, 40}, {9, 5}}, 2, 1, 16, DType::kBF16, 77, 1.0,
                                              test::Distribution::kNormal);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kVarlen;
  f.tp = test::build_problem(in, opt);
  EXPECT_TRUE(validate_problem(f.tp.problem(), nullptr, &f.shape).ok());
  EXPECT_TRUE(ref::run_reference(f.tp.problem(), policy, &f.ref64).ok());
  EXPECT_TRUE(test::run_lowp_reference(f.tp.problem(), policy, f.ref64.decisions, &f.lowp).ok());
  return f;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isfinite(a[i]) && std::isfinite(b[i])) m = std::max(m, std::fabs(a[i] - b[i]));
  }
  return m;
}

TEST(TestSupport, LowPrecisionReferenceIsCloseButNotExact) {
  EstimateSelectParams es;
  es.block = 4;
  es.mean_correction = true;
  for (const Policy& p : std::vector<Policy>{DenseParams{}, es}) {
    const Fixture f = make(p);
    const double err = max_abs_diff(f.lowp.o, f.ref64.o);
    EXPECT_GT(err, 0.0) << describe(p);  // bf16 rounding of P shows
    EXPECT_LT(err, 2e-2) << describe(p);
    EXPECT_LT(max_abs_diff(f.lowp.lse, f.ref64.lse), 1e-4) << describe(p);
    EXPECT_EQ(f.lowp.lse[static_cast<std::size_t>(33 + 12)], -std::numeric_limits<double>::infinity());
    EXPECT_TRUE(test::close_calibrated(DType::kBF16, f.lowp, f.ref64, f.lowp));
  }
}

TEST(TestSupport, CalibratedCheckPassesARoundedOracleAndFailsWrongOutputs) {
  Fixture f = make(DenseParams{});
  const AttentionOutput out = f.tp.output();
  test::poison(&f.tp.o);
  test::poison(&f.tp.lse);
  store_result(f.ref64, f.shape, out);
  EXPECT_TRUE(test::matches_reference(f.tp.problem(), DenseParams{}, out));
  const ref::Result got = test::read_output(out, f.shape);
  ASSERT_TRUE(test::close_calibrated(DType::kBF16, got, f.ref64, f.lowp));

  const double low_err = max_abs_diff(f.lowp.o, f.ref64.o);
  ref::Result bad = got;
  double max_o = 0;
  for (double x : f.ref64.o) max_o = std::max(max_o, std::fabs(x));
  bad.o[100] += 4 * low_err + std::ldexp(max_o, -7);  // past 2 x the low-precision error + eps
  EXPECT_FALSE(test::close_calibrated(DType::kBF16, bad, f.ref64, f.lowp));
  bad = got;
  bad.o[7] = std::nan("");
  EXPECT_FALSE(test::close_calibrated(DType::kBF16, bad, f.ref64, f.lowp));
  bad = got;
  bad.lse[3] += 1e-3;
  EXPECT_FALSE(test::close_calibrated(DType::kBF16, bad, f.ref64, f.lowp));
  bad = got;
  bad.lse[33 + 12] = 0.0;  // the oracle says -inf (an empty row)
  EXPECT_FALSE(test::close_calibrated(DType::kBF16, bad, f.ref64, f.lowp));
  // NaN where the oracle is NaN passes; where it is not, it fails.
  ref::Result nan_ref = f.ref64, nan_low = f.lowp;
  bad = got;
  nan_ref.o[5] = nan_low.o[5] = bad.o[5] = std::nan("");
  EXPECT_TRUE(test::close_calibrated(DType::kBF16, bad, nan_ref, nan_low));
  bad.o[5] = 0.25;
  EXPECT_FALSE(test::close_calibrated(DType::kBF16, bad, nan_ref, nan_low));
}

TEST(TestSupport, UnwrittenOutputIsCaught) {
  Fixture f = make(DenseParams{});
  const AttentionOutput out = f.tp.output();
  test::poison(&f.tp.o);
  test::poison(&f.tp.lse);
  store_result(f.ref64, f.shape, out, /*skip=*/1);
  EXPECT_FALSE(test::fully_written(test::read_output(out, f.shape), f.ref64));
  EXPECT_FALSE(test::matches_reference(f.tp.problem(), DenseParams{}, out));
}

TEST(TestSupport, DecisionChecksAndDiffsCatchOneDifference) {
  EstimateSelectParams es;
  es.block = 4;
  es.alpha = 0.5;
  es.sink = 0;
  es.tail = 0;
  es.window = 1;
  const Fixture f = make(es);
  ASSERT_TRUE(ref::check_decisions(f.shape, es, f.ref64.decisions).ok());
  EXPECT_TRUE(test::same_decisions(f.ref64.decisions, f.ref64.decisions));
  // One more block selected.
  Decisions more = f.ref64.decisions;
  std::vector<std::uint8_t> map = more.kept.to_dense();
  const std::vector<std::uint8_t> all = BlockMask::all_visible(f.shape, 4, 4, false).to_dense();
  std::size_t flip = 0;
  while (flip < map.size() && (map[flip] || !all[flip])) ++flip;
  ASSERT_LT(flip, map.size()) << "every visible block was selected";
  map[flip] = 1;
  ASSERT_TRUE(BlockMask::from_dense(f.shape, 4, 4, false, map, &more.kept).ok());
  EXPECT_FALSE(test::same_decisions(f.ref64.decisions, more));
  ref::Result replay;
  EXPECT_TRUE(test::run_lowp_reference(f.tp.problem(), es, more, &replay).ok());
  // Decisions that do not fit are rejected with the offending field named.
  Decisions wrong = f.ref64.decisions;
  wrong.policy = "dense";
  EXPECT_NE(ref::check_decisions(f.shape, es, wrong).message().find("decisions.policy"), std::string::npos);
  wrong = f.ref64.decisions;
  wrong.kept = BlockMask::all_visible(f.shape, 8, 4, false);
  EXPECT_NE(ref::check_decisions(f.shape, es, wrong).message().find("decisions.kept"), std::string::npos);
  EXPECT_FALSE(test::run_lowp_reference(f.tp.problem(), es, wrong, &replay).ok());
}

TEST(TestSupport, PermuteDecisionChecks) {
  PermuteStopParams ps;
  ps.segment = 8;
  ps.block_q = 4;
  ps.block_k = 4;
  ps.tau = 0.05;
  const Fixture f = make(ps);
  ASSERT_TRUE(ref::check_decisions(f.shape, ps, f.ref64.decisions).ok());
  Decisions d = f.ref64.decisions;
  d.tiles.back().chunks_visited += d.tiles.back().chunks_total + 1;
  EXPECT_FALSE(ref::check_decisions(f.shape, ps, d).ok());
  EXPECT_FALSE(test::same_decisions(f.ref64.decisions, d));
  d = f.ref64.decisions;
  std::swap(d.query_order[0], d.query_order[20]);  // rows of different segments
  EXPECT_NE(ref::check_decisions(f.shape, ps, d).message().find("query_order"), std::string::npos);
  d = f.ref64.decisions;
  d.tiles.pop_back();
  EXPECT_NE(ref::check_decisions(f.shape, ps, d).message().find("tiles"), std::string::npos);
}

TEST(TestSupport, RandomValuesAreNeverZero) {
  test::Random rng(1);
  double sum = 0, sum_sq = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = rng.uniform();
    ASSERT_TRUE(u > -1 && u < 1 && u != 0);
    const double x = rng.normal();
    ASSERT_NE(x, 0.0);
    sum += x;
    sum_sq += x * x;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.02);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.03);
  for (const DType dt : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    HostTensor t(dt, {4096});
    test::fill_random(&t, 5, 1e-3);
    for (std::int64_t i = 0; i < t.numel(); ++i) ASSERT_NE(test::get(t, i), 0.0) << dtype_name(dt);
  }
}

TEST(TestSupport, PagedLayoutShufflesPagesAndHidesUnusedStorage) {
  const test::Inputs in = test::random_inputs({{5, 10}, {3, 7}}, 2, 1, 4, DType::kBF16, 9);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kPaged;
  opt.page_size = 3;
  const test::TestProblem tp = test::build_problem(in, opt);
  ASSERT_EQ(tp.block_table.shape(), (std::vector<std::int64_t>{2, 4}));
  const std::int32_t* table = tp.block_table.as<std::int32_t>();
  std::set<std::int32_t> used;
  bool identity = true;
  for (int i = 0; i < 4; ++i) {
    used.insert(table[i]);
    identity = identity && table[i] == i;
  }
  for (int i = 0; i < 3; ++i) used.insert(table[4 + i]);
  EXPECT_EQ(used.size(), 7u);  // 4 + 3 pages, all distinct
  EXPECT_FALSE(identity);
  // Sequence 1 owns 3 pages; its table's last entry points at the spare page, all NaN; so is
  // the tail of sequence 0's last page (10 keys in 4 pages of 3).
  // A page holds 3 keys x 1 KV head x d = 4: 12 elements.
  const std::int32_t spare = table[7];
  EXPECT_EQ(used.count(spare), 0u);
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_TRUE(std::isnan(test::get(tp.k, spare * 12 + i)));
  for (std::int64_t i = 0; i < 12; ++i) EXPECT_EQ(std::isnan(test::get(tp.v, table[3] * 12 + i)), i >= 4);
}

}  // namespace
}  // namespace sparseprefill
