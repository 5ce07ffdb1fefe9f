// SPDX-License-Identifier: Apache-2.0
// Calibration statistics on the GPU against the host's on the same inputs: exact_gate block
// maxima and softmax_skip's g (calib kernel), estimate_select's energy ratios (the selector),
// and the calibrators' tables fed from either route. Odd lengths, s_q != s_k, GQA, varlen,
// batched seqused_k with NaN capacity, both dtypes, head dims and block sizes; non-finite
// inputs rejected without changing a calibrator; clear errors for what the GPU does not serve.
// The tolerance (docs/cuda.md, "Calibration statistics"): an fp32 score differs from the fp64
// one by at most E = 2^-20 · d · scale · max‖q‖ · max‖k‖ (the fp32 accumulation bound d·2^-24
// with 16x slack); a block maximum by E, g by 2E, a ratio by (4E + 2.5e-4) relative.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/cases.h"
#include "common/inputs.h"
#include "core/geometry.h"
#include "core/rules/estimate_select.h"
#include "gpu_harness.cuh"
#include "sparseprefill/calibration.h"

namespace sparseprefill::test {
namespace {

// A host problem and its device mirror (q and k; v points at k: the statistics never read it).
struct Sample {
  TestProblem tp;
  DeviceBuffer q, k;
  AttentionProblem host, dev;
};

void mirror(Sample* s) {
  s->host = s->tp.problem();
  s->dev = s->host;
  s->dev.q = to_device(s->tp.q, &s->q);
  s->dev.k = to_device(s->tp.k, &s->k);
  s->dev.v = s->dev.k;
}

// E of the header comment, over every query row and key of the inputs.
double score_tolerance(const Inputs& in, double scale) {
  double q_max = 0, k_max = 0;
  auto max_norm = [&](const HostTensor& t, double* out) {
    const std::int64_t d = t.shape().back();
    for (std::int64_t r = 0; r < t.numel() / d; ++r) {
      double n = 0;
      for (std::int64_t i = 0; i < d; ++i) n += get(t, r * d + i) * get(t, r * d + i);
      *out = std::max(*out, std::sqrt(n));
    }
  };
  for (const SequenceData& s : in.seqs) {
    max_norm(s.q, &q_max);
    max_norm(s.k, &k_max);
  }
  return std::ldexp(1.0, -20) * in.d * scale * q_max * k_max;
}

struct Case {
  std::vector<SeqLen> lengths;
  int h_q, h_kv, d;
  DType dtype;
  int block_q, block_k;
  Layout layout;
};

std::string describe_case(const Case& c) {
  std::string s = std::string(dtype_name(c.dtype)) + " d" + std::to_string(c.d) + " h" + std::to_string(c.h_q) + "/" +
                  std::to_string(c.h_kv) + " block " + std::to_string(c.block_q) + "x" + std::to_string(c.block_k) +
                  (c.layout == Layout::kVarlen ? " varlen" : " batched") + " lengths";
  for (const SeqLen& l : c.lengths) s += " " + std::to_string(l.s_q) + "x" + std::to_string(l.s_k);
  return s;
}

const std::vector<Case>& block_cases() {
  static const std::vector<Case> cases = {
      {{{1000, 1000}}, 8, 2, 128, DType::kBF16, 128, 128, Layout::kBatched},
      {{{333, 777}}, 4, 4, 64, DType::kFP16, 64, 64, Layout::kBatched},
      {{{777, 777}}, 6, 2, 64, DType::kBF16, 128, 64, Layout::kBatched},
      {{{200, 200}}, 4, 1, 128, DType::kFP16, 64, 128, Layout::kBatched},
      {{{300, 300}, {129, 500}, {0, 50}, {64, 64}, {17, 1}}, 4, 2, 128, DType::kBF16, 128, 128, Layout::kVarlen},
      // Unequal keys in a batch: the capacity past seqused_k is NaN and must never be read.
      {{{256, 300}, {256, 700}}, 2, 1, 64, DType::kBF16, 128, 64, Layout::kBatched},
  };
  return cases;
}

TEST(CudaCalibration, BlockStatisticsMatchTheHost) {
  SP_REQUIRE_GPU();
  std::uint64_t seed = 11;
  std::int64_t infinite = 0;
  for (const Case& c : block_cases()) {
    SCOPED_TRACE(describe_case(c));
    const Inputs in = random_inputs(c.lengths, c.h_q, c.h_kv, c.d, c.dtype, seed++);
    Sample s;
    s.tp = make_problem(in, true, c.layout);
    mirror(&s);
    std::vector<BlockStatistics> host, gpu;
    ASSERT_TRUE(compute_block_statistics(s.host, c.block_q, c.block_k, true, true, &host).ok());
    const Status st = compute_block_statistics(s.dev, c.block_q, c.block_k, true, true, &gpu);
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_EQ(gpu.size(), c.lengths.size());
    const double e = score_tolerance(in, 1.0 / std::sqrt(static_cast<double>(c.d)));
    std::int64_t compared = 0;
    for (std::size_t b = 0; b < c.lengths.size(); ++b) {
      const BlockStatistics &h = host[b], &d = gpu[b];
      ASSERT_EQ(d.s_q, c.lengths[b].s_q);
      ASSERT_EQ(d.s_k, c.lengths[b].s_k);
      ASSERT_EQ(d.heads, c.h_q);
      ASSERT_EQ(d.block_max.size(), h.block_max.size());
      ASSERT_EQ(d.skip_g.size(), h.skip_g.size());
      const geom::BlockGeometry g = geometry(d.s_q, d.s_k, true, c.block_q, c.block_k);
      const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
      for (int head = 0; head < c.h_q; ++head) {
        for (int qb = 0; qb < nqb; ++qb) {
          const std::size_t row = (static_cast<std::size_t>(head) * nqb + qb) * nkb;
          // The first visited block (BLASST order: the last visible one) has no g.
          const int first = g.visible_end(qb) - 1;
          for (int kb = 0; kb < g.visible_end(qb); ++kb) {
            const double hm = h.block_max[row + kb], dm = d.block_max[row + kb];
            ASSERT_TRUE(std::isfinite(dm)) << "b " << b << " head " << head << " qb " << qb << " kb " << kb;
            ASSERT_LE(std::abs(dm - hm), e) << "block_max b " << b << " head " << head << " qb " << qb << " kb " << kb;
            if (kb == first) continue;
            const double hg = h.skip_g[row + kb], dg = d.skip_g[row + kb];
            if (std::isinf(hg)) {
              ASSERT_EQ(dg, hg) << "g b " << b << " head " << head << " qb " << qb << " kb " << kb;
              ++infinite;
            } else {
              ASSERT_LE(std::abs(dg - hg), 2 * e) << "g b " << b << " head " << head << " qb " << qb << " kb " << kb;
            }
            ++compared;
          }
        }
      }
    }
    EXPECT_GT(compared, 0);
  }
  EXPECT_GT(infinite, 0);  // rows seeing their first keys after others saw some: +inf
}

TEST(CudaCalibration, SelectRatiosMatchTheHost) {
  SP_REQUIRE_GPU();
  const Case cases[] = {
      {{{1000, 1000}}, 8, 2, 128, DType::kBF16, 128, 128, Layout::kBatched},
      {{{333, 900}}, 6, 3, 64, DType::kFP16, 128, 128, Layout::kBatched},
      {{{300, 300}, {129, 500}, {0, 50}, {400, 400}}, 4, 2, 128, DType::kBF16, 128, 128, Layout::kVarlen},
  };
  std::uint64_t seed = 41;
  for (const Case& c : cases) {
    for (bool pack : {false, true}) {
      SCOPED_TRACE(describe_case(c) + (pack ? " pack_gqa" : ""));
      const Inputs in = random_inputs(c.lengths, c.h_q, c.h_kv, c.d, c.dtype, seed++);
      Sample s;
      s.tp = make_problem(in, true, c.layout);
      mirror(&s);
      const EstimateSelectParams base = small_estimate_select(0.1, 128, false, pack);
      std::vector<SelectStatistics> host;
      ASSERT_TRUE(compute_select_statistics(s.host, base, &host).ok());
      // The selector of the path the device's calls take (the Hopper one on an sm_90 device);
      // the statistics have no per-call path override.
      std::vector<SelectStatistics> gpu;
      const Status st = compute_select_statistics(s.dev, base, &gpu);
      ASSERT_TRUE(st.ok()) << st.to_string();
      ASSERT_EQ(gpu.size(), host.size());
      const double rtol = 4 * score_tolerance(in, 1.0 / std::sqrt(static_cast<double>(c.d))) + 2.5e-4;
      std::int64_t compared = 0, peaks = 0;
      for (std::size_t b = 0; b < host.size(); ++b) {
        ASSERT_EQ(gpu[b].units, pack ? c.h_kv : c.h_q);
        ASSERT_EQ(gpu[b].ratio.size(), host[b].ratio.size());
        const geom::BlockGeometry g = geometry(gpu[b].s_q, gpu[b].s_k, true, 128, 128);
        for (int u = 0; u < gpu[b].units; ++u) {
          for (int i = 0; i < g.num_q_blocks(); ++i) {
            const int scored = rules::estimate_scored_blocks(g, i);
            const std::size_t row = (static_cast<std::size_t>(u) * g.num_q_blocks() + i) * g.num_k_blocks();
            for (int j = 0; j < scored; ++j) {
              const double hr = host[b].ratio[row + j], dr = gpu[b].ratio[row + j];
              ASSERT_LE(std::abs(dr - hr), rtol * hr + 1e-30) << "b " << b << " unit " << u << " tile " << i << " block " << j;
              peaks += dr == 1.0;
              ++compared;
            }
          }
        }
      }
      EXPECT_GT(compared, 0);
      EXPECT_GT(peaks, 0);  // every scored tile has its peak at exactly 1
    }
  }
}

// The calibrators fed from the GPU give the host's tables within the statistics' tolerance:
// order statistics move by at most the largest change of their inputs.
TEST(CudaCalibration, CalibratorTablesMatchTheHostRoute) {
  SP_REQUIRE_GPU();
  const Inputs in = random_inputs({{1500, 1500}, {700, 1100}}, 8, 2, 64, DType::kBF16, 77, 1.0, Distribution::kNormal);
  Sample s;
  s.tp = make_problem(in, true, Layout::kVarlen);
  mirror(&s);
  const double e = score_tolerance(in, 1.0 / 8.0);
  const std::vector<int> budgets = {1, 2, 4};
  ExactGateCalibrator gate_host(2, 8, budgets, 128, 64), gate_gpu(2, 8, budgets, 128, 64);
  SoftmaxSkipCalibrator skip_host(2, 128, 64), skip_gpu(2, 128, 64);
  const EstimateSelectParams base = small_estimate_select(0.1, 128);
  EstimateSelectCalibrator select_host(2, base), select_gpu(2, base);
  for (int layer : {0, 1}) {
    ASSERT_TRUE(gate_host.add(layer, s.host).ok());
    ASSERT_TRUE(skip_host.add(layer, s.host).ok());
    ASSERT_TRUE(select_host.add(layer, s.host).ok());
    const Status g = gate_gpu.add(layer, s.dev);
    ASSERT_TRUE(g.ok()) << g.to_string();
    const Status k = skip_gpu.add(layer, s.dev);
    ASSERT_TRUE(k.ok()) << k.to_string();
    const Status e = select_gpu.add(layer, s.dev);
    ASSERT_TRUE(e.ok()) << e.to_string();
  }
  const ThresholdTable th = gate_host.finish(), tg = gate_gpu.finish();
  ASSERT_EQ(tg.positions, th.positions);
  ASSERT_EQ(tg.values.size(), th.values.size());
  int finite = 0;
  for (std::size_t i = 0; i < th.values.size(); ++i) {
    if (std::isinf(th.values[i])) {
      EXPECT_EQ(tg.values[i], th.values[i]) << i;
    } else {
      EXPECT_LE(std::abs(static_cast<double>(tg.values[i]) - th.values[i]), e + 1e-6 * std::abs(th.values[i])) << i;
      ++finite;
    }
  }
  EXPECT_GT(finite, 0);
  for (int layer : {0, 1, -1}) {
    for (double target : {0.2, 0.5, 0.8}) {
      double a_host = 0, a_gpu = 0;
      ASSERT_TRUE(skip_host.factor_for(target, layer, &a_host).ok());
      ASSERT_TRUE(skip_gpu.factor_for(target, layer, &a_gpu).ok());
      EXPECT_LE(std::abs(std::log(a_gpu) - std::log(a_host)), 2 * e) << "layer " << layer << " target " << target;
    }
    for (double target : {0.3, 0.5, 0.7}) {
      double al_host = 0, al_gpu = 0;
      ASSERT_TRUE(select_host.alpha_for(target, layer, &al_host).ok());
      ASSERT_TRUE(select_gpu.alpha_for(target, layer, &al_gpu).ok());
      EXPECT_LE(std::abs(al_gpu - al_host), (4 * e + 2.5e-4) * al_host + 1e-30) << "layer " << layer << " target " << target;
    }
  }
}

// A NaN query makes the GPU statistics NaN: every calibrator rejects the sample and stays as
// it was (no thresholds, no factor).
TEST(CudaCalibration, NonFiniteQueriesAreRejectedWithoutChangingTheCalibrator) {
  SP_REQUIRE_GPU();
  Inputs in = random_inputs({{400, 400}}, 2, 1, 64, DType::kBF16, 5);
  set(&in.seqs[0].q, (300 * 2 + 1) * 64 + 7, std::numeric_limits<double>::quiet_NaN());
  Sample s;
  s.tp = make_problem(in);
  mirror(&s);
  ExactGateCalibrator gate(1, 2, {1}, 128, 128);
  SoftmaxSkipCalibrator skip(1, 128, 128);
  EstimateSelectCalibrator select(1, small_estimate_select(0.1, 128));
  const Status g = gate.add(0, s.dev), k = skip.add(0, s.dev), e = select.add(0, s.dev);
  for (const Status* st : {&g, &k, &e}) {
    EXPECT_EQ(st->code(), StatusCode::kInvalidArgument) << st->to_string();
    EXPECT_NE(st->message().find("non-finite q or k"), std::string::npos) << st->to_string();
  }
  EXPECT_EQ(gate.finish().positions, 0);
  double a = 0;
  EXPECT_FALSE(skip.factor_for(0.5, 0, &a).ok());
  EXPECT_FALSE(select.alpha_for(0.5, 0, &a).ok());
}

TEST(CudaCalibration, UnsupportedCombinationsSayWhatIsMissing) {
  SP_REQUIRE_GPU();
  Sample s;
  s.tp = make_problem(random_inputs({{256, 256}}, 2, 1, 64, DType::kBF16, 3));
  mirror(&s);
  std::vector<BlockStatistics> stats;
  const Status blocks = compute_block_statistics(s.dev, 32, 128, true, true, &stats);
  EXPECT_EQ(blocks.code(), StatusCode::kUnsupported);
  EXPECT_NE(blocks.message().find("block_q and block_k of 64 or 128"), std::string::npos) << blocks.to_string();
  std::vector<SelectStatistics> sel;
  const Status select = compute_select_statistics(s.dev, small_estimate_select(0.1, 64), &sel);
  EXPECT_EQ(select.code(), StatusCode::kUnsupported);
  EXPECT_NE(select.message().find("block = 128"), std::string::npos) << select.to_string();
  Sample f;
  f.tp = make_problem(random_inputs({{256, 256}}, 2, 1, 64, DType::kFP32, 3));
  mirror(&f);
  const Status fp32 = compute_block_statistics(f.dev, 128, 128, true, false, &stats);
  EXPECT_EQ(fp32.code(), StatusCode::kUnsupported);
  EXPECT_NE(fp32.message().find("fp32"), std::string::npos) << fp32.to_string();
}

}  // namespace
}  // namespace sparseprefill::test
