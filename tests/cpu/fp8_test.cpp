// SPDX-License-Identifier: Apache-2.0
// FP8 (e4m3) inputs with per-(batch, kv head) descales: the codec against the format's
// definition, validation, the oracle on the dequantized values (exactly) and the CPU backend
// (exactly against its own run on the dequantized values, and within one bf16 rounding of the
// oracle).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "common/cases.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/results.h"
#include "common/tolerance.h"
#include "core/geometry.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Code c's value from the definition of E4M3 (OCP "e4m3fn"): bias 7, 3 mantissa bits,
// subnormals m/8 · 2^-6, S.1111.111 NaN, no infinity.
double e4m3_value(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  if (e == 15 && m == 7) return kNaN;
  const double mag = e == 0 ? m / 8.0 * std::ldexp(1.0, -6) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (c & 0x80) != 0 ? -mag : mag;
}

TEST(Fp8, DecodesEveryCodeAndEncodesItBack) {
  for (int c = 0; c < 256; ++c) {
    SCOPED_TRACE(c);
    const float v = e4m3_to_float(static_cast<std::uint8_t>(c));
    const double want = e4m3_value(c);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(v));
      EXPECT_EQ(float_to_e4m3(v) & 0x7F, 0x7F);
      continue;
    }
    EXPECT_EQ(static_cast<double>(v), want);
    EXPECT_EQ(std::signbit(v), (c & 0x80) != 0);  // -0 too
    EXPECT_EQ(float_to_e4m3(v), c);
  }
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_float(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));
}

TEST(Fp8, EncodingRoundsToNearestEvenAndOverflowsToNaN) {
  // Between each pair of consecutive finite positive codes (across the subnormal/normal and
  // every binade boundary): the midpoint goes to the even code, its neighbours to the nearer.
  for (int c = 0; c < 0x7E; ++c) {
    SCOPED_TRACE(c);
    const auto lo = static_cast<float>(e4m3_value(c)), hi = static_cast<float>(e4m3_value(c + 1));
    const float mid = (lo + hi) / 2;  // exact: both have at most 4 significant bits
    EXPECT_EQ(float_to_e4m3(mid), c % 2 == 0 ? c : c + 1);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, lo)), c);
    EXPECT_EQ(float_to_e4m3(std::nextafter(mid, hi)), c + 1);
    EXPECT_EQ(float_to_e4m3(-mid), (c % 2 == 0 ? c : c + 1) | 0x80);
  }
  // 448 is the largest finite value; 464 (halfway to the absent 480) ties to it; above, NaN.
  EXPECT_EQ(float_to_e4m3(464.0f), 0x7E);
  EXPECT_EQ(float_to_e4m3(std::nextafter(464.0f, 1e9f)) & 0x7F, 0x7F);
  EXPECT_EQ(float_to_e4m3(1e6f), 0x7F);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::infinity()), 0x7F);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFF);
  EXPECT_EQ(float_to_e4m3(std::numeric_limits<float>::quiet_NaN()) & 0x7F, 0x7F);
  // Half the smallest subnormal ties to zero; less is zero with its sign.
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(float_to_e4m3(-1e-6f), 0x80);
  EXPECT_EQ(round_to(DType::kFP8E4M3, 0.3f), e4m3_to_float(float_to_e4m3(0.3f)));
  EXPECT_EQ(dtype_size(DType::kFP8E4M3), 1u);
  EXPECT_EQ(std::string(dtype_name(DType::kFP8E4M3)), "fp8_e4m3");
}

HostTensor descales(int batch, int h_kv, double base) {
  HostTensor t(DType::kFP32, {batch, h_kv});
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < h_kv; ++h) set(&t, b * h_kv + h, base * std::ldexp(1.0, (b + 2 * h) % 3 - 1));
  }
  return t;
}

// An fp8 problem with power-of-two descales (2^-1 .. 2^1 times `base`, per (b, kv head)) and
// its twin in fp32 (or `twin`) holding the dequantized values, which are exact in fp32 and in
// bf16 (E4M3's 4 significant bits times a power of two). The bf16 twin stores estimate_select's
// block means as the fp8 problem does (block_mean_dtype), the fp32 one rounds them to fp32.
struct Twins {
  Inputs in8, in32;
  TestProblem p8, p32;
};

Twins make_twins(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed, bool causal,
                 Layout layout = Layout::kBatched, DType twin = DType::kFP32) {
  Twins t;
  t.in8 = random_inputs(lengths, h_q, h_kv, d, DType::kFP8E4M3, seed, 3.0);
  t.in32 = empty_inputs(lengths, h_q, h_kv, d, twin);
  const int batch = static_cast<int>(lengths.size());
  const HostTensor qd = descales(batch, h_kv, 0.5), kd = descales(batch, h_kv, 1.0), vd = descales(batch, h_kv, 2.0);
  for (int b = 0; b < batch; ++b) {
    const SequenceData& s8 = t.in8.seqs[static_cast<std::size_t>(b)];
    SequenceData& s32 = t.in32.seqs[static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < s8.q.numel(); ++i) {
      const int hk = static_cast<int>(i / d % h_q) / (h_q / h_kv);
      set(&s32.q, i, get(s8.q, i) * get(qd, b * h_kv + hk));
    }
    for (std::int64_t i = 0; i < s8.k.numel(); ++i) {
      const int hk = static_cast<int>(i / d % h_kv);
      set(&s32.k, i, get(s8.k, i) * get(kd, b * h_kv + hk));
      set(&s32.v, i, get(s8.v, i) * get(vd, b * h_kv + hk));
    }
  }
  t.p8 = make_problem(t.in8, causal, layout);
  t.p8.q_descale = qd;
  t.p8.k_descale = kd;
  t.p8.v_descale = vd;
  t.p32 = make_problem(t.in32, causal, layout);
  return t;
}

BlockSparseParams random_mask(const TestProblem& tp, int bq, int bk, std::uint64_t seed) {
  ProblemShape shape;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  BlockSparseParams p;
  p.mask = BlockMask::empty(shape, bq, bk, false);
  Random rng(seed);
  for (int b = 0; b < shape.batch; ++b) {
    const geom::BlockGeometry g =
        geometry(shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)], shape.causal, bq, bk);
    for (int h = 0; h < p.mask.heads; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        for (int kb = 0; kb < g.visible_end(qb); ++kb) {
          if (rng.below(3) != 0) EXPECT_TRUE(p.mask.add(shape, b, h, qb, kb).ok());
        }
      }
    }
  }
  return p;
}

TEST(Fp8, ValidationNamesTheArgument) {
  Twins t = make_twins({{40, 40}, {17, 30}}, 4, 2, 16, 11, true);
  ProblemShape s;
  const AttentionOutput out = t.p8.output();
  ASSERT_TRUE(validate_problem(t.p8.problem(), &out, &s).ok());
  EXPECT_EQ(s.dtype, DType::kFP8E4M3);
  EXPECT_EQ(s.out_dtype(), DType::kBF16);
  auto expect_error = [](const Status& st, const std::string& fragment) {
    EXPECT_FALSE(st.ok()) << fragment;
    EXPECT_NE(st.message().find(fragment), std::string::npos) << st.message();
  };
  {  // O must be bf16
    TestProblem tp = t.p8;
    tp.o = HostTensor(DType::kFP8E4M3, tp.q.shape());
    const AttentionOutput o = tp.output();
    expect_error(validate_problem(tp.problem(), &o, &s), "o: expected dtype bf16 (fp8_e4m3 inputs give a bf16 output)");
  }
  {  // descales only with fp8 inputs
    TestProblem tp = t.p32;
    tp.k_descale = descales(2, 2, 1.0);
    expect_error(validate_problem(tp.problem(), nullptr, &s), "k_descale: only with fp8_e4m3 inputs");
  }
  {  // [b, h_kv] fp32
    TestProblem tp = t.p8;
    tp.q_descale = HostTensor(DType::kFP32, {2, 4});
    expect_error(validate_problem(tp.problem(), nullptr, &s), "q_descale: expected fp32 [b, h_kv] = [2, 2]");
    tp.q_descale = HostTensor(DType::kBF16, {2, 2});
    expect_error(validate_problem(tp.problem(), nullptr, &s), "q_descale: expected fp32 [b, h_kv]");
  }
  {  // finite
    TestProblem tp = t.p8;
    set(&tp.v_descale, 2, kNaN);
    expect_error(validate_problem(tp.problem(), nullptr, &s), "v_descale[1, 0]: expected a finite number");
  }
  {  // one input dtype
    TestProblem tp = t.p8;
    tp.k = HostTensor(DType::kBF16, tp.k.shape());
    expect_error(validate_problem(tp.problem(), nullptr, &s), "k, v: expected q's dtype fp8_e4m3");
  }
  // No calibration on fp8 samples (thresholds come from the model's 16-bit activations).
  std::vector<BlockStatistics> stats;
  const Status cal = compute_block_statistics(t.p8.problem(), 16, 16, true, false, &stats);
  EXPECT_EQ(cal.code(), StatusCode::kUnsupported);
  expect_error(cal, "calibration takes bf16, fp16 or fp32 samples, got fp8_e4m3");
  // estimate_select's cache of block means holds bf16 for fp8 inputs (block_mean_dtype).
  for (DType dtype : {DType::kFP8E4M3, DType::kFP32}) {
    HostTensor k(dtype, {2, 2, 3, 16}), v(dtype, {2, 2, 3, 16}), valid(DType::kInt32, {2});
    EstimateSelectParams p = small_estimate_select(0.2, 8);
    p.k_block_means = k.view();
    p.v_block_means = v.view();
    p.block_means_valid = valid.view();
    for (Backend backend : {Backend::kReference, Backend::kCPU}) {
      RunOptions opt;
      opt.backend = backend;
      const Status st = run(t.p8.problem(), p, t.p8.output(), opt);
      EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << dtype_name(dtype);
      expect_error(st, "k_block_means: expected [batch = 2, h_kv = 2, max_blocks >= 5, d = 16] bf16 on q's device");
    }
  }
}

// Every policy on fp8 inputs, small blocks: exact_gate at a threshold that keeps some blocks,
// softmax_skip, estimate_select without and with mean correction, permute_stop (the last three
// causal only).
std::vector<Policy> every_policy(int h_q, HostTensor* thresholds, bool causal) {
  ExactGateParams gate;
  gate.block_q = 16;
  gate.block_k = 8;
  *thresholds = HostTensor(DType::kFP32, {h_q, 1});
  for (std::int64_t i = 0; i < thresholds->numel(); ++i) set(thresholds, i, 0.5);
  gate.thresholds = thresholds->view();
  SoftmaxSkipParams skip;
  skip.block_q = 16;
  skip.block_k = 8;
  skip.a = 40.0;
  std::vector<Policy> out = {Policy{gate}, Policy{skip}};
  if (causal) {
    PermuteStopParams permute;
    permute.segment = 32;
    permute.tau = 0.01;
    permute.block_q = 16;
    permute.block_k = 8;
    out.insert(out.end(), {Policy{small_estimate_select(0.2, 8)}, Policy{small_estimate_select(0.2, 8, true)},
                           Policy{permute}});
  }
  return out;
}

// The oracle runs on the dequantized values: with power-of-two descales its results equal,
// bit for bit, those on the fp32 twin.
TEST(Fp8, OracleEqualsTheOracleOnDequantizedValues) {
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    const Twins t = make_twins({{70, 70}, {33, 90}, {5, 0}}, 6, 2, 32, 21, causal, Layout::kVarlen);
    for (const Policy& p : {Policy{DenseParams{}}, Policy{random_mask(t.p8, 16, 8, 3)}}) {
      SCOPED_TRACE(policy_name(p));
      ref::Result r8, r32;
      ASSERT_TRUE(ref::run_reference(t.p8.problem(), p, &r8).ok());
      ASSERT_TRUE(ref::run_reference(t.p32.problem(), p, &r32).ok());
      ASSERT_EQ(r8.o.size(), r32.o.size());
      for (std::size_t i = 0; i < r8.o.size(); ++i) ASSERT_EQ(r8.o[i], r32.o[i]) << i;
      for (std::size_t i = 0; i < r8.lse.size(); ++i) ASSERT_EQ(r8.lse[i], r32.lse[i]) << i;
    }
  }
}

// Every policy decides on the dequantized values: on fp8 inputs the oracle's decisions and
// results equal its own on the bf16 twin bit for bit (estimate_select's means are bf16 in both),
// and each policy decides something (neither all blocks kept nor none).
TEST(Fp8, EveryPolicyOfTheOracleEqualsItOnDequantizedValues) {
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    const Twins t = make_twins({{70, 70}, {33, 90}, {5, 0}}, 6, 2, 32, 22, causal, Layout::kVarlen, DType::kBF16);
    HostTensor thresholds;
    for (const Policy& p : every_policy(t.in8.h_q, &thresholds, causal)) {
      SCOPED_TRACE(policy_name(p));
      ref::Result r8, r16;
      ASSERT_TRUE(ref::run_reference(t.p8.problem(), p, &r8).ok());
      ASSERT_TRUE(ref::run_reference(t.p32.problem(), p, &r16).ok());
      EXPECT_TRUE(same_decisions(r16.decisions, r8.decisions));
      EXPECT_TRUE(same_result(r8, r16, 0.0));
      RunOptions opt;
      opt.backend = Backend::kReference;
      RunStats stats;
      TestProblem tp = t.p8;
      ASSERT_TRUE(run(tp.problem(), p, tp.output(), opt, &stats).ok());
      EXPECT_GT(stats.pair_density(), 0.0);
      EXPECT_LT(stats.pair_density(), 1.0);
    }
  }
}

RunOptions cpu_options() {
  RunOptions opt;
  opt.backend = Backend::kCPU;
  opt.num_threads = 2;
  return opt;
}

// Two runs' LSE bit for bit (NaN where the other is NaN).
void expect_same_lse(const HostTensor& got, const HostTensor& want) {
  ASSERT_EQ(got.numel(), want.numel());
  for (std::int64_t i = 0; i < got.numel(); ++i) {
    const float a = got.as<float>()[i], b = want.as<float>()[i];
    ASSERT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << i;
  }
}

// The CPU backend on fp8 inputs computes exactly what it computes on the fp32 twin, O then
// rounded to bf16 instead of stored as fp32; and within one bf16 rounding of the oracle with
// descales that are not powers of two.
TEST(Fp8, CpuBackendEqualsItsRunOnDequantizedValues) {
  const RunOptions opt = cpu_options();
  for (Layout layout : {Layout::kBatched, Layout::kPaged}) {
    SCOPED_TRACE(layout == Layout::kPaged ? "paged" : "batched");
    Twins t = make_twins({{70, 70}, {33, 90}}, 4, 1, 32, 31, true, layout);
    for (const Policy& p : {Policy{DenseParams{}}, Policy{random_mask(t.p8, 16, 16, 4)}}) {
      SCOPED_TRACE(policy_name(p));
      ASSERT_TRUE(run(t.p8.problem(), p, t.p8.output(), opt).ok());
      ASSERT_TRUE(run(t.p32.problem(), p, t.p32.output(), opt).ok());
      ASSERT_EQ(t.p8.o.numel(), t.p32.o.numel());
      for (std::int64_t i = 0; i < t.p8.o.numel(); ++i) {
        ASSERT_EQ(t.p8.o.as<std::uint16_t>()[i], float_to_bf16(t.p32.o.as<float>()[i])) << i;
      }
      expect_same_lse(t.p8.lse, t.p32.lse);
      // Against the oracle, descales 0.3 / 1.7 / 0.9 (not powers of two): the fp32 compute's
      // error plus O's bf16 rounding stays within one bf16 unit of the largest output.
      TestProblem odd = t.p8;
      for (int i = 0; i < 2; ++i) {
        set(&odd.q_descale, i, 0.3);
        set(&odd.k_descale, i, 1.7);
        set(&odd.v_descale, i, 0.9);
      }
      ASSERT_TRUE(run(odd.problem(), p, odd.output(), opt).ok());
      Tolerance tight;
      tight.factor = 0.0;
      EXPECT_TRUE(matches_reference(odd.problem(), p, odd.output(), tight));
    }
  }
}

// The CPU backend runs every policy on fp8 inputs as on their bf16 twin: the same decisions and
// the same bf16 O and LSE, bit for bit (contiguous and paged K/V). The descales' own handling
// (any value, each element reaching its (batch, kv head)) is the dense tests' above: the policies
// read the same dequantized values.
TEST(Fp8, EveryPolicyOfTheCpuBackendEqualsItOnDequantizedValues) {
  const RunOptions opt = cpu_options();
  for (Layout layout : {Layout::kBatched, Layout::kPaged}) {
    SCOPED_TRACE(layout == Layout::kPaged ? "paged" : "batched");
    Twins t = make_twins({{70, 70}, {33, 90}}, 4, 2, 32, 32, true, layout, DType::kBF16);
    HostTensor thresholds;
    for (const Policy& p : every_policy(t.in8.h_q, &thresholds, true)) {
      SCOPED_TRACE(policy_name(p));
      Decisions d8, d16;
      ASSERT_TRUE(run(t.p8.problem(), p, t.p8.output(), opt, nullptr, &d8).ok());
      ASSERT_TRUE(run(t.p32.problem(), p, t.p32.output(), opt, nullptr, &d16).ok());
      EXPECT_TRUE(same_decisions(d16, d8));
      ASSERT_EQ(t.p8.o.numel(), t.p32.o.numel());
      for (std::int64_t i = 0; i < t.p8.o.numel(); ++i) {
        ASSERT_EQ(t.p8.o.as<std::uint16_t>()[i], t.p32.o.as<std::uint16_t>()[i]) << i;
      }
      expect_same_lse(t.p8.lse, t.p32.lse);
    }
  }
}

}  // namespace
}  // namespace sparseprefill::test
