// SPDX-License-Identifier: Apache-2.0
// Metamorphic and hostile-input properties of the oracle's model-family features (local window,
// sinks, softcap, V head dim; docs/semantics.md §1) on seeded random inputs, for every policy:
// windows that hide nothing equal no window; a windowed call equals dense attention under its
// expanded element mask; sinks of -inf equal no sinks and sinks equal the naive softmax with a
// sink column; a huge softcap is no softcap within the Taylor bound of tanh; a softcapped call
// equals the naive capped softmax; d_v != d equals concatenating per-V-chunk calls; a windowed
// chunk equals the tail of the full call; K/V outside every window are never read.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/cases.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/naive.h"
#include "common/results.h"
#include "reference/reference.h"
#include "reference/row_sets.h"
#include "reference/sequence.h"
#include "sparseprefill/attention.h"

namespace sparseprefill {
namespace {

using test::Inputs;
using test::LayoutOptions;
using test::same_decisions;
using test::same_result;
using test::kInf;

constexpr double kTight = 1e-12;  // two fp64 evaluations of the same sum in different orders

ref::Result run_ok(const test::TestProblem& tp, const Policy& policy) {
  ref::Result r;
  const Status st = ref::run_reference(tp.problem(), policy, &r);
  EXPECT_TRUE(st.ok()) << policy_name(policy) << ": " << st.to_string();
  return r;
}

LayoutOptions options(bool causal, int left, int right, double softcap = 0.0) {
  LayoutOptions o;
  o.layout = test::Layout::kVarlen;
  o.causal = causal;
  o.window_left = left;
  o.window_right = right;
  o.softcap = softcap;
  return o;
}

// Two sequences (a square one and a chunk over a cached prefix) with structure for the
// selectors: key chunks of 8 with every third one shifted (estimate_select prunes the rest) and
// the others scaled down (softmax_skip skips them).
Inputs inputs(DType dtype, std::uint64_t seed, int d = 8, int d_v = 0) {
  Inputs in = test::random_inputs({{40, 40}, {24, 56}}, 4, 2, d, dtype, seed, 2.0, test::Distribution::kUniform, d_v);
  test::shift_hot_keys(&in, 8, 1.0);
  return in;
}

// Every policy, with parameters that skip some work on inputs() (exact_gate's table from the
// call's own gated maxima, so it depends on the window and softcap). Non-causal calls get the
// policies defined for them.
struct PolicyCase {
  std::string name;
  Policy policy;
};
std::vector<PolicyCase> policies(const Inputs& in, const LayoutOptions& opt, std::vector<HostTensor>* tables) {
  std::vector<PolicyCase> out;
  out.push_back({"dense", DenseParams{}});
  {
    const test::TestProblem tp = test::build_problem(in, opt);
    ProblemShape shape;
    EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams p;
    p.mask = test::random_mask(shape, 8, 4, false, 3, &dead);
    out.push_back({"block_sparse", p});
  }
  {
    // One threshold for every (head, position): the midpoint of a gap of 0.02 or more between
    // consecutive gated-block maxima near their median, so that no maximum lies near it.
    std::vector<double> maxima;
    for (const test::GatedMax& m : test::gated_block_maxima(test::build_problem(in, opt), 8, 8)) maxima.push_back(m.max);
    std::sort(maxima.begin(), maxima.end(), std::greater<double>());
    tables->emplace_back(DType::kFP32, std::vector<std::int64_t>{in.h_q, 8});
    const double mid = test::midpoint_near(maxima, static_cast<int>(maxima.size() / 2), 0.02);
    for (std::int64_t i = 0; i < tables->back().numel(); ++i) test::set(&tables->back(), i, mid);
    out.push_back({"exact_gate", test::gate_params(tables->back(), 8, 8)});
  }
  out.push_back({"softmax_skip", test::skip_params(4.0, 8, 8)});
  if (!opt.causal) return out;
  out.push_back({"estimate_select", test::small_estimate_select(0.3, 8)});
  out.push_back({"estimate_select, mean correction", test::small_estimate_select(0.3, 8, true)});
  out.push_back({"estimate_select, pack_gqa", test::small_estimate_select(0.3, 8, false, true)});
  out.push_back({"permute_stop", test::permute_params(0.05, 16, 4, 8)});
  return out;
}

// The keys a row reads under the oracle's decisions (ref::RowSets, the expansion every backend
// is compared through), as an element mask; mean-correction pseudo-tokens are not keys.
struct Expanded {
  std::vector<std::vector<std::vector<std::vector<char>>>> keys;  // [b][h][r][t]
  bool corrected = false;
};
Expanded expand(const test::TestProblem& tp, const Policy& policy, const Decisions& d) {
  ProblemShape shape;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  Expanded e;
  ref::RowAttention row;
  for (int b = 0; b < shape.batch; ++b) {
    const ref::Sequence seq = ref::gather_sequence(tp.problem(), shape, b);
    ref::RowSets sets;
    sets.init(seq, shape, policy, d);
    e.keys.emplace_back(static_cast<std::size_t>(shape.h_q),
                        std::vector<std::vector<char>>(static_cast<std::size_t>(seq.geo.s_q),
                                                       std::vector<char>(static_cast<std::size_t>(seq.geo.s_k), 0)));
    for (int h = 0; h < shape.h_q; ++h) {
      for (std::int64_t r = 0; r < seq.geo.s_q; ++r) {
        sets.row(h, r, &row);
        for (const std::int64_t t : row.keys) e.keys[b][h][r][t] = 1;
        e.corrected |= !row.mean_blocks.empty();
      }
    }
  }
  return e;
}

// Fraction of the window-visible (row, key) pairs a policy reads: the checks below want it
// strictly between 0 and 1 somewhere, so that they are not vacuous.
double read_fraction(const Inputs& in, const LayoutOptions& opt, const Expanded& e) {
  std::int64_t seen = 0, read = 0;
  for (int b = 0; b < static_cast<int>(in.seqs.size()); ++b) {
    for (int h = 0; h < in.h_q; ++h) {
      for (std::int64_t r = 0; r < in.s_q(b); ++r) {
        for (std::int64_t t = 0; t < in.s_k(b); ++t) {
          const bool visible = test::window_visible(in.s_q(b), in.s_k(b), opt.causal, opt.window_left, opt.window_right, r, t);
          seen += visible;
          read += e.keys[b][h][r][t];
          EXPECT_TRUE(visible || !e.keys[b][h][r][t]) << "a key outside the window is read: b " << b << " h " << h
                                                      << " row " << r << " key " << t;
        }
      }
    }
  }
  return seen > 0 ? static_cast<double>(read) / static_cast<double>(seen) : 0.0;
}

// ---------------------------------------------------------------- local window

TEST(FeaturesMetamorphic, WindowsThatHideNothingEqualNoWindow) {
  // Causal: a right bound (causal already ends every row), a left bound past every position.
  // Non-causal: both bounds past the sequences. Decisions and outputs are the plain call's,
  // bit for bit, for every policy.
  const Inputs in = inputs(DType::kBF16, 11);
  for (const bool causal : {true, false}) {
    std::vector<std::pair<int, int>> windows = {{60, 60}, {56, -1}};
    if (causal) windows.insert(windows.end(), {{-1, 0}, {-1, 3}});
    std::vector<HostTensor> tables;
    for (const auto& c : policies(in, options(causal, -1, -1), &tables)) {
      const ref::Result plain = run_ok(test::build_problem(in, options(causal, -1, -1)), c.policy);
      for (const auto& [left, right] : windows) {
        SCOPED_TRACE(c.name + (causal ? ", causal" : ", non-causal") + " window (" + std::to_string(left) + ", " +
                     std::to_string(right) + ")");
        const ref::Result r = run_ok(test::build_problem(in, options(causal, left, right)), c.policy);
        EXPECT_TRUE(same_decisions(plain.decisions, r.decisions));
        EXPECT_TRUE(same_result(r, plain, 0.0));
      }
    }
  }
}

TEST(FeaturesMetamorphic, WindowedCallsEqualDenseAttentionUnderTheExpandedMask) {
  // Every policy under causal windows (a tight one, one wider than a block, one reaching into
  // the cached prefix) and non-causal ones: each row reads only keys of its window, and the
  // output equals the naive softmax over exactly the keys it reads (mean correction aside: its
  // pseudo-tokens are checked by the CPU backend's conformance instead).
  const Inputs in = inputs(DType::kFP16, 13);
  struct Window {
    bool causal;
    int left, right;
  };
  for (const Window& w : {Window{true, 5, -1}, Window{true, 13, -1}, Window{true, 30, 0}, Window{false, 6, 3},
                          Window{false, 0, 9}, Window{false, -1, 2}}) {
    const LayoutOptions opt = options(w.causal, w.left, w.right);
    const test::TestProblem tp = test::build_problem(in, opt);
    std::vector<HostTensor> tables;
    bool partial = false;  // some policy reads some but not all of the window
    for (const auto& c : policies(in, opt, &tables)) {
      SCOPED_TRACE(c.name + (w.causal ? ", causal" : ", non-causal") + " window (" + std::to_string(w.left) + ", " +
                   std::to_string(w.right) + ")");
      const ref::Result r = run_ok(tp, c.policy);
      const Expanded e = expand(tp, c.policy, r.decisions);
      const double fraction = read_fraction(in, opt, e);
      if (c.name == "dense") EXPECT_EQ(fraction, 1.0);
      partial |= fraction > 0.0 && fraction < 1.0;
      if (e.corrected) continue;
      const ref::Result want = test::masked_softmax(in, 0.0, [&](int b, int h, std::int64_t row, std::int64_t t) {
        return e.keys[b][h][row][t] != 0;
      });
      EXPECT_TRUE(same_result(r, want, kTight));
      // A gate's or selector's decisions replayed as a mask under the same window: the same output.
      if (!std::holds_alternative<ExactGateParams>(c.policy) && !std::holds_alternative<SoftmaxSkipParams>(c.policy) &&
          !std::holds_alternative<EstimateSelectParams>(c.policy)) {
        continue;
      }
      BlockSparseParams replay;
      replay.mask = r.decisions.kept;
      EXPECT_TRUE(same_result(run_ok(tp, replay), r, kTight));
    }
    EXPECT_TRUE(partial) << "no policy skipped anything under this window: the check is vacuous";
  }
}

TEST(FeaturesMetamorphic, PermuteStopUnderAWindowAtTauZeroIsDenseAttention) {
  const Inputs in = inputs(DType::kBF16, 17);
  const LayoutOptions opt = options(true, 11, -1);
  const test::TestProblem tp = test::build_problem(in, opt);
  const ref::Result r = run_ok(tp, test::permute_params(0.0, 16, 4, 8));
  for (const PermuteTile& t : r.decisions.tiles) EXPECT_EQ(t.chunks_visited, t.chunks_total);
  EXPECT_TRUE(same_result(r, run_ok(tp, DenseParams{}), kTight));
}

TEST(FeaturesMetamorphic, WindowedChunkEqualsTheTailOfTheFullCall) {
  // The window is relative to absolute positions: the last 24 queries of a 64-token prompt as
  // a chunk over all 64 keys are the full call's last rows, for dense, exact_gate at a fixed
  // table (absolute threshold rows) and a block mask.
  Inputs full = test::random_inputs({{64, 64}}, 2, 1, 8, DType::kBF16, 19, 1.0, test::Distribution::kNormal);
  Inputs chunk = full;
  chunk.seqs[0].q = HostTensor(full.dtype, {24, 2, 8});
  for (std::int64_t i = 0; i < 24 * 2 * 8; ++i) test::set(&chunk.seqs[0].q, i, test::get(full.seqs[0].q, 40 * 2 * 8 + i));
  LayoutOptions opt = options(true, 9, -1);
  opt.layout = test::Layout::kBatched;
  HostTensor table(DType::kFP32, {2, 8});
  for (std::int64_t i = 0; i < table.numel(); ++i) test::set(&table, i, 0.4);
  for (const Policy& p : std::vector<Policy>{DenseParams{}, test::gate_params(table, 8, 8)}) {
    const ref::Result a = run_ok(test::build_problem(full, opt), p), c = run_ok(test::build_problem(chunk, opt), p);
    for (int h = 0; h < 2; ++h) {
      for (std::int64_t r = 0; r < 24; ++r) {
        EXPECT_NEAR(c.lse[static_cast<std::size_t>(h * 24 + r)], a.lse[static_cast<std::size_t>(h * 64 + 40 + r)], kTight)
            << policy_name(p) << " head " << h << " row " << r;
        for (int i = 0; i < 8; ++i) {
          EXPECT_NEAR(c.o[static_cast<std::size_t>((r * 2 + h) * 8 + i)], a.o[static_cast<std::size_t>(((40 + r) * 2 + h) * 8 + i)], kTight);
        }
      }
    }
  }
}

TEST(FeaturesMetamorphic, KeysOutsideEveryWindowAreNeverRead) {
  // A chunk of 6 queries (positions 34..39) over 40 keys with window left 5: no row sees keys
  // 0..28, and the 8-key blocks 0..2 (keys 0..23) lie wholly below every window. NaN K and V
  // there change nothing, for every policy (estimate_select's means of a block that a window
  // cuts average all its keys, so the poison stops at block 3's first key).
  Inputs clean = test::random_inputs({{6, 40}}, 2, 1, 8, DType::kBF16, 23, 2.0);
  Inputs dirty = clean;
  test::poison_keys(&dirty, 0, false, 0, 0, 24);
  test::poison_keys(&dirty, 0, true, 0, 0, 24);
  const LayoutOptions opt = options(true, 5, -1);
  std::vector<HostTensor> tables;
  for (const auto& c : policies(clean, opt, &tables)) {
    SCOPED_TRACE(c.name);
    const ref::Result a = run_ok(test::build_problem(clean, opt), c.policy);
    const ref::Result b = run_ok(test::build_problem(dirty, opt), c.policy);
    EXPECT_TRUE(same_decisions(a.decisions, b.decisions));
    EXPECT_TRUE(same_result(b, a, 0.0));
  }
}

// ---------------------------------------------------------------- sinks

TEST(FeaturesMetamorphic, SinksOfMinusInfinityEqualNoSinks) {
  const Inputs plain = inputs(DType::kBF16, 29);
  Inputs with = plain;
  with.sinks.assign(static_cast<std::size_t>(plain.h_q), -kInf);
  std::vector<HostTensor> tables;
  for (const auto& c : policies(plain, options(true, -1, -1), &tables)) {
    SCOPED_TRACE(c.name);
    const ref::Result a = run_ok(test::build_problem(plain, options(true, -1, -1)), c.policy);
    const ref::Result b = run_ok(test::build_problem(with, options(true, -1, -1)), c.policy);
    EXPECT_TRUE(same_decisions(a.decisions, b.decisions));
    EXPECT_TRUE(same_result(b, a, 0.0));
  }
}

TEST(FeaturesMetamorphic, SinksEqualTheNaiveSoftmaxWithASinkColumnAndMoveNoDecision) {
  // Sinks on a grid around the rows' typical LSE, so that they take a real share of the mass;
  // under a window too. Decisions do not read sinks: the same with and without them.
  const Inputs plain = inputs(DType::kFP16, 31);
  Inputs with = plain;
  with.sinks = {-1.0, 0.5, 2.0, 3.5};
  for (const LayoutOptions& opt : {options(true, -1, -1), options(true, 9, -1), options(false, 4, 4)}) {
    std::vector<HostTensor> tables;
    for (const auto& c : policies(plain, opt, &tables)) {
      SCOPED_TRACE(c.name + " window (" + std::to_string(opt.window_left) + ", " + std::to_string(opt.window_right) + ")");
      const test::TestProblem tp = test::build_problem(with, opt);
      const ref::Result r = run_ok(tp, c.policy);
      EXPECT_TRUE(same_decisions(run_ok(test::build_problem(plain, opt), c.policy).decisions, r.decisions));
      const Expanded e = expand(tp, c.policy, r.decisions);
      if (e.corrected) continue;
      EXPECT_TRUE(same_result(r, test::masked_softmax(with, 0.0, [&](int b, int h, std::int64_t row, std::int64_t t) {
                                return e.keys[b][h][row][t] != 0;
                              }),
                              kTight));
    }
  }
}

// ---------------------------------------------------------------- softcap

TEST(FeaturesMetamorphic, HugeSoftcapIsNoSoftcapWithinTheTaylorBound) {
  // |c·tanh(s/c) - s| <= |s|^3 / (3 c^2), so with every |s| <= m the scores move by at most
  // e = m^3 / (3 c^2): LSE by at most e, O by at most 2 e max|v| (each weight's relative change
  // is within 2e to first order), and no decision moves (they are e away at most from the
  // uncapped ones, and no comparison on these inputs lies that close).
  const Inputs in = inputs(DType::kBF16, 37);
  const double c = 1e4;
  double m = 0.0, v_max = 0.0;
  for (int b = 0; b < 2; ++b) {
    const test::SequenceData& s = in.seqs[static_cast<std::size_t>(b)];
    for (std::int64_t r = 0; r < in.s_q(b); ++r) {
      for (std::int64_t t = 0; t < in.s_k(b); ++t) {
        for (int h = 0; h < in.h_q; ++h) {
          double dot = 0;
          for (int i = 0; i < in.d; ++i) dot += test::get(s.q, (r * in.h_q + h) * in.d + i) * test::get(s.k, (t * in.h_kv + h / 2) * in.d + i);
          m = std::max(m, std::fabs(dot) / std::sqrt(8.0));
        }
      }
    }
    for (std::int64_t i = 0; i < s.v.numel(); ++i) v_max = std::max(v_max, std::fabs(test::get(s.v, i)));
  }
  const double e = m * m * m / (3 * c * c);
  ASSERT_GT(m, 1.0);
  std::vector<HostTensor> tables;
  for (const auto& pc : policies(in, options(true, -1, -1), &tables)) {
    SCOPED_TRACE(pc.name);
    const ref::Result plain = run_ok(test::build_problem(in, options(true, -1, -1)), pc.policy);
    const ref::Result capped = run_ok(test::build_problem(in, options(true, -1, -1, c)), pc.policy);
    EXPECT_TRUE(same_decisions(plain.decisions, capped.decisions));
    EXPECT_TRUE(same_result(capped, plain, 2 * e * std::max(v_max, 1.0) + kTight));
    EXPECT_FALSE(same_result(capped, plain, 0.0)) << "softcap did nothing";
  }
}

TEST(FeaturesMetamorphic, SoftcapEqualsTheNaiveCappedSoftmax) {
  // softcap 1.5 (every score of about 2 or more is squeezed): dense, and every policy over the
  // keys it reads, with and without a window.
  const Inputs in = inputs(DType::kBF16, 41);
  for (const LayoutOptions& opt : {options(true, -1, -1, 1.5), options(true, 12, -1, 1.5), options(false, -1, -1, 1.5)}) {
    const test::TestProblem tp = test::build_problem(in, opt);
    std::vector<HostTensor> tables;
    for (const auto& c : policies(in, opt, &tables)) {
      SCOPED_TRACE(c.name + " window left " + std::to_string(opt.window_left));
      const ref::Result r = run_ok(tp, c.policy);
      const Expanded e = expand(tp, c.policy, r.decisions);
      if (e.corrected) continue;
      EXPECT_TRUE(same_result(r,
                              test::masked_softmax(
                                  in, 0.0, [&](int b, int h, std::int64_t row, std::int64_t t) { return e.keys[b][h][row][t] != 0; },
                                  1.5),
                              kTight));
    }
  }
}

// ---------------------------------------------------------------- V head dim

TEST(FeaturesMetamorphic, ValueHeadDimEqualsConcatenatedPerChunkCalls) {
  // d = 8 with d_v = 12: the call equals two calls over v's columns 0..4 and 5..11, bit for bit
  // (the weights do not read v; mean correction averages each column alone), decisions equal;
  // under a window and with sinks too.
  Inputs in = inputs(DType::kBF16, 43, 8, 12);
  in.sinks = {0.5, -0.5, 1.0, 0.0};
  const auto part = [&](int c0, int c1) {
    Inputs p = in;
    p.d_v = c1 - c0;
    for (std::size_t b = 0; b < in.seqs.size(); ++b) {
      const std::int64_t s_k = in.s_k(static_cast<int>(b));
      p.seqs[b].v = HostTensor(in.dtype, {s_k, in.h_kv, c1 - c0});
      for (std::int64_t t = 0; t < s_k * in.h_kv; ++t) {
        for (int i = c0; i < c1; ++i) test::set(&p.seqs[b].v, t * (c1 - c0) + i - c0, test::get(in.seqs[b].v, t * 12 + i));
      }
    }
    return p;
  };
  const Inputs lo = part(0, 5), hi = part(5, 12);
  for (const LayoutOptions& opt : {options(true, -1, -1), options(true, 10, -1)}) {
    std::vector<HostTensor> tables;
    for (const auto& c : policies(in, opt, &tables)) {
      SCOPED_TRACE(c.name + " window left " + std::to_string(opt.window_left));
      const ref::Result all = run_ok(test::build_problem(in, opt), c.policy);
      const ref::Result a = run_ok(test::build_problem(lo, opt), c.policy), b = run_ok(test::build_problem(hi, opt), c.policy);
      EXPECT_TRUE(same_decisions(all.decisions, a.decisions));
      EXPECT_TRUE(same_decisions(all.decisions, b.decisions));
      ASSERT_EQ(all.lse, a.lse);
      ASSERT_EQ(all.lse, b.lse);
      const std::size_t rows = all.o.size() / 12;
      for (std::size_t row = 0; row < rows; ++row) {
        for (int i = 0; i < 12; ++i) {
          const double want = i < 5 ? a.o[row * 5 + static_cast<std::size_t>(i)] : b.o[row * 7 + static_cast<std::size_t>(i - 5)];
          ASSERT_EQ(all.o[row * 12 + static_cast<std::size_t>(i)], want) << "row/head " << row << " column " << i;
        }
      }
    }
  }
}

}  // namespace
}  // namespace sparseprefill
