// SPDX-License-Identifier: Apache-2.0
// What is particular to the CPU backend (tests/conformance checks it against the oracle with
// every other backend): its vector exp, estimate_select's two launches (the plan's means
// rounded to the input dtype; the attend pass reading K/V of the kept blocks only), results
// independent of the thread count and bitwise the same on every layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
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

// ------------------------------------------------------------------ estimate_select


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

TEST(CpuBackend, LayoutsGiveTheSameBits) {
  // The same sequences (one shorter than its keys, one of a single row) as varlen and as paged
  // K/V: bitwise the same output and decisions for every policy (the kernel-shaped loop reads
  // the same fp32 values in the same order); batched (equal s_q) one sequence at a time, the
  // varlen call's rows of that sequence.
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
    ASSERT_TRUE(a.status.ok() && b.status.ok()) << a.status.to_string() << " / " << b.status.to_string();
    EXPECT_TRUE(same_result(a.out, b.out, 0.0));
    EXPECT_TRUE(same_decisions(a.decisions, b.decisions));
    if (!std::holds_alternative<DenseParams>(p)) continue;
    std::size_t row0 = 0;
    const std::size_t row_elems = static_cast<std::size_t>(in.h_q * in.d);
    for (std::size_t i = 0; i < lengths.size(); ++i) {
      Inputs one = in;
      one.seqs = {in.seqs[i]};
      TestProblem batched = make_problem(one);
      const CpuRun c = run_cpu_backend(&batched, p);
      ASSERT_TRUE(c.status.ok()) << c.status.to_string();
      EXPECT_TRUE(std::equal(c.out.o.begin(), c.out.o.end(), a.out.o.begin() + static_cast<std::ptrdiff_t>(row0 * row_elems)));
      row0 += static_cast<std::size_t>(lengths[i].s_q);
    }
  }
}

}  // namespace
}  // namespace sparseprefill::test
