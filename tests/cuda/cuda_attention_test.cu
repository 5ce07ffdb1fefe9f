// SPDX-License-Identifier: Apache-2.0
// What is particular to the CUDA backend's attention (tests/conformance checks every policy,
// layout and hostile input against the oracle on the portable and the Hopper kernels alike):
// the path override; long sequences and running maxima that trend along the keys (the kernels'
// lazy rescaling); bitwise equalities between kernels that share their steps (an all-visible
// mask and dense, a kept-all gate and dense on the Hopper kernel, packed GQA tiles and unpacked
// ones, paged K/V and contiguous at every page size, read through the table or staged; a local
// window that hides nothing and none);
// exact_gate in one pass and in two, with decisions split across the Hopper kernel's
// warpgroups and heads; what is not compiled; CUDA graph capture, and plans captured without
// warm-up. Cases run on the default path (the plan's choice: on an sm_90 device the Hopper
// kernels where they serve the call, asserted through RunStats::execution) and on the portable
// kernels (forced through RunOptions::overrides).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/cases.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/poison.h"
#include "common/results.h"
#include "common/tolerance.h"
#include "core/geometry.h"
#include "gpu_harness.cuh"
#include "reference/reference.h"
#include "sparseprefill/attention.h"
#include "sparseprefill/plan.h"

namespace sparseprefill::test {
namespace {

constexpr int kBlockQ = 128;  // block_q of every policy on CUDA

Inputs make_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                   DType dtype = DType::kBF16, double scale = 1.5) {
  return random_inputs(lengths, h_q, h_kv, d, dtype, seed, scale);
}

ExactGateParams gate(const HostTensor& thr, int bk) { return gate_params(thr, kBlockQ, bk); }

// The runs of a case in that order: on the default path, then on the portable kernels, each
// within the calibrated tolerance of the oracle, every element written, exactly the oracle's
// decisions, on the path it must take (`overrides` apply to both).
std::vector<GpuRun> expect_both_paths_match(TestProblem* tp, const Policy& policy, const ExecutionOverrides& overrides = {}) {
  const ref::Result ref64 = oracle(*tp, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(tp->problem(), policy, ref64.decisions, &lowp);
  EXPECT_TRUE(st.ok()) << st.to_string();
  const bool paged = tp->problem().block_table.defined();
  std::vector<GpuRun> runs;
  for (bool portable : {false, true}) {
    SCOPED_TRACE(portable ? "portable path" : "default path");
    GpuRun r = run_gpu(tp, policy, nullptr, on_path(portable, overrides));
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    if (r.status.ok()) {
      expect_ran(r, policy, expected_path(policy, portable, paged && !r.stats.execution.kv_staged), paged && !r.stats.execution.kv_staged);
      EXPECT_TRUE(fully_written(r.out, ref64));
      EXPECT_TRUE(close_calibrated(tp->q.dtype(), r.out, ref64, lowp));
      EXPECT_TRUE(same_decisions(ref64.decisions, r.decisions));
    }
    runs.push_back(std::move(r));
  }
  return runs;
}

ExecutionOverrides passes(int n) {
  ExecutionOverrides o;
  o.gate_passes = n;
  return o;
}

// ------------------------------------------------------------------ dense

// overrides.cuda_path (SPARSEPREFILL_CUDA_PATH's per-call form) = portable sends a call the
// plan would give the Hopper kernel to the portable one; = hopper runs the Hopper kernel on a
// 9.0 device and fails elsewhere naming the path; without it the plan chooses.
// RunStats::execution names what ran.
TEST(CudaDense, PathOverrideForcesEitherPath) {
  SP_REQUIRE_GPU();
  Inputs in = make_inputs({{300, 300}}, 4, 2, 128, 1700);
  TestProblem tp = make_problem(in);
  const GpuRun forced = run_gpu(&tp, DenseParams{}, nullptr, on_path(true));
  ASSERT_TRUE(forced.status.ok()) << forced.status.to_string();
  expect_ran(forced, DenseParams{}, "cuda-portable", false);
  ExecutionOverrides hopper;
  hopper.cuda_path = ExecutionOverrides::CudaPath::kHopper;
  const GpuRun on_hopper = run_gpu(&tp, DenseParams{}, nullptr, hopper);
  if (hopper_device()) {
    ASSERT_TRUE(on_hopper.status.ok()) << on_hopper.status.to_string();
    expect_ran(on_hopper, DenseParams{}, "cuda-hopper", false);
  } else {
    EXPECT_EQ(on_hopper.status.code(), StatusCode::kUnsupported);
    EXPECT_NE(on_hopper.status.message().find("hopper"), std::string::npos) << on_hopper.status.message();
  }
  const GpuRun chosen = run_gpu(&tp, DenseParams{});
  ASSERT_TRUE(chosen.status.ok()) << chosen.status.to_string();
  expect_ran(chosen, DenseParams{}, expected_path(DenseParams{}, false, false), false);
}

// Sizes past what the conformance suite's oracle affords in CI: many row and key tiles, and
// the grid orders of a long sequence.
TEST(CudaDense, LongSequence4224) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{4224, 4224}}, 2, 1, 64, 400, DType::kFP16);
  TestProblem tp = make_problem(in);
  expect_both_paths_match(&tp, DenseParams{});
}

// Scores that trend along the keys: every query has q[0] = 1 and key t has k[t][0] = slope·t,
// so a row's running max rises by about |slope|·64·scale·log2(e) per 64 keys visited in the
// trend's direction (d = 128: 0.8, 4 and 33 in the log2 domain); both signs, since the Hopper
// kernel visits tiles last first. The kernels keep a warp's running max while no row outgrows
// it by more than 8 (softmax.cuh, kLazyMaxLog2): the gentle slopes run many steps on a stale
// max (p up to 2^8) before a rescale, the steep ones rescale at every step. Within the
// oracle's tolerance on both paths, causal and not.
TEST(CudaDense, RunningMaxTrendingAlongTheKeys) {
  SP_REQUIRE_GPU();
  for (double slope : {-4.0, -0.5, -0.1, 0.1, 0.5, 4.0}) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE("slope " + std::to_string(slope) + (causal ? ", causal" : ", non-causal"));
      Inputs in = make_inputs({{700, 1500}}, 4, 2, 128, 460);
      SequenceData& seq = in.seqs[0];
      for (std::int64_t t = 0; t < 700; ++t) {
        for (int h = 0; h < in.h_q; ++h) set(&seq.q, (t * in.h_q + h) * in.d, 1.0);
      }
      for (std::int64_t t = 0; t < 1500; ++t) {
        for (int g = 0; g < in.h_kv; ++g) set(&seq.k, (t * in.h_kv + g) * in.d, slope * static_cast<double>(t));
      }
      TestProblem tp = make_problem(in, causal);
      expect_both_paths_match(&tp, DenseParams{});
    }
  }
}

// ------------------------------------------------------------------ block_sparse

TEST(CudaBlockSparse, AllVisibleMaskEqualsDenseBitwise) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{600, 800}}, 4, 2, 128, 600);
  TestProblem tp = make_problem(in);
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  // block_k 64 on the portable kernel: the same 64-key steps in the same order as dense, so the
  // same roundings (the Hopper kernel tiles keys by 128).
  BlockSparseParams p;
  p.mask = BlockMask::all_visible(shape, kBlockQ, 64, false);
  const GpuRun sparse = run_gpu(&tp, p, nullptr, on_path(true));
  const GpuRun dense = run_gpu(&tp, DenseParams{}, nullptr, on_path(true));
  ASSERT_TRUE(sparse.status.ok() && dense.status.ok()) << sparse.status.to_string() << " / " << dense.status.to_string();
  EXPECT_TRUE(same_result(sparse.out, dense.out, 0.0));
  if (!hopper_device()) return;
  // block_k 128 on the Hopper kernel: the partial then the full list, each descending, are
  // dense's descending tiles, through the same code.
  p.mask = BlockMask::all_visible(shape, kBlockQ, 128, false);
  const GpuRun sparse128 = run_gpu(&tp, p);
  const GpuRun dense90 = run_gpu(&tp, DenseParams{});
  ASSERT_TRUE(sparse128.status.ok() && dense90.status.ok());
  expect_ran(sparse128, p, "cuda-hopper", false);
  expect_ran(dense90, DenseParams{}, "cuda-hopper", false);
  EXPECT_TRUE(same_result(sparse128.out, dense90.out, 0.0));
}

// ------------------------------------------------------------------ fp8

// FP8's error does not grow with the number of keys a row sums. A long row holds many small
// terms p = exp2(x - m): in [0, 1] e4m3 flushes those below 2^-10 to zero and keeps few bits of
// those below 2^-6, a growing share of the row's mass as keys are added (the kernel's running
// max sits 2^7 low so that they stay in range), and a row sum kept in an FP8 wgmma's accumulator
// would lose the small terms' bits as well (it adds at about 14 significant bits). Reference:
// the bf16 kernel on the same values (e4m3 -> bf16 is exact), whose own error is far smaller;
// FP8's O and LSE errors against it at 32K keys stay within 1.5x / 2x (+ slack) those at 2K.
TEST(CudaFp8, ErrorDoesNotGrowWithTheKeyCount) {
  SP_REQUIRE_GPU();
  if (!hopper_device()) GTEST_SKIP() << "fp8_e4m3 inputs run on the Hopper kernel only";
  struct Err {
    double o_rel_l2 = 0.0, lse_max = 0.0;
  };
  auto errors = [](std::int64_t s_k) {
    Err e;
    const Inputs in8 = random_inputs({{256, s_k}}, 2, 1, 128, DType::kFP8E4M3, 4242, 3.0);
    Inputs in16 = empty_inputs({{256, s_k}}, 2, 1, 128, DType::kBF16);
    for (std::size_t b = 0; b < in8.seqs.size(); ++b) {
      const SequenceData& f = in8.seqs[b];
      SequenceData& t = in16.seqs[b];
      for (std::int64_t i = 0; i < f.q.numel(); ++i) set(&t.q, i, get(f.q, i));
      for (std::int64_t i = 0; i < f.k.numel(); ++i) set(&t.k, i, get(f.k, i));
      for (std::int64_t i = 0; i < f.v.numel(); ++i) set(&t.v, i, get(f.v, i));
    }
    TestProblem p8 = make_problem(in8, /*causal=*/false);
    TestProblem p16 = make_problem(in16, /*causal=*/false);
    const GpuRun r8 = run_gpu(&p8, Policy{DenseParams{}});
    const GpuRun r16 = run_gpu(&p16, Policy{DenseParams{}});
    EXPECT_TRUE(r8.status.ok()) << r8.status.to_string();
    EXPECT_TRUE(r16.status.ok()) << r16.status.to_string();
    if (!r8.status.ok() || !r16.status.ok()) return e;
    EXPECT_EQ(r8.stats.execution.instance, "fwd_sm90_fp8_hd128");
    double num = 0.0, den = 0.0;
    for (std::size_t i = 0; i < r16.out.o.size(); ++i) {
      const double d = r8.out.o[i] - r16.out.o[i];
      num += d * d;
      den += r16.out.o[i] * r16.out.o[i];
    }
    e.o_rel_l2 = std::sqrt(num / den);
    for (std::size_t i = 0; i < r16.out.lse.size(); ++i) {
      e.lse_max = std::max(e.lse_max, std::abs(r8.out.lse[i] - r16.out.lse[i]));
    }
    return e;
  };
  const Err short_rows = errors(2048), long_rows = errors(32768);
  SCOPED_TRACE("O rel. L2 " + std::to_string(short_rows.o_rel_l2) + " at 2K keys, " +
               std::to_string(long_rows.o_rel_l2) + " at 32K; LSE max " + std::to_string(short_rows.lse_max) +
               " / " + std::to_string(long_rows.lse_max));
  EXPECT_GT(short_rows.o_rel_l2, 0.0);  // the two kernels do differ: P is e4m3 in one of them
  EXPECT_LE(long_rows.o_rel_l2, 1.5 * short_rows.o_rel_l2);
  EXPECT_LE(long_rows.lse_max, 2.0 * short_rows.lse_max + 1e-3);
}

// ------------------------------------------------------------------ exact_gate

// The Hopper kernel gates 128-key tiles with dense's softmax steps: a kept-all gate (T = -inf)
// is dense, bit for bit (on the portable kernel the gated instance takes the exact
// running-max update and dense the lazy one, so their P roundings differ).
TEST(CudaExactGate, KeptAllGateOnTheHopperKernelIsDenseBitwise) {
  SP_REQUIRE_GPU();
  if (!hopper_device()) GTEST_SKIP() << "the Hopper kernels need a compute capability 9.0 device";
  const Inputs in = make_inputs({{500, 700}}, 4, 1, 128, 800);
  TestProblem tp = make_problem(in);
  HostTensor thr(DType::kFP32, {4, 3});
  for (int i = 0; i < 12; ++i) thr.as<float>()[i] = -std::numeric_limits<float>::infinity();
  for (int n : {1, 2}) {
    SCOPED_TRACE(std::to_string(n) + " pass(es)");
    const GpuRun gated = run_gpu(&tp, gate(thr, 128), nullptr, passes(n));
    const GpuRun dense = run_gpu(&tp, DenseParams{});
    ASSERT_TRUE(gated.status.ok() && dense.status.ok()) << gated.status.to_string() << " / " << dense.status.to_string();
    expect_ran(gated, gate(thr, 128), "cuda-hopper", false);
    EXPECT_EQ(gated.stats.execution.passes, n);
    EXPECT_EQ(gated.decisions.kept.selected_blocks(), visible_blocks({{500, 700}}, 4, true, kBlockQ, 128));
    EXPECT_TRUE(same_result(gated.out, dense.out, 0.0));
  }
}

// One query block over a long prefix: every prefix block is full and gated. V of the blocks
// the gate skips for every head of the KV group is NaN (K stays: the gate reads it). block_k
// 128 runs the Hopper kernel on an sm_90 device (its producer must not request those V tiles).
// In one pass and in two (the conformance suite runs the plan's choice), on both paths: each
// run on the poisoned inputs equals the same execution's run on the clean ones.
TEST(CudaExactGate, NaNValuesOfSkippedBlocksAreNeverReadInOneAndTwoPasses) {
  SP_REQUIRE_GPU();
  const SeqLen len{100, 1400};
  for (int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    Inputs in = make_inputs({len}, 2, 2, 128, 900);
    TestProblem clean = make_problem(in);
    const HostTensor thr = midpoint_thresholds(in, true, kBlockQ, block_k, 0.3);
    const Decisions kept = oracle_decisions(clean, gate(thr, block_k));
    const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, kBlockQ, block_k);
    int poisoned = 0;
    for (int h = 0; h < in.h_q; ++h) {
      for (int kb = 0; kb < g.visible_end(0); ++kb) {
        if (kept.kept.contains(0, h, 0, kb)) continue;
        poison_keys(&in, 0, true, h, g.key_begin(kb), g.key_end(kb));
        ++poisoned;
      }
    }
    ASSERT_GT(poisoned, 0);
    TestProblem dirty = make_problem(in);
    for (bool portable : {false, true}) {
      for (int n : {1, 2}) {
        SCOPED_TRACE(std::string(portable ? "portable path, " : "default path, ") + std::to_string(n) + " pass(es)");
        const GpuRun ref = run_gpu(&clean, gate(thr, block_k), nullptr, on_path(portable, passes(n)));
        const GpuRun got = run_gpu(&dirty, gate(thr, block_k), nullptr, on_path(portable, passes(n)));
        ASSERT_TRUE(ref.status.ok() && got.status.ok()) << ref.status.to_string() << " / " << got.status.to_string();
        EXPECT_EQ(got.stats.execution.passes, n);
        EXPECT_TRUE(same_result(got.out, ref.out, 0.0));
        EXPECT_TRUE(same_decisions(kept, got.decisions));
      }
    }
  }
}

// Blocks that one half of a query block's rows keeps and the other skips: on the Hopper kernel
// each consumer warpgroup owns 64 rows, so there one warpgroup's warps vote keep and go on
// while the other's wait for the decision, both ways. Rows 0-63 of each 128-row block look
// along dimension 1, rows 64-127 along dimension 0; key blocks with kb % 4 == 1 hold A in
// dimension 0, kb % 4 == 3 in dimension 1, the others neither, so the gate keeps exactly
// blocks 1 and 3 mod 4: their maxima reach A² / sqrt(d) = 5.7 after scaling, the others' about
// 0.4 (entries of size 0.5 elsewhere), on either side of T = 2.
TEST(CudaExactGate, BlocksThatOneHalfOfTheQueryRowsKeeps) {
  SP_REQUIRE_GPU();
  const SeqLen len{256, 2048};
  constexpr double kA = 8.0;
  Inputs in = make_inputs({len}, 2, 1, 128, 1000, DType::kBF16, 0.5);
  SequenceData& seq = in.seqs[0];
  for (std::int64_t pos = 0; pos < len.s_q; ++pos) {
    // Query blocks start at s_k - s_q (bottom-right causal), a multiple of 128.
    const bool second_half = pos % 128 >= 64;
    for (int h = 0; h < in.h_q; ++h) {
      set(&seq.q, (pos * in.h_q + h) * in.d + 0, second_half ? kA : 0.0);
      set(&seq.q, (pos * in.h_q + h) * in.d + 1, second_half ? 0.0 : kA);
    }
  }
  for (std::int64_t pos = 0; pos < len.s_k; ++pos) {
    const int kb = static_cast<int>(pos / 128);
    set(&seq.k, pos * in.d + 0, kb % 4 == 1 ? kA : 0.0);
    set(&seq.k, pos * in.d + 1, kb % 4 == 3 ? kA : 0.0);
  }
  TestProblem tp = make_problem(in);
  const int positions = static_cast<int>(len.s_k / 128) + 1;
  HostTensor thr(DType::kFP32, {in.h_q, positions});
  for (int i = 0; i < in.h_q * positions; ++i) thr.as<float>()[i] = 2.f;
  const GpuRun r = expect_both_paths_match(&tp, gate(thr, 128)).front();
  ASSERT_TRUE(r.status.ok());
  const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, 128, 128);
  for (int h = 0; h < in.h_q; ++h) {
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
      for (int kb = 0; kb < g.visible_end(qb); ++kb) {
        if (!g.is_full(qb, kb)) continue;  // group A: never gated
        EXPECT_EQ(r.decisions.kept.contains(0, h, qb, kb), kb % 4 == 1 || kb % 4 == 3)
            << "head " << h << ", query block " << qb << ", key block " << kb;
      }
    }
  }
}

// Blocks that a head keeps on one key only, anywhere in the block: each head's decision is its
// own, in a decision CTA that scores four heads against each K tile with two heads' wgmma in
// flight at once: a vote under the wrong head, or a maximum over part of the block, fails it
// (written for an early keep that scored a block's second half only for the heads its first
// half did not keep: bench/records/2026-11-30-h200-decision-kernel-early-keep-ab.log, not
// kept). Head h looks along dimension h (four heads of one KV group); key block kb holds one
// key, at offset 5, 63, 64 or 123 for kb / 16 = 0, 1, 2, 3 (either half and the keys on both
// sides of the middle), with A in the dimensions of the bits of kb % 16 and 0 in dimensions
// 0-3 elsewhere; so head h keeps exactly the full blocks with bit h of kb % 16 set, every mix
// of heads appearing with the key at each offset. T = 2 between the key's A² / sqrt(d) = 5.7
// and the others' maxima of about 0.4 (entries of size 0.5). In one pass and in two, both
// paths.
TEST(CudaExactGate, BlocksThatOneKeyKeepsForItsHeadsOnly) {
  SP_REQUIRE_GPU();
  const SeqLen len{256, 8192};
  constexpr double kA = 8.0;
  constexpr int kHeads = 4;
  constexpr int kOffsets[4] = {5, 63, 64, 123};
  Inputs in = make_inputs({len}, kHeads, 1, 128, 1100, DType::kBF16, 0.5);
  SequenceData& seq = in.seqs[0];
  for (std::int64_t pos = 0; pos < len.s_q; ++pos) {
    for (int h = 0; h < kHeads; ++h) {
      for (int dim = 0; dim < kHeads; ++dim) set(&seq.q, (pos * kHeads + h) * in.d + dim, dim == h ? kA : 0.0);
    }
  }
  for (std::int64_t pos = 0; pos < len.s_k; ++pos) {
    const int kb = static_cast<int>(pos / 128);
    const bool special = pos % 128 == kOffsets[kb / 16 % 4];
    for (int dim = 0; dim < kHeads; ++dim) set(&seq.k, pos * in.d + dim, special && ((kb % 16) >> dim) % 2 ? kA : 0.0);
  }
  TestProblem tp = make_problem(in);
  const int positions = static_cast<int>(len.s_k / 128) + 1;
  HostTensor thr(DType::kFP32, {kHeads, positions});
  for (int i = 0; i < kHeads * positions; ++i) thr.as<float>()[i] = 2.f;
  const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, 128, 128);
  for (int n : {1, 2}) {
    SCOPED_TRACE(std::to_string(n) + " pass(es)");
    for (const GpuRun& r : expect_both_paths_match(&tp, gate(thr, 128), passes(n))) {
      ASSERT_TRUE(r.status.ok());
      EXPECT_EQ(r.stats.execution.passes, n);
      for (int h = 0; h < kHeads; ++h) {
        for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
          for (int kb = 0; kb < g.visible_end(qb); ++kb) {
            if (!g.is_full(qb, kb)) continue;  // group A: never gated
            EXPECT_EQ(r.decisions.kept.contains(0, h, qb, kb), ((kb % 16) >> h) % 2 == 1)
                << "head " << h << ", query block " << qb << ", key block " << kb;
          }
        }
      }
    }
  }
}

// exact_gate in one pass (the forward kernel's in-loop gate) and in two (the decision kernel,
// then the forward kernel on the block mask it writes), on both paths: each run within the
// calibrated tolerance of the oracle, every element written, the oracle's decisions. On the
// Hopper path both executions compute S with the same wgmma and visit the kept blocks in the
// same order with the same softmax steps, so every output bit agrees too (the portable gated
// instance rescales group A exactly, the plain one lazily). GQA groups 1, 3, 4 and 8 (the
// Hopper decision kernel scores 1, 3, 4 and 4 heads per CTA; 8: two CTAs per KV head), head
// dims 64 and 128, bf16 and fp16, block_k 64 and 128, causal with s_q < s_k, a query block of 5
// rows whose short last key block is gated, non-causal with a short last block, and a varlen
// batch with a sequence without keys.
TEST(CudaExactGate, TwoPassesEqualOnePass) {
  SP_REQUIRE_GPU();
  struct Case {
    std::vector<SeqLen> lens;
    bool causal;
    int h_q, h_kv, d, block_k;
    DType dtype;
    Layout layout;
  };
  for (const Case& c : {Case{{{700, 1000}}, true, 8, 2, 128, 128, DType::kBF16, Layout::kBatched},
                        Case{{{5, 1000}}, true, 4, 1, 128, 128, DType::kBF16, Layout::kBatched},
                        Case{{{300, 900}}, false, 6, 2, 64, 128, DType::kFP16, Layout::kBatched},
                        Case{{{1100, 1100}, {260, 1500}, {5, 0}}, true, 8, 1, 128, 128, DType::kFP16, Layout::kVarlen},
                        Case{{{500, 777}}, true, 3, 3, 64, 64, DType::kBF16, Layout::kBatched}}) {
    SCOPED_TRACE(std::to_string(c.lens.size()) + " sequence(s), " + std::to_string(c.lens[0].s_q) + "x" +
                 std::to_string(c.lens[0].s_k) + (c.causal ? " causal" : " non-causal") + ", h_q " +
                 std::to_string(c.h_q) + ", h_kv " + std::to_string(c.h_kv) + ", d " + std::to_string(c.d) +
                 ", block_k " + std::to_string(c.block_k));
    const Inputs in = make_inputs(c.lens, c.h_q, c.h_kv, c.d, 1200 + static_cast<std::uint64_t>(c.h_q), c.dtype);
    TestProblem tp = make_problem(in, c.causal, c.layout);
    const HostTensor thr = midpoint_thresholds(in, c.causal, kBlockQ, c.block_k, 0.3);
    const Policy policy = gate(thr, c.block_k);
    const ref::Result ref64 = oracle(tp, policy);
    ref::Result lowp;
    ASSERT_TRUE(run_lowp_reference(tp.problem(), policy, ref64.decisions, &lowp).ok());
    EXPECT_LT(ref64.decisions.kept.selected_blocks(), visible_blocks(c.lens, c.h_q, c.causal, kBlockQ, c.block_k))
        << "the thresholds should skip some blocks";
    for (bool portable : {false, true}) {
      SCOPED_TRACE(portable ? "portable path" : "default path");
      std::vector<GpuRun> runs;
      for (int n : {1, 2}) {
        SCOPED_TRACE(std::to_string(n) + " pass(es)");
        runs.push_back(run_gpu(&tp, policy, nullptr, on_path(portable, passes(n))));
        const GpuRun& r = runs.back();
        ASSERT_TRUE(r.status.ok()) << r.status.to_string();
        EXPECT_EQ(r.stats.execution.passes, n);
        expect_ran(r, policy, expected_path(policy, portable, false), false);
        EXPECT_TRUE(fully_written(r.out, ref64));
        EXPECT_TRUE(close_calibrated(c.dtype, r.out, ref64, lowp));
        EXPECT_TRUE(same_decisions(ref64.decisions, r.decisions));
      }
      if (runs[0].stats.execution.path == "cuda-hopper") EXPECT_TRUE(same_result(runs[1].out, runs[0].out, 0.0));
    }
  }
}

// ------------------------------------------------------------------ GQA packing

// `policy` with the Hopper kernel's tiles packed (overrides.pack_gqa = always: 128 / G rows of
// each of a KV group's G query heads per tile) and unpacked (never): the packed run matches
// the oracle and equals the unpacked one element for element (every row sees the same key tiles
// in the same order, only its place in the tile moves). Packed exactly on an sm_90 device
// (RunStats::execution.q_pack); nothing packs elsewhere.
void expect_packed_equals_unpacked(TestProblem* tp, const Policy& policy, int group) {
  const ref::Result ref64 = oracle(*tp, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(tp->problem(), policy, ref64.decisions, &lowp);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ExecutionOverrides always, never;
  always.pack_gqa = ExecutionOverrides::Choice::kAlways;
  never.pack_gqa = ExecutionOverrides::Choice::kNever;
  const GpuRun packed = run_gpu(tp, policy, nullptr, always);
  const GpuRun unpacked = run_gpu(tp, policy, nullptr, never);
  ASSERT_TRUE(packed.status.ok()) << packed.status.to_string();
  ASSERT_TRUE(unpacked.status.ok()) << unpacked.status.to_string();
  EXPECT_EQ(packed.stats.execution.q_pack, hopper_device() ? group : 1);
  EXPECT_EQ(unpacked.stats.execution.q_pack, 1);
  EXPECT_TRUE(fully_written(packed.out, ref64));
  EXPECT_TRUE(close_calibrated(tp->q.dtype(), packed.out, ref64, lowp));
  EXPECT_TRUE(same_decisions(ref64.decisions, packed.decisions));
  EXPECT_TRUE(same_result(packed.out, unpacked.out, 0.0));
}

// Dense and per-KV-head block masks: a chunk of 32 rows over a cache (one packed tile), ragged
// varlen rows with a sequence of one row and one with fewer keys than rows, causal or not,
// groups 2 to 16, both head dims and dtypes; estimate_select with pack_gqa and mean correction.
TEST(CudaPackGqa, PackedTilesEqualUnpackedAndMatchTheOracle) {
  SP_REQUIRE_GPU();
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv, d;
    DType dtype;
    bool causal;
  };
  int seed = 0;
  for (const Case& c : {Case{{{32, 2000}}, 8, 2, 128, DType::kBF16, true},
                        Case{{{5, 700}, {300, 300}, {1, 1}, {130, 900}, {200, 60}}, 8, 1, 64, DType::kFP16, true},
                        Case{{{257, 257}}, 4, 2, 128, DType::kFP16, false},
                        Case{{{100, 3000}}, 16, 1, 64, DType::kBF16, true}}) {
    const int group = c.h_q / c.h_kv;
    SCOPED_TRACE("group " + std::to_string(group) + ", " + std::to_string(c.lens.size()) + " sequence(s), first " +
                 std::to_string(c.lens[0].s_q) + "x" + std::to_string(c.lens[0].s_k));
    const Inputs in = make_inputs(c.lens, c.h_q, c.h_kv, c.d, 1900 + static_cast<std::uint64_t>(seed++), c.dtype);
    TestProblem tp = make_problem(in, c.causal, c.lens.size() > 1 ? Layout::kVarlen : Layout::kBatched);
    {
      SCOPED_TRACE("dense");
      expect_packed_equals_unpacked(&tp, DenseParams{}, group);
    }
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams mask;
    mask.mask = random_mask(shape, kBlockQ, 128, true, 91 + static_cast<std::uint64_t>(seed), &dead);
    SCOPED_TRACE("block_sparse, a mask row per KV head");
    expect_packed_equals_unpacked(&tp, mask, group);
  }
  Inputs in = make_inputs({{300, 1500}}, 8, 2, 128, 1950, DType::kBF16, 2.5);
  shift_hot_keys(&in, 128, 1.5);
  TestProblem tp = make_problem(in);
  const auto select = [](double alpha) {
    EstimateSelectParams p = small_estimate_select(alpha, kBlockQ, true, true);
    p.window = 2;
    return p;
  };
  const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1, 0.05}, [&](double x) -> Policy { return select(x); },
                                        some_skipped(visible_blocks({{300, 1500}}, 2, true, kBlockQ, 128)));
  ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
  SCOPED_TRACE("estimate_select, pack_gqa, mean correction");
  expect_packed_equals_unpacked(&tp, select(alpha), 4);
}

// ------------------------------------------------------------------ paged K/V

// Page sizes of the paged checks. Portable kernel: one key per page and pages smaller than a
// 64-key sub-tile (a sub-tile spans pages: rows translated one by one), equal to it and larger
// than a 128-key block (a sub-tile lies in one page: translated once). Hopper kernel: rows
// gathered through the table (1, 3, 16, 24, whose pages straddle key tiles, and 32:
// hopper_gathers_pages), one TMA box per page (64) and two tiles per page (256, boxes of 128
// rows).
constexpr int kPageSizes[] = {1, 3, 16, 24, 32, 64, 256};

// Causal or not, under FlashAttention's window (left, right) (-1: no bound).
struct Masking {
  bool causal = true;
  int left = -1, right = -1;
};

LayoutOptions layout_of(Layout layout, const Masking& m) {
  LayoutOptions opt;
  opt.layout = layout;
  opt.causal = m.causal;
  opt.window_left = m.left;
  opt.window_right = m.right;
  return opt;
}

TestProblem paged_problem(const Inputs& in, int page_size, const Masking& m = {}) {
  LayoutOptions opt = layout_of(Layout::kPaged, m);
  opt.page_size = page_size;
  opt.page_seed = 40 + static_cast<std::uint64_t>(page_size);
  return build_problem(in, opt);
}

ExecutionOverrides staging(bool staged) {
  ExecutionOverrides o;
  o.kv_staging = staged ? ExecutionOverrides::Choice::kAlways : ExecutionOverrides::Choice::kNever;
  return o;
}

// `policy` on paged K/V (shuffled pages, NaN in every storage no valid key uses) at every page
// size of kPageSizes against the same call on contiguous varlen K/V, on both paths, with the
// pages read by the kernels and staged into contiguous rows first (overrides.kv_staging, both
// forced; RunStats::execution.kv_staged): the oracle's decisions, O and LSE bit for bit with
// the contiguous call on the same kernel family (the same tiles reach shared memory, only
// their addresses differ; the Hopper kernel's paged boxes compose into the contiguous tile,
// rows past s_k masked as there; staged rows are the contiguous rows), every output written and
// within the calibrated tolerance of the oracle. exact_gate runs one pass on pages read in the
// kernels (the plan's choice): compared with contiguous one-pass runs.
void expect_paged_equals_contiguous(const Inputs& in, const Policy& policy, const Masking& m = {}) {
  TestProblem contiguous = build_problem(in, layout_of(Layout::kVarlen, m));
  const ref::Result ref64 = oracle(contiguous, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(contiguous.problem(), policy, ref64.decisions, &lowp);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const bool exact = std::holds_alternative<ExactGateParams>(policy);
  GpuRun want[2][2];  // [portable][one pass forced]
  for (bool portable : {false, true}) {
    for (bool one_pass : {false, true}) {
      if (one_pass && !exact) continue;
      SCOPED_TRACE(std::string(portable ? "contiguous, portable path" : "contiguous, default path") +
                   (one_pass ? ", one pass" : ""));
      GpuRun& w = want[portable][one_pass];
      w = run_gpu(&contiguous, policy, nullptr, on_path(portable, passes(one_pass ? 1 : 0)));
      ASSERT_TRUE(w.status.ok()) << w.status.to_string();
      expect_ran(w, policy, expected_path(policy, portable, false, in.d, in.d_v), false);
      EXPECT_TRUE(fully_written(w.out, ref64));
      EXPECT_TRUE(close_calibrated(in.dtype, w.out, ref64, lowp));
      EXPECT_TRUE(same_decisions(ref64.decisions, w.decisions));
    }
  }
  for (int page : kPageSizes) {
    TestProblem paged = paged_problem(in, page, m);
    for (bool staged : {false, true}) {
      for (bool portable : {false, true}) {
        SCOPED_TRACE("page_size " + std::to_string(page) + (staged ? ", staged" : ", pages read in the kernel") +
                     (portable ? ", portable path" : ", default path"));
        const GpuRun got = run_gpu(&paged, policy, nullptr, on_path(portable, staging(staged)));
        ASSERT_TRUE(got.status.ok()) << got.status.to_string();
        EXPECT_EQ(got.stats.execution.kv_staged, staged);
        const std::string path = expected_path(policy, portable, !staged, in.d, in.d_v);
        expect_ran(got, policy, path, !staged);
        EXPECT_TRUE(fully_written(got.out, ref64));
        EXPECT_TRUE(close_calibrated(in.dtype, got.out, ref64, lowp));
        EXPECT_TRUE(same_decisions(ref64.decisions, got.decisions));
        // Bit for bit the contiguous run of the same kernel family (paged permute_stop reads
        // pages on the portable kernel only).
        const GpuRun& same = want[path == "cuda-portable" ? 1 : 0][exact && !staged];
        ASSERT_EQ(same.stats.execution.path, path);
        EXPECT_TRUE(same_result(got.out, same.out, 0.0));
      }
    }
  }
}

TEST(CudaPaged, DenseEqualsContiguous) {
  SP_REQUIRE_GPU();
  // Several sequences (one with no keys, one with a single key, s_q > s_k and s_q < s_k),
  // causal and not, both head dims.
  const Inputs small = make_inputs({{300, 700}, {129, 129}, {1, 190}, {40, 0}, {200, 17}}, 4, 2, 64, 1600, DType::kFP16);
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    expect_paged_equals_contiguous(small, DenseParams{}, Masking{causal});
  }
  const Inputs wide = make_inputs({{700, 1300}}, 4, 2, 128, 1601);
  expect_paged_equals_contiguous(wide, DenseParams{});
}

TEST(CudaPaged, DenseShortCachesUnderLongChunks) {
  SP_REQUIRE_GPU();
  // FlashAttention-3's test_flash_attn_kvcache shape: a 2048-query chunk over caches shorter
  // and longer than it (causal: the first 2048 - s_k rows of a short cache see no key, whole
  // query blocks among them), d 128, bf16.
  const Inputs in = make_inputs({{2048, 300}, {2048, 1777}, {2048, 3577}, {2048, 9}}, 2, 1, 128, 1606);
  expect_paged_equals_contiguous(in, DenseParams{});
}

TEST(CudaPaged, FamilyHeadDimsEqualContiguous) {
  SP_REQUIRE_GPU();
  // Head dims 96 and 256 and MLA's q/k 192 with v 128 (the portable kernel's instances), dense
  // and exact_gate (two passes, and one over pages read in the kernel: the gated instance):
  // pages read in the kernel and staged (K and V at their own widths), GQA, a sequence shorter
  // than a block and one with no keys.
  for (const auto& [d, d_v] : {std::pair{96, 96}, std::pair{256, 256}, std::pair{192, 128}}) {
    SCOPED_TRACE("d " + std::to_string(d) + ", d_v " + std::to_string(d_v));
    const Inputs in = random_inputs({{300, 700}, {40, 0}, {129, 190}}, 4, 2, d, DType::kBF16, 1650 + d, 1.0,
                                    Distribution::kUniform, d_v);
    expect_paged_equals_contiguous(in, DenseParams{});
    const HostTensor thr = midpoint_thresholds(in, true, kBlockQ, 128, 0.4);
    expect_paged_equals_contiguous(in, gate(thr, 128));
  }
}

TEST(CudaPaged, BlockSparseEqualsContiguous) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{300, 700}, {129, 129}, {500, 1100}}, 4, 2, 128, 1602);
  const TestProblem tp = make_problem(in, true, Layout::kVarlen);
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  std::vector<std::vector<int>> dead;
  for (const auto& [block_k, per_kv] : {std::pair<int, bool>{64, false}, std::pair<int, bool>{128, true}}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    BlockSparseParams p;
    p.mask = random_mask(shape, kBlockQ, block_k, per_kv, 78, &dead);
    // K and V of the blocks no query head of a KV group selects are NaN in every sequence
    // (with per-KV-head masks: a third of the blocks), so reading a skipped page shows.
    Inputs dirty = in;
    int poisoned = 0;
    for (int b = 0; b < shape.batch; ++b) {
      const geom::BlockGeometry g =
          geometry(shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)], true, kBlockQ, block_k);
      poisoned += poison_dead_blocks(&dirty, b, g, per_kv, dead);
    }
    if (per_kv) EXPECT_GT(poisoned, 0);
    expect_paged_equals_contiguous(dirty, p);
  }
}

TEST(CudaPaged, ExactGateEqualsContiguous) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{700, 1300}}, 4, 2, 128, 1603);
  for (int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    const HostTensor thr = midpoint_thresholds(in, true, kBlockQ, block_k, 0.4);
    expect_paged_equals_contiguous(in, gate(thr, block_k));
  }
}

TEST(CudaPaged, SoftmaxSkipEqualsContiguous) {
  SP_REQUIRE_GPU();
  Inputs in = make_inputs({{700, 1300}}, 4, 2, 64, 1604, DType::kBF16, 3.0);
  scale_hot_keys(&in, 64, 0.1);
  const TestProblem tp = make_problem(in, true, Layout::kVarlen);
  const double a = stable_parameter(tp, scale_factors(1300), [](double x) -> Policy { return skip_params(x, kBlockQ, 64); },
                                    some_skipped(visible_blocks({{700, 1300}}, 4, true, kBlockQ, 64)));
  ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
  expect_paged_equals_contiguous(in, skip_params(a, kBlockQ, 64));
}

TEST(CudaPaged, EstimateSelectEqualsContiguous) {
  SP_REQUIRE_GPU();
  // Two sequences (one block-table row each); plain per query head, and mean correction with
  // pack_gqa (the block means are read through the table too).
  Inputs in = make_inputs({{700, 900}, {1100, 1100}}, 4, 2, 64, 1605, DType::kFP16, 2.5);
  shift_hot_keys(&in, 128, 1.5);
  const TestProblem tp = make_problem(in, true, Layout::kVarlen);
  for (bool corrected : {false, true}) {
    SCOPED_TRACE(corrected ? "mean correction, pack_gqa" : "per query head");
    const int units = corrected ? 2 : 4;
    const auto select = [corrected](double alpha) {
      EstimateSelectParams p = small_estimate_select(alpha, kBlockQ, corrected, corrected);
      p.window = 2;
      return p;
    };
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1}, [&](double x) -> Policy { return select(x); },
                                          some_skipped(visible_blocks({{700, 900}, {1100, 1100}}, units, true, kBlockQ, 128)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    expect_paged_equals_contiguous(in, select(alpha));
  }
}

TEST(CudaPaged, PermuteStopEqualsContiguous) {
  SP_REQUIRE_GPU();
  // A cached prefix no segment of the call owns (read only through the ranked pass, gathered
  // through the table), and a prompt with several segments; GQA group 2.
  for (const SeqLen len : {SeqLen{300, 1500}, SeqLen{1023, 1023}}) {
    SCOPED_TRACE(std::to_string(len.s_q) + "x" + std::to_string(len.s_k));
    const Inputs in = permute_inputs({len}, 4, 2, 128, 1607);
    const double tau = stable_parameter(make_problem(in), {0.05, 0.1, 0.02, 0.2, 0.03, 0.01, 0.3},
                                        [](double x) -> Policy { return permute_params(x, 256, kBlockQ, 64); }, stops_early);
    ASSERT_FALSE(std::isnan(tau)) << "no tau with a margin stops a tile early";
    expect_paged_equals_contiguous(in, permute_params(tau, 256, kBlockQ, 64));
  }
}

// ------------------------------------------------------------------ local windows
// (tests/conformance runs dense and block_sparse under windows against the oracle.)

// A window that hides no key (one wider than every sequence, causal or not) runs the kernels'
// window code (the lower band's test and mask) and decides and attends exactly as no window
// (docs/semantics.md §1): bit for bit, dense and block masks of 64- and 128-key blocks, on both
// paths.
TEST(CudaWindow, AWindowThatHidesNothingIsNoWindowBitwise) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{300, 700}, {129, 129}, {200, 17}}, 4, 2, 128, 2500);
  for (const bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    TestProblem plain = build_problem(in, layout_of(Layout::kVarlen, Masking{causal}));
    TestProblem wide = build_problem(in, layout_of(Layout::kVarlen, Masking{causal, 5000, causal ? -1 : 5000}));
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(plain.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams m64, m128;
    m64.mask = random_mask(shape, kBlockQ, 64, false, 81, &dead);
    m128.mask = random_mask(shape, kBlockQ, 128, true, 82, &dead);
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{m64}, Policy{m128}}) {
      for (const bool portable : {false, true}) {
        SCOPED_TRACE(std::string(policy_name(policy)) + (portable ? ", portable path" : ", default path"));
        const GpuRun want = run_gpu(&plain, policy, nullptr, on_path(portable));
        const GpuRun got = run_gpu(&wide, policy, nullptr, on_path(portable));
        ASSERT_TRUE(want.status.ok()) << want.status.to_string();
        ASSERT_TRUE(got.status.ok()) << got.status.to_string();
        expect_ran(got, policy, expected_path(policy, portable, false), false);
        EXPECT_TRUE(same_result(got.out, want.out, 0.0));
      }
    }
  }
}

// GQA packing under a window: each row of a packed tile is masked at its own position with
// the window's bounds, so packed tiles equal unpacked ones element for element (dense and
// per-KV-head masks): a chunk of 32 rows over a cache with a causal window, and ragged varlen
// rows (one with fewer keys than rows) under a non-causal window with both bounds.
TEST(CudaWindow, PackedTilesEqualUnpackedUnderAWindow) {
  SP_REQUIRE_GPU();
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv, d;
    DType dtype;
    Masking masking;
  };
  int seed = 0;
  for (const Case& c : {Case{{{32, 2000}}, 8, 2, 128, DType::kBF16, Masking{true, 700}},
                        Case{{{5, 700}, {300, 300}, {130, 900}, {200, 60}}, 8, 1, 64, DType::kFP16, Masking{false, 100, 20}}}) {
    const int group = c.h_q / c.h_kv;
    SCOPED_TRACE("group " + std::to_string(group) + ", window (" + std::to_string(c.masking.left) + ", " +
                 std::to_string(c.masking.right) + ")");
    const Inputs in = make_inputs(c.lens, c.h_q, c.h_kv, c.d, 2510 + static_cast<std::uint64_t>(seed++), c.dtype);
    TestProblem tp = build_problem(in, layout_of(c.lens.size() > 1 ? Layout::kVarlen : Layout::kBatched, c.masking));
    {
      SCOPED_TRACE("dense");
      expect_packed_equals_unpacked(&tp, DenseParams{}, group);
    }
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams mask;
    mask.mask = random_mask(shape, kBlockQ, 128, true, 93 + static_cast<std::uint64_t>(seed), &dead);
    SCOPED_TRACE("block_sparse, a mask row per KV head");
    expect_packed_equals_unpacked(&tp, mask, group);
  }
}

// Paged K/V under a causal window (every page size, read in the kernels or staged, both
// paths) equals contiguous K/V bit for bit: dense, and a block mask of 64-key blocks whose
// unselected blocks are NaN.
TEST(CudaWindow, PagedEqualsContiguousUnderAWindow) {
  SP_REQUIRE_GPU();
  const Masking window{true, 150};
  Inputs in = make_inputs({{300, 700}, {129, 129}, {1, 190}, {200, 17}}, 4, 2, 64, 2520);
  expect_paged_equals_contiguous(in, DenseParams{}, window);
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(build_problem(in, layout_of(Layout::kVarlen, window)).problem(), nullptr, &shape).ok());
  std::vector<std::vector<int>> dead;
  BlockSparseParams mask;
  mask.mask = random_mask(shape, kBlockQ, 64, false, 83, &dead);
  for (int b = 0; b < shape.batch; ++b) {
    const auto u = static_cast<std::size_t>(b);
    poison_dead_blocks(&in, b, geometry(shape.seq_q[u], shape.seq_k[u], true, kBlockQ, 64, window.left), false, dead);
  }
  expect_paged_equals_contiguous(in, mask, window);
}

// ------------------------------------------------------------------ what is not built

TEST(CudaSupport, UnsupportedCombinationsSayWhatIsCompiled) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{64, 64}}, 2, 1, 64, 1400);
  TestProblem tp = make_problem(in);
  PermuteStopParams narrow;
  narrow.block_k = 32;
  const GpuRun stop = run_gpu(&tp, narrow);
  EXPECT_EQ(stop.status.code(), StatusCode::kUnsupported);
  EXPECT_NE(stop.status.message().find("permute_stop"), std::string::npos) << stop.status.message();
  EXPECT_NE(stop.status.message().find("block_k = 32"), std::string::npos) << stop.status.message();

  SoftmaxSkipParams small;
  small.block_q = 64;
  const GpuRun blocks = run_gpu(&tp, small);
  EXPECT_EQ(blocks.status.code(), StatusCode::kUnsupported);
  EXPECT_NE(blocks.status.message().find("block_q = 128"), std::string::npos) << blocks.status.message();

  // 80: no model family in issue 33's list, so no instance (96, 192/128 and 256 run dense).
  const Inputs odd = make_inputs({{64, 64}}, 2, 1, 80, 1401);
  TestProblem tp80 = make_problem(odd);
  const GpuRun d80 = run_gpu(&tp80, DenseParams{});
  EXPECT_EQ(d80.status.code(), StatusCode::kUnsupported);
  EXPECT_NE(d80.status.message().find("head_dim 80"), std::string::npos) << d80.status.message();

  const Inputs f32 = make_inputs({{64, 64}}, 2, 1, 64, 1402, DType::kFP32);
  TestProblem tp32 = make_problem(f32);
  const GpuRun r32 = run_gpu(&tp32, DenseParams{});
  EXPECT_EQ(r32.status.code(), StatusCode::kUnsupported);
  EXPECT_NE(r32.status.message().find("fp32"), std::string::npos) << r32.status.message();
}

TEST(CudaSupport, CanRunMatchesRun) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{64, 64}}, 2, 1, 128, 1500);
  TestProblem tp = make_problem(in);
  DeviceBuffer q, k, v;
  AttentionProblem dev = tp.problem();
  dev.q = to_device(tp.q, &q);
  dev.k = to_device(tp.k, &k);
  dev.v = to_device(tp.v, &v);
  EXPECT_TRUE(can_run(dev, DenseParams{}, Backend::kCUDA).ok());
  EXPECT_TRUE(can_run(dev, PermuteStopParams{}, Backend::kCUDA).ok());
  PermuteStopParams wide;
  wide.block_q = 64;
  EXPECT_EQ(can_run(dev, wide, Backend::kCUDA).code(), StatusCode::kUnsupported);
  EXPECT_NE(build_info().find("fwd_sm80_bf16_hd128"), std::string::npos) << build_info();
  EXPECT_NE(build_info().find("fwd_sm90_bf16_hd128"), std::string::npos) << build_info();
}

// ------------------------------------------------------------------ CUDA graphs and plans

// After one warm-up call outside capture, a captured call records only device work (its
// metadata comes from the device-side cache), and replaying the graph on new contents of the
// same buffers equals a direct call on those contents, bit for bit.
TEST(CudaGraph, CaptureAfterWarmUpReplaysOnNewInputs) {
  SP_REQUIRE_GPU();
  const Inputs first = make_inputs({{300, 300}}, 8, 2, 64, 901);
  const Inputs second = make_inputs({{300, 300}}, 8, 2, 64, 902);
  TestProblem tp = make_problem(first);
  TestProblem tp2 = make_problem(second);
  DeviceBuffer q, k, v, o, lse;
  AttentionProblem dev = tp.problem();
  dev.q = to_device(tp.q, &q);
  dev.k = to_device(tp.k, &k);
  dev.v = to_device(tp.v, &v);
  AttentionOutput out;
  out.o = to_device(tp.o, &o);
  out.lse = to_device(tp.lse, &lse);
  cudaStream_t stream = nullptr;
  SP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RunOptions opt;
  opt.backend = Backend::kCUDA;
  opt.cuda_stream = stream;
  // exact_gate at block_k 128: two passes, the decision pass's per-sequence sums from the cache.
  const HostTensor thr = midpoint_thresholds(first, true, kBlockQ, 128, 0.3);
  const Policy gated = gate(thr, 128);
  for (const Policy& policy :
       {Policy{DenseParams{}}, Policy{skip_params(40.0, kBlockQ, 64)}, Policy{skip_params(40.0, kBlockQ, 128)}, gated}) {
    SCOPED_TRACE(policy_name(policy));
    const auto on_device = to_device(policy);  // exact_gate's thresholds on q's device
    SP_CUDA_CHECK(cudaMemcpy(q.ptr, tp.q.data(), q.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(k.ptr, tp.k.data(), k.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(v.ptr, tp.v.data(), v.bytes, cudaMemcpyHostToDevice));
    const Status warm = run(dev, on_device->policy, out, opt);  // warm-up: uploads the metadata once
    ASSERT_TRUE(warm.ok()) << warm.to_string();
    SP_CUDA_CHECK(cudaStreamSynchronize(stream));

    cudaGraph_t graph = nullptr;
    SP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    const Status captured = run(dev, on_device->policy, out, opt);
    SP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    ASSERT_TRUE(captured.ok()) << captured.to_string();
    cudaGraphExec_t exec = nullptr;
    SP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

    // New contents in the captured buffers, poisoned outputs, replay.
    SP_CUDA_CHECK(cudaMemcpy(q.ptr, tp2.q.data(), q.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(k.ptr, tp2.k.data(), k.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(v.ptr, tp2.v.data(), v.bytes, cudaMemcpyHostToDevice));
    poison(&tp.o);
    SP_CUDA_CHECK(cudaMemcpy(o.ptr, tp.o.data(), o.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    SP_CUDA_CHECK(cudaStreamSynchronize(stream));
    to_host(o, &tp.o);
    to_host(lse, &tp.lse);
    const GpuRun direct = run_gpu(&tp2, policy);
    ASSERT_TRUE(direct.status.ok()) << direct.status.to_string();
    EXPECT_EQ(std::memcmp(tp.o.data(), tp2.o.data(), tp.o.nbytes()), 0) << "replayed O differs from a direct call";
    EXPECT_EQ(std::memcmp(tp.lse.data(), tp2.lse.data(), tp.lse.nbytes()), 0) << "replayed LSE differs";
    SP_CUDA_CHECK(cudaGraphExecDestroy(exec));
    SP_CUDA_CHECK(cudaGraphDestroy(graph));
  }

  // A shape never run before cannot be captured: refused before any CUDA work, and the
  // capture still ends cleanly.
  const Inputs fresh = make_inputs({{211, 211}}, 8, 2, 64, 903);
  TestProblem tp3 = make_problem(fresh);
  DeviceBuffer q3, k3, v3, o3;
  AttentionProblem dev3 = tp3.problem();
  dev3.q = to_device(tp3.q, &q3);
  dev3.k = to_device(tp3.k, &k3);
  dev3.v = to_device(tp3.v, &v3);
  AttentionOutput out3;
  out3.o = to_device(tp3.o, &o3);
  cudaGraph_t graph = nullptr;
  SP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status refused = run(dev3, DenseParams{}, out3, opt);
  SP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  EXPECT_EQ(refused.code(), StatusCode::kUnsupported) << refused.to_string();
  EXPECT_NE(refused.message().find("outside capture first"), std::string::npos) << refused.message();
  SP_CUDA_CHECK(cudaGraphDestroy(graph));
  SP_CUDA_CHECK(cudaStreamDestroy(stream));
}

// The body of CudaPlan.PlansCaptureWithoutWarmUp for one policy: tp and tp2 hold two inputs of
// one shape.
void check_plan_capture(const TestProblem& tp, const TestProblem& tp2, const Policy& policy) {
  DeviceBuffer q, k, v, o, lse;
  AttentionProblem dev = tp.problem();
  dev.q = to_device(tp.q, &q);
  dev.k = to_device(tp.k, &k);
  dev.v = to_device(tp.v, &v);
  AttentionOutput out;
  out.o = to_device(tp.o, &o);
  out.lse = to_device(tp.lse, &lse);
  cudaStream_t stream = nullptr;
  SP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  RunOptions opt;
  opt.backend = Backend::kCUDA;
  opt.cuda_stream = stream;
  const auto on_device = to_device(policy);  // exact_gate's thresholds on q's device
  Plan plan;
  const Status made = make_plan(dev, on_device->policy, opt, &plan);
  ASSERT_TRUE(made.ok()) << made.to_string();
  EXPECT_EQ(plan.execution().path, expected_path(policy, false, false));
  if (std::holds_alternative<ExactGateParams>(policy)) EXPECT_EQ(plan.execution().passes, 2);

  cudaGraph_t graph = nullptr;
  SP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = run(plan, dev, out, opt);
  SP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << captured.to_string();
  cudaGraphExec_t exec = nullptr;
  SP_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  for (const TestProblem* in : {&tp, &tp2}) {
    SP_CUDA_CHECK(cudaMemcpy(q.ptr, in->q.data(), q.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(k.ptr, in->k.data(), k.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(v.ptr, in->v.data(), v.bytes, cudaMemcpyHostToDevice));
    TestProblem replayed = *in;
    poison(&replayed.o);
    poison(&replayed.lse);
    SP_CUDA_CHECK(cudaMemcpy(o.ptr, replayed.o.data(), o.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(lse.ptr, replayed.lse.data(), lse.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    SP_CUDA_CHECK(cudaStreamSynchronize(stream));
    to_host(o, &replayed.o);
    to_host(lse, &replayed.lse);

    TestProblem direct = *in;
    const GpuRun r = run_gpu(&direct, policy);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    ref::Result ref64;
    EXPECT_TRUE(matches_reference(direct.problem(), policy, direct.output(), {}, &ref64));
    EXPECT_TRUE(fully_written(r.out, ref64));
    EXPECT_EQ(std::memcmp(replayed.o.data(), direct.o.data(), direct.o.nbytes()), 0) << "replayed O differs";
    EXPECT_EQ(std::memcmp(replayed.lse.data(), direct.lse.data(), direct.lse.nbytes()), 0);
  }
  SP_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SP_CUDA_CHECK(cudaGraphDestroy(graph));
  SP_CUDA_CHECK(cudaStreamDestroy(stream));
}

// A call made with a plan is captured into a CUDA graph with no warm-up call of its shape, and
// replays on new inputs as a direct call does (tests/conformance checks run(plan) against
// run() on every backend). block_sparse: the plan holds the mask and the sequence table, and
// has cached the Hopper kernel's tensor maps of its tensors; exact_gate (two passes, on a
// varlen batch of three sequences): the plan has also cached the decision pass's gated-block
// sums per sequence (gate_seq_gated). block_k 128: the Hopper kernels on an sm_90 device.
TEST(CudaPlan, PlansCaptureWithoutWarmUp) {
  SP_REQUIRE_GPU();
  {
    // One uncaptured call of another shape first: the process's first calls load the kernels
    // (lazy module loading), which is not what this test is about.
    TestProblem other = make_problem(make_inputs({{256, 256}}, 4, 2, 64, 1800));
    ASSERT_TRUE(run_gpu(&other, DenseParams{}).status.ok());
  }
  struct Case {
    std::vector<SeqLen> lens;  // shapes no other test runs: no metadata of them is cached before
    Layout layout;
    bool gate;
  };
  for (const Case& c : {Case{{{1411, 1411}}, Layout::kBatched, false},
                        Case{{{600, 1409}, {900, 900}, {333, 700}}, Layout::kVarlen, true}}) {
    SCOPED_TRACE(c.gate ? "exact_gate, varlen" : "block_sparse");
    const Inputs first = make_inputs(c.lens, 4, 2, 64, 1801);
    const Inputs second = make_inputs(c.lens, 4, 2, 64, 1802);
    TestProblem tp = make_problem(first, true, c.layout);
    TestProblem tp2 = make_problem(second, true, c.layout);
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    Policy policy;
    HostTensor thr;  // exact_gate's thresholds (the policy holds a view)
    if (c.gate) {
      // From the first (longest) sequence: midpoint_thresholds reads batch-1 inputs.
      Inputs longest = first;
      longest.seqs.resize(1);
      thr = midpoint_thresholds(longest, true, kBlockQ, 128, 0.3);
      policy = gate(thr, 128);
    } else {
      std::vector<std::vector<int>> dead;
      BlockSparseParams bs;
      bs.mask = random_mask(shape, kBlockQ, 128, false, 1803, &dead);
      policy = bs;
    }
    check_plan_capture(tp, tp2, policy);
  }
}

}  // namespace
}  // namespace sparseprefill::test
