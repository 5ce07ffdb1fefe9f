// SPDX-License-Identifier: Apache-2.0
// The CPU backend against the fp64 oracle: every policy within the calibrated tolerance, the
// same decisions on inputs and thresholds placed away from ties, poisoned outputs fully
// written, NaN in K/V the policy skips, odd lengths, s_q != s_k, GQA, varlen and paged layouts,
// and results independent of the thread count. Plus the pure decision rules and exp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "common/cases.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/poison.h"
#include "common/results.h"
#include "common/tolerance.h"
#include "core/geometry.h"
#include "cpu/cpu_policies.h"
#include "cpu/simd.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

// simd::VecF values cross calls in the exp test; the ABI note about them does not apply here.
#pragma GCC diagnostic ignored "-Wpsabi"

namespace sparseprefill::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ------------------------------------------------------------------ harness

struct CpuRun {
  Status status;
  ref::Result out;  // the CPU output in the oracle's layout
  Decisions decisions;
};

// Poisons the outputs, runs the CPU backend and reads the output back.
CpuRun run_cpu_backend(TestProblem* tp, const Policy& policy, int threads = 2) {
  CpuRun r;
  poison(&tp->o);
  poison(&tp->lse);
  RunOptions opt;
  opt.backend = Backend::kCPU;
  opt.num_threads = threads;
  r.status = run(tp->problem(), policy, tp->output(), opt, nullptr, &r.decisions);
  if (r.status.ok()) {
    ProblemShape shape;
    EXPECT_TRUE(validate_problem(tp->problem(), nullptr, &shape).ok());
    r.out = read_output(tp->output(), shape);
  }
  return r;
}

// The CPU backend within the calibrated tolerance of the oracle, fully written, with exactly
// the oracle's decisions. Returns the CPU run for further checks.
CpuRun expect_matches_oracle(TestProblem* tp, const Policy& policy, int threads = 2) {
  CpuRun r = run_cpu_backend(tp, policy, threads);
  EXPECT_TRUE(r.status.ok()) << r.status.to_string();
  if (!r.status.ok()) return r;
  ref::Result ref64;
  EXPECT_TRUE(matches_reference(tp->problem(), policy, tp->output(), {}, &ref64));
  EXPECT_TRUE(same_decisions(ref64.decisions, r.decisions));
  return r;
}

Inputs make_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                   double scale = 1.5, DType dtype = DType::kBF16) {
  return random_inputs(lengths, h_q, h_kv, d, dtype, seed, scale);
}

// Element (pos, KV head g, channel c) of a sequence's k or v as a logical value.
double kv(const HostTensor& t, const Inputs& in, std::int64_t pos, int g, int c) {
  return get(t, (pos * in.h_kv + g) * in.d + c);
}

// Sets K or V of key positions [k0, k1) of KV head g in sequence b to NaN.
void poison_keys(Inputs* in, int b, bool value, int g, std::int64_t k0, std::int64_t k1) {
  SequenceData& s = in->seqs[static_cast<std::size_t>(b)];
  HostTensor* t = value ? &s.v : &s.k;
  for (std::int64_t pos = k0; pos < k1; ++pos) {
    for (int c = 0; c < in->d; ++c) set(t, (pos * in->h_kv + g) * in->d + c, kNaN);
  }
}

// ------------------------------------------------------------------ thresholds for exact_gate

ExactGateParams gate_params(const HostTensor& thr, int bq, int bk) {
  ExactGateParams p;
  p.block_q = bq;
  p.block_k = bk;
  p.thresholds = thr.view();
  return p;
}

// ------------------------------------------------------------------ the vector exp

TEST(CpuSimd, ExpAccuracyAndSpecialValues) {
  namespace simd = cpu::simd;
  double worst = 0.0;
  for (int i = 0; i < 4000; ++i) {
    simd::VecF x;
    for (int k = 0; k < simd::kLanes; ++k) x[k] = static_cast<float>(-87.0 + 175.0 * (i * simd::kLanes + k) / (4000.0 * simd::kLanes));
    const simd::VecF e = simd::exp(x);
    for (int k = 0; k < simd::kLanes; ++k) {
      const double want = std::exp(static_cast<double>(x[k]));
      worst = std::max(worst, std::abs(e[k] - want) / want);
    }
  }
  EXPECT_LT(worst, 4 * 6e-8);  // a few ulp
  simd::VecF x = simd::splat(0.0f);
  x[0] = -std::numeric_limits<float>::infinity();
  x[1] = std::numeric_limits<float>::quiet_NaN();
  x[2] = std::numeric_limits<float>::infinity();
  x[3] = -100.0f;
  x[4] = 0.0f;
  const simd::VecF e = simd::exp(x);
  EXPECT_EQ(e[0], 0.0f);
  EXPECT_TRUE(std::isnan(e[1]));
  EXPECT_EQ(e[2], std::numeric_limits<float>::infinity());
  EXPECT_EQ(e[3], 0.0f);
  EXPECT_EQ(e[4], 1.0f);
}

// ------------------------------------------------------------------ dense and block_sparse

TEST(CpuDense, OddLengthsAgainstOracle) {
  for (std::int64_t s : {1, 15, 17, 113, 1023}) {
    SCOPED_TRACE("s = " + std::to_string(s));
    const Inputs in = make_inputs({{s, s}}, 2, 1, 16, 100 + static_cast<std::uint64_t>(s));
    TestProblem tp = make_problem(in);
    expect_matches_oracle(&tp, DenseParams{});
  }
}

TEST(CpuDense, ChunkedPrefillAndEmptyRows) {
  // s_q < s_k (a cached prefix), and s_q > s_k where the first s_q - s_k rows see no key.
  for (const SeqLen l : {SeqLen{17, 113}, SeqLen{40, 23}}) {
    SCOPED_TRACE(std::to_string(l.s_q) + " x " + std::to_string(l.s_k));
    const Inputs in = make_inputs({l}, 4, 2, 24, 7);
    TestProblem tp = make_problem(in);
    const CpuRun r = expect_matches_oracle(&tp, DenseParams{});
    const std::int64_t empty = std::max<std::int64_t>(0, l.s_q - l.s_k);
    for (int h = 0; h < in.h_q; ++h) {
      for (std::int64_t row = 0; row < l.s_q; ++row) {
        const double lse = r.out.lse[static_cast<std::size_t>(h * l.s_q + row)];
        if (row < empty) {
          EXPECT_EQ(lse, -kInf) << "row " << row;
          for (int c = 0; c < in.d; ++c) EXPECT_EQ(r.out.o[static_cast<std::size_t>((row * in.h_q + h) * in.d + c)], 0.0);
        } else {
          EXPECT_TRUE(std::isfinite(lse)) << "row " << row;
        }
      }
    }
  }
}

TEST(CpuDense, GqaGroupsDtypesAndNonCausal) {
  for (int group : {1, 4, 8}) {
    for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      SCOPED_TRACE("group " + std::to_string(group) + " " + dtype_name(dtype));
      const Inputs in = make_inputs({{37, 37}}, group, 1, 32, 11, 1.5, dtype);
      for (bool causal : {true, false}) {
        TestProblem tp = make_problem(in, causal);
        expect_matches_oracle(&tp, DenseParams{});
      }
    }
  }
}

TEST(CpuDense, VarlenAndPagedEqualBatchedBitwise) {
  const std::vector<SeqLen> lengths = {{33, 33}, {5, 70}, {64, 64}};
  const Inputs in = make_inputs(lengths, 4, 2, 16, 21);
  TestProblem varlen = make_problem(in, true, Layout::kVarlen);
  TestProblem paged = make_problem(in, true, Layout::kPaged);
  const CpuRun a = expect_matches_oracle(&varlen, DenseParams{});
  const CpuRun b = expect_matches_oracle(&paged, DenseParams{});
  EXPECT_TRUE(same_result(a.out, b.out, 0.0));
  // Batched needs equal s_q: the same three sequences one at a time.
  std::size_t row0 = 0;
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    Inputs one = in;
    one.seqs = {in.seqs[i]};
    TestProblem batched = make_problem(one);
    const CpuRun c = run_cpu_backend(&batched, DenseParams{});
    ASSERT_TRUE(c.status.ok()) << c.status.to_string();
    const std::size_t s_q = static_cast<std::size_t>(lengths[i].s_q);
    const std::size_t row_elems = static_cast<std::size_t>(in.h_q * in.d);
    EXPECT_TRUE(std::equal(c.out.o.begin(), c.out.o.end(), a.out.o.begin() + static_cast<std::ptrdiff_t>(row0 * row_elems)));
    row0 += s_q;
  }
}

TEST(CpuBlockSparse, RandomMasksPerQueryAndPerKvHead) {
  const std::vector<SeqLen> lengths = {{45, 45}, {45, 61}};
  const Inputs in = make_inputs(lengths, 4, 2, 16, 31);
  for (bool per_kv : {false, true}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(std::string(per_kv ? "per kv head" : "per query head") + (causal ? " causal" : " non-causal"));
      TestProblem tp = make_problem(in, causal);
      ProblemShape shape;
      ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
      BlockMask mask = BlockMask::empty(shape, 8, 4, per_kv);
      Random rng(per_kv ? 5 : 6);
      for (int b = 0; b < shape.batch; ++b) {
        const geom::BlockGeometry g = geometry(shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)], causal, 8, 4);
        for (int h = 0; h < mask.heads; ++h) {
          for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
            for (int kb = 0; kb < g.visible_end(qb); ++kb) {
              if (rng.below(2) == 0) ASSERT_TRUE(mask.add(shape, b, h, qb, kb).ok());
            }
          }
        }
      }
      BlockSparseParams p;
      p.mask = mask;
      const CpuRun r = expect_matches_oracle(&tp, p);
      EXPECT_EQ(r.decisions.kept.to_dense(), mask.to_dense());
    }
  }
}

// ------------------------------------------------------------------ exact_gate

TEST(CpuExactGate, MidpointThresholdsCausalChunkedAndNonCausal) {
  struct Case {
    SeqLen len;
    bool causal;
    int bq, bk, h_q, h_kv;
  };
  for (const Case& c : {Case{{113, 113}, true, 8, 8, 4, 1}, Case{{30, 97}, true, 8, 4, 2, 2},
                        Case{{57, 57}, false, 16, 8, 8, 1}, Case{{17, 17}, true, 4, 8, 2, 1}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal"));
    const Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, 16, 41, 2.0);
    const HostTensor thr = midpoint_thresholds(in, c.causal, c.bq, c.bk, 0.5);
    TestProblem tp = make_problem(in, c.causal);
    const CpuRun r = expect_matches_oracle(&tp, gate_params(thr, c.bq, c.bk));
    const std::int64_t visible = visible_blocks({c.len}, c.h_q, c.causal, c.bq, c.bk);
    EXPECT_LT(r.decisions.kept.selected_blocks(), visible);  // the thresholds did skip work
  }
}

TEST(CpuExactGate, NaNValuesOfSkippedBlocksAreNeverRead) {
  // One query block per head (s_q <= block_q) over a long prefix: every block that head skips
  // is read by no other work item, so its V can hold NaN.
  const SeqLen len{8, 120};
  Inputs in = make_inputs({len}, 3, 3, 16, 43, 2.0);
  const HostTensor thr = midpoint_thresholds(in, true, 8, 8, 0.3);
  const ExactGateParams p = gate_params(thr, 8, 8);
  TestProblem clean = make_problem(in);
  const CpuRun want = expect_matches_oracle(&clean, p);
  const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, 8, 8);
  int poisoned = 0;
  for (int h = 0; h < in.h_q; ++h) {
    for (int kb = 0; kb < g.visible_end(0); ++kb) {
      if (want.decisions.kept.contains(0, h, 0, kb)) continue;
      poison_keys(&in, 0, true, h, g.key_begin(kb), g.key_end(kb));
      ++poisoned;
    }
  }
  ASSERT_GT(poisoned, 0);
  TestProblem dirty = make_problem(in);
  const CpuRun got = run_cpu_backend(&dirty, p);
  ASSERT_TRUE(got.status.ok());
  EXPECT_TRUE(same_result(got.out, want.out, 0.0));
  EXPECT_TRUE(same_decisions(want.decisions, got.decisions));
}

// ------------------------------------------------------------------ softmax_skip

SoftmaxSkipParams skip_params(double a, int bq, int bk) {
  SoftmaxSkipParams p;
  p.a = a;
  p.block_q = bq;
  p.block_k = bk;
  return p;
}

// Candidate scale factors a for a context of s_k keys: λ = a / s_k from 0.3 down to 0.003.
std::vector<double> scale_factors(std::int64_t s_k) {
  std::vector<double> out;
  for (double lambda : {0.3, 0.1, 0.03, 0.5, 0.01, 0.003}) out.push_back(lambda * static_cast<double>(s_k));
  return out;
}

TEST(CpuSoftmaxSkip, StableScaleFactorsAgainstOracle) {
  struct Case {
    SeqLen len;
    bool causal;
    int bq, bk, h_q, h_kv;
  };
  for (const Case& c : {Case{{113, 113}, true, 8, 8, 4, 1}, Case{{23, 150}, true, 4, 8, 2, 2},
                        Case{{64, 64}, false, 16, 8, 4, 4}, Case{{80, 50}, true, 8, 4, 2, 1}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal"));
    const Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, 16, 51, 3.0);
    TestProblem tp = make_problem(in, c.causal);
    const std::int64_t visible = visible_blocks({c.len}, c.h_q, c.causal, c.bq, c.bk);
    const double a = stable_parameter(tp, scale_factors(c.len.s_k),
                                      [&](double x) -> Policy { return skip_params(x, c.bq, c.bk); },
                                      some_skipped(visible));
    ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
    expect_matches_oracle(&tp, skip_params(a, c.bq, c.bk));
  }
}

TEST(CpuSoftmaxSkip, OffWhenContextShorterThanA) {
  const Inputs in = make_inputs({{20, 20}}, 2, 1, 16, 53, 3.0);
  TestProblem tp = make_problem(in);
  const CpuRun r = expect_matches_oracle(&tp, skip_params(21.0, 4, 4));
  EXPECT_EQ(r.decisions.kept.selected_blocks(), visible_blocks({{20, 20}}, 2, true, 4, 4));
}

TEST(CpuSoftmaxSkip, NaNValuesOfSkippedBlocksAreNeverRead) {
  const SeqLen len{8, 160};
  Inputs in = make_inputs({len}, 2, 2, 16, 57, 3.0);
  TestProblem clean = make_problem(in);
  const double a = stable_parameter(clean, scale_factors(len.s_k),
                                    [](double x) -> Policy { return skip_params(x, 8, 8); },
                                    some_skipped(visible_blocks({len}, 2, true, 8, 8)));
  ASSERT_FALSE(std::isnan(a));
  const CpuRun want = expect_matches_oracle(&clean, skip_params(a, 8, 8));
  const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, 8, 8);
  for (int h = 0; h < in.h_q; ++h) {
    for (int kb = 0; kb < g.visible_end(0); ++kb) {
      if (!want.decisions.kept.contains(0, h, 0, kb)) poison_keys(&in, 0, true, h, g.key_begin(kb), g.key_end(kb));
    }
  }
  TestProblem dirty = make_problem(in);
  const CpuRun got = run_cpu_backend(&dirty, skip_params(a, 8, 8));
  ASSERT_TRUE(got.status.ok());
  EXPECT_TRUE(same_result(got.out, want.out, 0.0));
}

// ------------------------------------------------------------------ estimate_select


TEST(CpuEstimateSelect, StableAlphaAgainstOracle) {
  struct Case {
    SeqLen len;
    int block, h_q, h_kv;
    bool correction, pack;
    int window;
    double input_scale;
  };
  for (const Case& c : {Case{{113, 113}, 8, 4, 1, false, false, 1, 2.5}, Case{{113, 113}, 8, 4, 1, true, false, 1, 2.5},
                        Case{{40, 131}, 8, 4, 1, true, true, 2, 2.5}, Case{{96, 96}, 4, 8, 2, false, true, 1, 2.5},
                        Case{{60, 45}, 4, 2, 2, true, false, 1, 2.5}, Case{{62, 45}, 4, 2, 1, false, false, 0, 2.5},
                        Case{{70, 70}, 8, 4, 2, true, false, 1, 2.5}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + " block " + std::to_string(c.block) +
                 (c.correction ? " corrected" : "") + (c.pack ? " pack_gqa" : ""));
    const Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, 16, 61, c.input_scale);
    TestProblem tp = make_problem(in);
    const auto params = [&c](double alpha) {
      EstimateSelectParams p = small_estimate_select(alpha, c.block, c.correction, c.pack);
      p.window = c.window;
      return p;
    };
    const int sel_heads = c.pack ? c.h_kv : c.h_q;
    const std::int64_t visible = visible_blocks({c.len}, sel_heads, true, c.block, c.block);
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1, 0.05, 0.7},
                                          [&](double x) -> Policy { return params(x); },
                                          some_skipped(visible));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const CpuRun r = expect_matches_oracle(&tp, params(alpha));
    if (c.correction) EXPECT_GT(r.decisions.corrected.selected_blocks(), 0);
  }
}

TEST(CpuEstimateSelect, MeanCorrectionOfConstantBlocksEqualsDense) {
  // When every key block holds n copies of one token, its pseudo-token (k̄, v̄, weight n) is
  // exactly that block: with mean correction, estimate_select equals dense attention whatever it
  // prunes. Flat attention (small inputs) puts much of the mass in the pruned blocks.
  const int block = 8;
  for (std::int64_t s_k : {100, 131}) {
    SCOPED_TRACE("s_k = " + std::to_string(s_k));
    Inputs in = make_inputs({{s_k - 20, s_k}}, 4, 2, 16, 63, 0.7);
    SequenceData& sd = in.seqs[0];
    for (std::int64_t pos = 0; pos < s_k; ++pos) {
      const std::int64_t src = pos / block * block;
      for (int i = 0; i < in.h_kv * in.d; ++i) {
        set(&sd.k, pos * in.h_kv * in.d + i, get(sd.k, src * in.h_kv * in.d + i));
        set(&sd.v, pos * in.h_kv * in.d + i, get(sd.v, src * in.h_kv * in.d + i));
      }
    }
    TestProblem tp = make_problem(in);
    const CpuRun r = run_cpu_backend(&tp, small_estimate_select(0.9, block, true, false));
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_GT(r.decisions.corrected.selected_blocks(), 10);
    EXPECT_TRUE(matches_reference(tp.problem(), DenseParams{}, tp.output()));
  }
}

TEST(CpuEstimateSelect, PlanMeansAreRoundedToTheInputDtype) {
  // k̄_j and v̄_j: the mean of the block's valid keys, rounded to the input dtype (what the GPU
  // stores); the last block of 45 keys has 5.
  for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Inputs in = make_inputs({{45, 45}}, 2, 2, 16, 65, 1.0, dtype);
    TestProblem tp = make_problem(in);
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    cpu::EstimatePlan plan;
    ASSERT_TRUE(cpu::estimate_select_plan(tp.problem(), shape, small_estimate_select(0.2, 8, true, false), 1, &plan).ok());
    const int nkb = 6;
    ASSERT_EQ(plan.k_mean[0].size(), static_cast<std::size_t>(in.h_kv * nkb * in.d));
    for (const bool value : {false, true}) {
      const HostTensor& x = value ? in.seqs[0].v : in.seqs[0].k;
      const std::vector<float>& got = value ? plan.v_mean[0] : plan.k_mean[0];
      for (int g = 0; g < in.h_kv; ++g) {
        for (int kb = 0; kb < nkb; ++kb) {
          for (int c = 0; c < in.d; ++c) {
            double sum = 0.0;
            const std::int64_t k0 = kb * 8, k1 = std::min<std::int64_t>(k0 + 8, 45);
            for (std::int64_t t = k0; t < k1; ++t) sum += kv(x, in, t, g, c);
            const float want = round_to(dtype, static_cast<float>(sum / static_cast<double>(k1 - k0)));
            ASSERT_EQ(got[static_cast<std::size_t>((g * nkb + kb) * in.d + c)], want) << g << " " << kb << " " << c;
          }
        }
      }
    }
  }
}

TEST(CpuEstimateSelect, AttendReadsOnlyKeptBlocks) {
  // Plan on clean inputs, then attend with K and V of every block the single query tile
  // neither kept nor corrected set to NaN (the means of corrected blocks come from the plan).
  const SeqLen len{8, 120};
  for (bool correction : {false, true}) {
    SCOPED_TRACE(correction ? "mean correction" : "no correction");
    Inputs in = make_inputs({len}, 2, 1, 16, 67, 2.5);
    TestProblem clean = make_problem(in);
    const auto params = [correction](double alpha) {
      EstimateSelectParams p = small_estimate_select(alpha, 8, correction, false);
      p.tail = 0;
      return p;
    };
    const double alpha = stable_parameter(clean, {0.9, 0.8, 0.95, 0.7, 0.5},
                                          [&](double x) -> Policy { return params(x); },
                                          some_skipped(visible_blocks({len}, 2, true, 8, 8)));
    ASSERT_FALSE(std::isnan(alpha));
    const EstimateSelectParams p = params(alpha);
    expect_matches_oracle(&clean, p);
    ProblemShape shape;
    const AttentionOutput clean_out = clean.output();
    ASSERT_TRUE(validate_problem(clean.problem(), &clean_out, &shape).ok());
    cpu::EstimatePlan plan;
    ASSERT_TRUE(cpu::estimate_select_plan(clean.problem(), shape, p, 2, &plan).ok());
    poison(&clean.o);
    ASSERT_TRUE(cpu::estimate_select_attend(clean.problem(), shape, p, plan, clean.output(), 2).ok());
    const ref::Result want = read_output(clean.output(), shape);
    const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, 8, 8);
    int poisoned = 0;
    for (int kb = 0; kb < g.visible_end(0); ++kb) {
      bool read = false;
      for (int h = 0; h < in.h_q; ++h) read |= plan.kept.contains(0, h, 0, kb);
      if (read) continue;
      poison_keys(&in, 0, false, 0, g.key_begin(kb), g.key_end(kb));
      poison_keys(&in, 0, true, 0, g.key_begin(kb), g.key_end(kb));
      ++poisoned;
    }
    ASSERT_GT(poisoned, 0);
    TestProblem dirty = make_problem(in);
    poison(&dirty.o);
    ASSERT_TRUE(cpu::estimate_select_attend(dirty.problem(), shape, p, plan, dirty.output(), 2).ok());
    EXPECT_TRUE(same_result(read_output(dirty.output(), shape), want, 0.0));
  }
}

TEST(CpuEstimateSelect, RequiresCausal) {
  const Inputs in = make_inputs({{16, 16}}, 1, 1, 16, 69);
  TestProblem tp = make_problem(in, false);
  const CpuRun r = run_cpu_backend(&tp, small_estimate_select(0.1, 4, false, false));
  EXPECT_EQ(r.status.code(), StatusCode::kUnsupported);
}

// ------------------------------------------------------------------ permute_stop

PermuteStopParams permute_params(double tau, int segment, int bq, int bk) {
  PermuteStopParams p;
  p.tau = tau;
  p.segment = segment;
  p.block_q = bq;
  p.block_k = bk;
  return p;
}

TEST(CpuPermuteStop, StableTauAgainstOracle) {
  struct Case {
    SeqLen len;
    int segment, bq, bk, h_q, h_kv;
  };
  for (const Case& c : {Case{{113, 113}, 32, 8, 8, 4, 1}, Case{{50, 150}, 40, 8, 16, 2, 2},
                        Case{{97, 97}, 24, 5, 7, 8, 2}, Case{{90, 70}, 16, 4, 4, 2, 1}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + " segment " + std::to_string(c.segment));
    const Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, 16, 71, 2.5);
    TestProblem tp = make_problem(in);
    const auto stopped_some = [](const Decisions& d) {
      bool early = false, later = false;
      for (const PermuteTile& t : d.tiles) {
        early |= t.chunks_visited < t.chunks_total;
        later |= t.chunks_visited > 1;
      }
      return early && later;
    };
    const double tau = stable_parameter(tp, {0.05, 0.02, 0.1, 0.01, 0.005, 0.2},
                                        [&](double x) -> Policy { return permute_params(x, c.segment, c.bq, c.bk); },
                                        stopped_some);
    ASSERT_FALSE(std::isnan(tau)) << "no tau with a margin stops early";
    const CpuRun r = expect_matches_oracle(&tp, permute_params(tau, c.segment, c.bq, c.bk));
    // The query order is a permutation of each segment's rows.
    for (int h = 0; h < in.h_q; ++h) {
      std::vector<std::int32_t> rows(r.decisions.query_order.begin() + static_cast<std::ptrdiff_t>(h * c.len.s_q),
                                     r.decisions.query_order.begin() + static_cast<std::ptrdiff_t>((h + 1) * c.len.s_q));
      std::sort(rows.begin(), rows.end());
      for (std::int64_t i = 0; i < c.len.s_q; ++i) EXPECT_EQ(rows[static_cast<std::size_t>(i)], i);
    }
  }
}

TEST(CpuPermuteStop, TauZeroVisitsEverythingAndEqualsDense) {
  const Inputs in = make_inputs({{70, 90}}, 2, 1, 16, 73);
  TestProblem tp = make_problem(in);
  const CpuRun r = expect_matches_oracle(&tp, permute_params(0.0, 16, 8, 8));
  for (const PermuteTile& t : r.decisions.tiles) EXPECT_EQ(t.chunks_visited, t.chunks_total);
  EXPECT_TRUE(matches_reference(tp.problem(), DenseParams{}, tp.output()));
}

// ------------------------------------------------------------------ across policies

std::vector<Policy> every_policy(const HostTensor& thr) {
  return {DenseParams{},
          gate_params(thr, 8, 8),
          skip_params(0.3, 8, 8),
          small_estimate_select(0.2, 8, true, false),
          small_estimate_select(0.2, 8, false, true),
          permute_params(0.02, 24, 8, 8)};
}

TEST(CpuBackend, ThreadCountDoesNotChangeResults) {
  const Inputs in = make_inputs({{77, 77}}, 4, 2, 16, 81, 2.0);
  const HostTensor thr = midpoint_thresholds(in, true, 8, 8, 0.5);
  for (const Policy& p : every_policy(thr)) {
    SCOPED_TRACE(describe(p));
    TestProblem tp = make_problem(in);
    const CpuRun one = run_cpu_backend(&tp, p, 1);
    const CpuRun two = run_cpu_backend(&tp, p, 2);
    const CpuRun three = run_cpu_backend(&tp, p, 3);
    ASSERT_TRUE(one.status.ok() && two.status.ok() && three.status.ok());
    EXPECT_TRUE(same_result(one.out, two.out, 0.0));
    EXPECT_TRUE(same_result(one.out, three.out, 0.0));
    EXPECT_TRUE(same_decisions(one.decisions, two.decisions));
  }
}

TEST(CpuBackend, VarlenAndPagedEveryPolicy) {
  // Several sequences (one shorter than its keys): varlen and paged give bitwise the same
  // output and decisions, within tolerance of the oracle.
  const std::vector<SeqLen> lengths = {{40, 40}, {17, 60}, {1, 1}};
  const Inputs in = make_inputs(lengths, 4, 1, 16, 83, 2.0);
  HostTensor thr(DType::kFP32, {4, 8});
  for (int i = 0; i < 32; ++i) thr.as<float>()[i] = 1.0f + 0.37f * static_cast<float>(i % 5);
  for (const Policy& p : every_policy(thr)) {
    SCOPED_TRACE(describe(p));
    TestProblem varlen = make_problem(in, true, Layout::kVarlen);
    TestProblem paged = make_problem(in, true, Layout::kPaged);
    const CpuRun a = run_cpu_backend(&varlen, p);
    const CpuRun b = run_cpu_backend(&paged, p);
    ASSERT_TRUE(a.status.ok() && b.status.ok());
    ref::Result ref64;
    EXPECT_TRUE(matches_reference(varlen.problem(), p, varlen.output(), {}, &ref64));
    EXPECT_TRUE(same_decisions(ref64.decisions, a.decisions));
    EXPECT_TRUE(same_result(a.out, b.out, 0.0));
    EXPECT_TRUE(same_decisions(a.decisions, b.decisions));
  }
}

TEST(CpuBackend, OddLengthsEveryPolicy) {
  for (std::int64_t s : {1, 15, 17, 113}) {
    const Inputs in = make_inputs({{s, s}}, 4, 2, 16, 91 + static_cast<std::uint64_t>(s), 2.0);
    const HostTensor thr = midpoint_thresholds(in, true, 8, 8, 0.5);
    for (const Policy& p : every_policy(thr)) {
      SCOPED_TRACE("s = " + std::to_string(s) + " " + describe(p));
      TestProblem tp = make_problem(in);
      const CpuRun r = run_cpu_backend(&tp, p);
      ASSERT_TRUE(r.status.ok()) << r.status.to_string();
      EXPECT_TRUE(matches_reference(tp.problem(), p, tp.output()));
    }
  }
}

TEST(CpuBackend, NaNInputsPropagateWithoutCrashing) {
  Inputs in = make_inputs({{33, 33}}, 2, 1, 16, 95, 2.0);
  poison_keys(&in, 0, false, 0, 10, 11);  // one key
  const HostTensor thr = midpoint_thresholds(make_inputs({{33, 33}}, 2, 1, 16, 95, 2.0), true, 8, 8, 0.5);
  for (const Policy& p : every_policy(thr)) {
    SCOPED_TRACE(describe(p));
    TestProblem tp = make_problem(in);
    const CpuRun r = run_cpu_backend(&tp, p);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    // Rows before the NaN key never see it and stay finite.
    for (std::int64_t row = 0; row < 10; ++row) EXPECT_TRUE(std::isfinite(r.out.lse[static_cast<std::size_t>(row)]));
  }
  TestProblem tp = make_problem(in);
  const CpuRun dense = run_cpu_backend(&tp, DenseParams{});
  for (std::int64_t row = 10; row < 33; ++row) EXPECT_TRUE(std::isnan(dense.out.lse[static_cast<std::size_t>(row)]));
  EXPECT_TRUE(matches_reference(tp.problem(), DenseParams{}, tp.output()));
}

}  // namespace
}  // namespace sparseprefill::test
