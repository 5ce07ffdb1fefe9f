// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's pure host planning (no GPU needed): support checks and their messages,
// the forward path (Hopper or portable) and TMA describability, paged K/V parameters and the
// compact block table, the compact mask layout the kernels read, bitmaps/arrays converted back
// to BlockMasks, and the calibration statistics' support checks and capacity-layout arrays
// split per sequence.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "common/inputs.h"
#include "core/geometry.h"
#include "cuda/kernel/rank_key.h"
#include "cuda/plan.h"
#include "cuda/registry.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::cuda {
namespace {

using test::cuda_shape_of;
using test::with_pages;

TEST(CudaPlan, SupportChoosesTheBlockTile) {
  const ProblemShape s = cuda_shape_of(300, 300, 4, 1, 128);
  int n = 0;
  ASSERT_TRUE(check_support(s, DenseParams{}, &n).ok());
  EXPECT_EQ(n, dense_block_k(128));
  ExactGateParams gate;
  gate.block_k = 64;
  ASSERT_TRUE(check_support(s, gate, &n).ok());
  EXPECT_EQ(n, 64);
  EstimateSelectParams select;
  ASSERT_TRUE(check_support(s, select, &n).ok());
  EXPECT_EQ(n, 128);
}

TEST(CudaPlan, UnsupportedMessagesNameTheArgument) {
  const ProblemShape s = cuda_shape_of(300, 300, 4, 1, 128);
  int n = 0;
  ExactGateParams gate;
  gate.block_k = 32;
  const auto expect_unsupported = [&](const ProblemShape& shape, const Policy& policy, const char* needle) {
    const Status st = check_support(shape, policy, &n);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  expect_unsupported(s, gate, "block_k = 32");
  EstimateSelectParams select;
  select.block = 64;
  expect_unsupported(s, select, "block = 128");
  PermuteStopParams stop;
  stop.block_k = 32;
  expect_unsupported(s, stop, "permute_stop");
  PermuteStopParams tiny;
  tiny.segment = 16;  // 32 heads × 2^20 positions in 16-key segments: ~1.8e13 ranked keys
  expect_unsupported(cuda_shape_of(std::int64_t{1} << 20, std::int64_t{1} << 20, 32, 8, 128), tiny, "2^31 - 1");
  expect_unsupported(cuda_shape_of(300, 300, 4, 1, 80), DenseParams{}, "head_dim 80");
  expect_unsupported(cuda_shape_of(300, 300, 4, 1, 128, DType::kFP32), DenseParams{}, "dtype fp32 has no CUDA kernel");
}

// The model-family features no kernel takes yet are refused by name for every policy, before
// anything else is checked (docs/cuda.md, support matrix); a V head dim unlike Q/K's but MLA's
// 192/128 has no instance, and says so. Local windows, softcap and sinks run dense and block_sparse (on both
// paths: their choice of path is the feature-free one's; softcap and sinks on 16-bit inputs)
// and are refused by name for the other policies.
TEST(CudaPlan, ModelFamilyFeaturesAreRefusedByName) {
  int n = 0;
  ExactGateParams gate;
  gate.block_k = 128;
  const Policy policies[] = {DenseParams{}, gate, SoftmaxSkipParams{}, EstimateSelectParams{}, PermuteStopParams{}};
  struct Case {
    const char* needle;
    ProblemShape shape;
  };
  const ProblemShape plain = cuda_shape_of(300, 300, 4, 1, 128);
  ProblemShape window = plain, right = plain, softcap = plain, sinks = plain, mla = plain;
  window.window_left = 127;
  right.causal = false;
  right.window_right = 0;  // FlashAttention's causal as a window
  softcap.softcap = 50.0;
  sinks.sinks = true;
  mla.d = 128;
  mla.d_v = 64;
  for (const Case& c : {Case{"v: a V head dim unlike Q/K's (d_v 64, d 128) has no CUDA kernel", mla}}) {
    for (const Policy& policy : policies) {
      SCOPED_TRACE(std::string(c.needle) + ", " + policy_name(policy));
      const Status st = check_support(c.shape, policy, &n);
      EXPECT_EQ(st.code(), StatusCode::kUnsupported);
      EXPECT_NE(st.message().find(c.needle), std::string::npos) << st.message();
    }
  }
  ProblemShape chunked = plain;  // Llama 4's chunked local attention, alone and with a window
  chunked.attention_chunk = 8192;
  ProblemShape chunked_window = window;
  chunked_window.attention_chunk = 300;
  ProblemShape window_sinks_softcap = window;  // gpt-oss's window and sinks, Gemma 2's cap: together
  window_sinks_softcap.sinks = true;
  window_sinks_softcap.softcap = 50.0;
  struct Featured {
    const char* feature;  // the refusal's subject for the other policies
    ProblemShape shape;
  };
  BlockSparseParams mask;
  for (const Featured& f : {Featured{"window_left/window_right: local (sliding-window) attention", window},
                            Featured{"window_left/window_right: local (sliding-window) attention", right},
                            Featured{"attention_chunk: chunked local attention", chunked},
                            Featured{"attention_chunk: chunked local attention", chunked_window},
                            Featured{"softcap: score soft-capping", softcap},
                            Featured{"sinks: learned attention sinks", sinks},
                            Featured{"window_left/window_right: local (sliding-window) attention", window_sinks_softcap}}) {
    const ProblemShape& shape = f.shape;
    SCOPED_TRACE(std::string(f.feature) + ": window (" + std::to_string(shape.window_left) + ", " +
                 std::to_string(shape.window_right) + ")" + (shape.causal ? " causal" : "") +
                 (shape.softcap != 0.0 ? ", softcap" : "") + (shape.sinks ? ", sinks" : ""));
    mask.mask = BlockMask::all_visible(shape, 128, 64, false);
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}}) {
      SCOPED_TRACE(policy_name(policy));
      EXPECT_TRUE(check_support(shape, policy, &n).ok());
      EXPECT_EQ(n, std::holds_alternative<DenseParams>(policy) ? dense_block_k(128) : 64);
      EXPECT_EQ(choose_fwd_path(shape, policy, true, 9, 0), choose_fwd_path(plain, policy, true, 9, 0));
    }
    for (const Policy& policy : policies) {
      if (std::holds_alternative<DenseParams>(policy)) continue;
      SCOPED_TRACE(policy_name(policy));
      const Status st = check_support(shape, policy, &n);
      EXPECT_EQ(st.code(), StatusCode::kUnsupported);
      EXPECT_NE(st.message().find(std::string(f.feature) + " runs dense and block_sparse on CUDA, not " +
                                  policy_name(policy)),
                std::string::npos)
          << st.message();
    }
  }
  // fp8 inputs take the window on the Hopper instance as 16-bit ones do, but no softcap or sinks.
  ProblemShape fp8 = cuda_shape_of(300, 300, 4, 1, 128, DType::kFP8E4M3);
  fp8.window_left = 127;
  EXPECT_TRUE(check_support(fp8, DenseParams{}, &n).ok());
  ProblemShape fp8_cap = fp8, fp8_sinks = fp8;
  fp8_cap.softcap = 50.0;
  fp8_sinks.sinks = true;
  for (const ProblemShape& shape : {fp8_cap, fp8_sinks}) {
    const Status st = check_support(shape, DenseParams{}, &n);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find("fp8_e4m3 inputs on CUDA take no softcap or sinks"), std::string::npos) << st.message();
  }
  // A causal window that hides nothing more than causal ((-1, 0) and (-1, 5) under causal) runs
  // every policy.
  ProblemShape causal_right = plain;
  causal_right.window_right = 5;
  for (const Policy& policy : policies) EXPECT_TRUE(check_support(causal_right, policy, &n).ok()) << policy_name(policy);
  EXPECT_NE(support_summary().find("local windows and chunks (window_size, attention_chunk): dense and block_sparse on both paths, with softcap "
                                   "and learned sinks on bf16 and fp16"),
            std::string::npos);
}

// Head dims 256 (Gemma 3) and q/k 192 with v 128 (MLA-style prefill): the portable kernel's
// instances run dense, block_sparse, exact_gate and softmax_skip, its selector estimate_select
// (with and without mean correction), on bf16 and fp16, on a Hopper device on the Hopper forward
// instance over contiguous K/V (the portable one over pages read in the kernel and on other
// devices), with calibration statistics; permute_stop
// is refused by name before anything else (no permute kernel there), and fp8 keeps its one head
// dim.
TEST(CudaPlan, FamilyHeadDimsRunTheirPoliciesOnTheirPaths) {
  int n = 0;
  ExactGateParams gate;
  gate.block_k = 128;
  PermuteStopParams stop;
  stop.block_k = 32;  // refused for its head dim before its block size
  const auto expect_family_dims = [&](DType dtype, int d, int d_v, const std::string& subject) {
    ProblemShape s = cuda_shape_of(300, 700, 4, 2, d, dtype);
    s.d_v = d_v;
    BlockSparseParams mask;
    mask.mask = BlockMask::all_visible(s, 128, 128, false);
    EstimateSelectParams corrected;
    corrected.mean_correction = true;
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}, Policy{gate}, Policy{SoftmaxSkipParams{}},
                                 Policy{EstimateSelectParams{}}, Policy{corrected}}) {
      SCOPED_TRACE(policy_name(policy));
      EXPECT_TRUE(check_support(s, policy, &n).ok());
      EXPECT_EQ(n, std::holds_alternative<DenseParams>(policy) ? dense_block_k(d) : 128);
      EXPECT_EQ(choose_fwd_path(s, policy, true, 9, 0), FwdPath::kHopper);
      EXPECT_EQ(choose_fwd_path(s, policy, true, 8, 0), FwdPath::kPortable);
      EXPECT_EQ(choose_fwd_path(with_pages(s, 16), policy, true, 9, 0), FwdPath::kPortable);
    }
    EXPECT_EQ(choose_select_path(s, 9, 0, false), FwdPath::kPortable);
    EXPECT_TRUE(check_calib_support(s, 128, 64).ok());  // exact_gate's thresholds calibrate here too
    const Status st = check_support(s, stop, &n);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find(subject + " runs dense, block_sparse, exact_gate, softmax_skip and estimate_select on "
                                          "CUDA, not permute_stop"),
              std::string::npos)
        << st.message();
  };
  for (const DType dtype : {DType::kBF16, DType::kFP16}) {
    for (const auto& [d, d_v, subject] :
         {std::tuple{256, 256, "head_dim 256"}, std::tuple{192, 128, "head_dim 192 (d_v 128)"}}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + subject);
      expect_family_dims(dtype, d, d_v, subject);
    }
  }
  const Status fp8 = check_support(cuda_shape_of(300, 300, 4, 1, 96, DType::kFP8E4M3), DenseParams{}, &n);
  EXPECT_EQ(fp8.code(), StatusCode::kUnsupported);
  EXPECT_NE(fp8.message().find("head_dim 128 and 256 only (the Hopper kernel's fp8 instances), got 96"),
            std::string::npos)
      << fp8.message();
  for (const char* dims : {"bf16 d=256", "fp16 d=192 d_v=128"}) {
    EXPECT_NE(support_summary().find(std::string(dims) + " (dense, block_sparse, exact_gate, softmax_skip and "
                                                         "estimate_select)"),
              std::string::npos)
        << support_summary();
  }
  EXPECT_EQ(support_summary().find("d=128 (dense"), std::string::npos) << support_summary();
}

// Head dim 96 (Phi-3) has every portable kernel: each policy runs there on bf16 and fp16, with the
// d 96 instances of its decision kernels (the two-pass exact_gate's gate kernel, permute_stop's
// ranking, the gated forward loop, the selector) and calibration statistics; on a Hopper device
// on the Hopper forward instance over contiguous K/V, but permute_stop (no Hopper permute
// instance at 96) and pages read in the kernel (no paged one) on the portable path.
TEST(CudaPlan, HeadDim96RunsEveryPolicy) {
  for (const DType dtype : {DType::kBF16, DType::kFP16}) {
    const std::string dt = dtype_name(dtype);
    SCOPED_TRACE(dt);
    const ProblemShape s = cuda_shape_of(300, 700, 4, 2, 96, dtype);
    ExactGateParams gate;
    gate.block_k = 128;
    PermuteStopParams stop;
    stop.block_k = 64;
    BlockSparseParams mask;
    mask.mask = BlockMask::all_visible(s, 128, 128, false);
    EstimateSelectParams corrected;
    corrected.mean_correction = true;
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}, Policy{gate}, Policy{SoftmaxSkipParams{}},
                                 Policy{EstimateSelectParams{}}, Policy{corrected}, Policy{stop}}) {
      SCOPED_TRACE(policy_name(policy));
      int n = 0;
      EXPECT_TRUE(check_support(s, policy, &n).ok());
      const bool permute = std::holds_alternative<PermuteStopParams>(policy);
      EXPECT_EQ(choose_fwd_path(s, policy, true, 9, 0), permute ? FwdPath::kPortable : FwdPath::kHopper);
      EXPECT_EQ(choose_fwd_path(with_pages(s, 16), policy, true, 9, 0), FwdPath::kPortable);
      EXPECT_EQ(choose_fwd_path(s, policy, true, 8, 0), FwdPath::kPortable);
    }
    ASSERT_NE(find_fwd90(dtype, 96, 96, false), nullptr);
    EXPECT_EQ(find_fwd90(dtype, 96, 96, false)->name, "fwd_sm90_" + dt + "_hd96");
    EXPECT_EQ(find_fwd90(dtype, 96, 96, true), nullptr);
    ASSERT_NE(find_gate(dtype, 96), nullptr);
    EXPECT_EQ(find_gate(dtype, 96)->name, "gate_sm80_" + dt + "_hd96");
    EXPECT_NE(find_permute(dtype, 96), nullptr);
    EXPECT_EQ(find_gate90(dtype, 96), nullptr);
    EXPECT_EQ(find_permute90(dtype, 96), nullptr);
    EXPECT_TRUE(check_calib_support(s, 128, 64).ok());
    EXPECT_TRUE(compiled_policies(dtype, 96, 96).all());
  }
  EXPECT_NE(support_summary().find("bf16 d=96, "), std::string::npos) << support_summary();
}

// The window reaches the kernels only where it hides keys (ProblemShape::local()): a causal
// call's right bound leaves FwdParams' "no window" (-1, -1), which every kernel reads as plain
// causal attention (and the gated and mean-correction launches, which compile no window masks,
// accept); a local window arrives as given.
TEST(CudaPlan, ForwardParametersCarryTheWindowWhereItHidesKeys) {
  const test::TestProblem tp = test::build_problem(test::random_inputs({{300, 300}}, 4, 1, 64, DType::kBF16, 9));
  ProblemShape s;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  const auto window_of = [&](bool causal, int left, int right) {
    ProblemShape shape = s;
    shape.causal = causal;
    shape.window_left = left;
    shape.window_right = right;
    const FwdParams p = make_fwd_params(tp.problem(), shape, tp.output(), 64);
    EXPECT_EQ(p.causal, causal);
    return std::pair<int, int>{p.window_left, p.window_right};
  };
  EXPECT_EQ(window_of(true, -1, -1), std::make_pair(-1, -1));
  EXPECT_EQ(window_of(true, -1, 5), std::make_pair(-1, -1));
  EXPECT_EQ(window_of(true, 127, 5), std::make_pair(127, 5));
  EXPECT_EQ(window_of(false, -1, 0), std::make_pair(-1, 0));
  EXPECT_EQ(window_of(false, 30, 40), std::make_pair(30, 40));
  EXPECT_EQ(window_of(false, -1, -1), std::make_pair(-1, -1));
  const FwdParams zero{};  // value-initialised: no window
  EXPECT_EQ(zero.window_left, -1);
  EXPECT_EQ(zero.window_right, -1);
}

// A softcap makes the capped score the logit: the softmax's scale becomes 1 and the call's scale
// goes into the cap (rules::capped_score(cap_scale · q·k, c)); sinks arrive as the problem's
// tensor with its stride. Any feature selects the kFeatures kernel (has_features), none the
// feature-free one.
TEST(CudaPlan, ForwardParametersCarrySoftcapAndSinks) {
  test::Inputs in = test::random_inputs({{300, 300}}, 4, 1, 64, DType::kBF16, 11);
  in.sinks = {0.5, -1.0, 2.0, -test::kInf};
  test::LayoutOptions capped;
  capped.softcap = 30.0;
  const test::TestProblem tp = test::build_problem(in, capped);
  ProblemShape s;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  ASSERT_TRUE(s.sinks);
  ASSERT_EQ(s.softcap, 30.0);
  const FwdParams p = make_fwd_params(tp.problem(), s, tp.output(), 64);
  EXPECT_EQ(p.softcap, 30.f);
  EXPECT_EQ(p.cap_scale, static_cast<float>(s.scale));
  EXPECT_EQ(p.scale, 1.f);
  EXPECT_EQ(p.scale_log2, 1.4426950408889634f);
  EXPECT_EQ(p.sinks, tp.problem().sinks.data);
  EXPECT_EQ(p.sinks_stride, tp.problem().sinks.stride[0]);
  EXPECT_TRUE(has_features(p));
  ProblemShape plain = s;
  plain.softcap = 0.0;
  plain.sinks = false;
  const FwdParams q = make_fwd_params(tp.problem(), plain, tp.output(), 64);
  EXPECT_EQ(q.softcap, 0.f);
  EXPECT_EQ(q.sinks, nullptr);
  EXPECT_EQ(q.scale, static_cast<float>(s.scale));
  EXPECT_FALSE(has_features(q));
  FwdParams window = q;
  window.window_left = 10;
  EXPECT_TRUE(has_features(window));
}

TEST(CudaPlan, Fp8RunsDenseBlockSparseAndEstimateSelectOnTheHopperInstances) {
  int n = 0;
  const ProblemShape s = cuda_shape_of(300, 300, 4, 1, 128, DType::kFP8E4M3);
  const auto expect_unsupported = [&](const ProblemShape& shape, const Policy& policy, const char* needle) {
    const Status st = check_support(shape, policy, &n);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.message();
  };
  // Dense and 128 x 128 block masks run, on the Hopper path of a 9.0 device only.
  ASSERT_TRUE(check_support(s, DenseParams{}, &n).ok());
  BlockSparseParams mask;
  mask.mask = BlockMask::empty(s, 128, 128, false);
  ASSERT_TRUE(check_support(s, mask, &n).ok());
  EXPECT_EQ(n, 128);
  // estimate_select without mean correction: the fp8 selector (e4m3 queries against bf16 means),
  // then the fp8 forward instance on its mask.
  EstimateSelectParams es;
  es.block = 128;
  es.alpha = 0.1;
  ASSERT_TRUE(check_support(s, es, &n).ok());
  EXPECT_EQ(n, 128);
  const SelectVariant* selector = find_select90(DType::kFP8E4M3, 128);
  ASSERT_NE(selector, nullptr);
  EXPECT_STREQ(selector->name, "select_sm90_fp8_hd128");
  EXPECT_EQ(find_select(DType::kFP8E4M3, 128, 128), nullptr);  // no portable selector reads e4m3
  for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}, Policy{es}}) {
    EXPECT_EQ(choose_fwd_path(s, policy, true, 9, 0), FwdPath::kHopper);
    EXPECT_EQ(choose_fwd_path(s, policy, true, 8, 0), FwdPath::kPortable);  // run_cuda then refuses
    EXPECT_EQ(choose_fwd_path(s, policy, false, 9, 0), FwdPath::kPortable);
  }
  // Everything else says what is missing and where it runs.
  mask.mask = BlockMask::empty(s, 128, 64, false);
  expect_unsupported(s, mask, "fp8_e4m3 inputs on CUDA need 128 x 128 blocks, got 128 x 64");
  // exact_gate and softmax_skip on 128-key blocks: the gates in the fp8 instance's loop, one pass.
  ExactGateParams gate;
  gate.block_k = 128;
  SoftmaxSkipParams skip;
  skip.block_k = 128;
  for (const Policy& policy : {Policy{gate}, Policy{skip}}) {
    ASSERT_TRUE(check_support(s, policy, &n).ok());
    EXPECT_EQ(n, 128);
    EXPECT_EQ(choose_fwd_path(s, policy, true, 9, 0), FwdPath::kHopper);
  }
  gate.block_k = 64;
  expect_unsupported(s, gate, "exact_gate: fp8_e4m3 inputs on CUDA need 128 x 128 blocks, got 128 x 64");
  skip.block_k = 64;
  expect_unsupported(s, skip, "softmax_skip: fp8_e4m3 inputs on CUDA need 128 x 128 blocks, got 128 x 64");
  PermuteStopParams stop;
  stop.block_k = 128;
  expect_unsupported(s, stop,
                     "permute_stop: fp8_e4m3 inputs on CUDA run dense, block_sparse, exact_gate, softmax_skip and "
                     "estimate_select");
  // Mean correction: the fp8 forward instance of the selector's head dim has the mean tiles.
  EstimateSelectParams corrected = es;
  corrected.mean_correction = true;
  EXPECT_TRUE(check_support(s, corrected, &n).ok());
  EXPECT_EQ(choose_fwd_path(s, corrected, true, 9, 0), FwdPath::kHopper);
  EstimateSelectParams small = es;
  small.block = 64;
  expect_unsupported(s, small, "estimate_select: the CUDA selector needs block = 128, got 64");
  expect_unsupported(cuda_shape_of(300, 300, 4, 1, 64, DType::kFP8E4M3), DenseParams{},
                     "fp8_e4m3 inputs run on CUDA with head_dim 128 and 256 only (the Hopper kernel's fp8 instances), "
                     "got 64");
  // At 256 every policy of 128 too, estimate_select on the fp8 d 256 selector.
  const ProblemShape wide = cuda_shape_of(300, 300, 4, 1, 256, DType::kFP8E4M3);
  BlockSparseParams wide_mask;
  wide_mask.mask = BlockMask::empty(wide, 128, 128, false);
  for (const Policy& policy : {Policy{DenseParams{}}, Policy{wide_mask}, Policy{es}, Policy{corrected}}) {
    EXPECT_TRUE(check_support(wide, policy, &n).ok());
    EXPECT_EQ(choose_fwd_path(wide, policy, true, 9, 0), FwdPath::kHopper);
  }
  ASSERT_NE(find_select90(DType::kFP8E4M3, 256), nullptr);
  EXPECT_STREQ(find_select90(DType::kFP8E4M3, 256)->name, "select_sm90_fp8_hd256");
  ProblemShape paged = s;
  paged.kv_layout = KvLayout::kPaged;
  paged.page_size = 16;
  expect_unsupported(paged, DenseParams{}, "fp8_e4m3 inputs need contiguous K/V on CUDA");
}

// The portable forward kernel's gates run in its gated instances, contiguous ungated calls
// without mean correction in the plain ones and the rest in the general ones (launch_fwd
// refuses the others' calls); all three exist for every compiled (dtype, head_dim).
TEST(CudaPlan, PortableInstancesSplitByTheGatesAndTheLayout) {
  EXPECT_FALSE(gated_mode(PolicyMode::kDense));
  EXPECT_FALSE(gated_mode(PolicyMode::kBlockMask));
  EXPECT_TRUE(gated_mode(PolicyMode::kExactGate));
  EXPECT_TRUE(gated_mode(PolicyMode::kSoftmaxSkip));
  // plain_call: ungated, contiguous K/V, no mean correction.
  FwdParams p{};
  p.mode = PolicyMode::kDense;
  EXPECT_TRUE(plain_call(p));
  p.mode = PolicyMode::kBlockMask;
  EXPECT_TRUE(plain_call(p));
  const std::uint16_t means[1] = {0};
  p.k_mean = means;  // mean correction
  EXPECT_FALSE(plain_call(p));
  p.mode = PolicyMode::kDense;
  EXPECT_TRUE(plain_call(p));  // means only count under block masks
  p.k_mean = nullptr;
  const std::int32_t table[1] = {0};
  p.paged.block_table = table;  // paged K/V read in the kernel
  EXPECT_FALSE(plain_call(p));
  p.paged.block_table = nullptr;
  p.mode = PolicyMode::kExactGate;
  EXPECT_FALSE(plain_call(p));
  for (DType dtype : {DType::kBF16, DType::kFP16}) {
    for (int d : {64, 96, 128}) {
      const FwdVariant* plain = find_fwd(dtype, d, d, false, true);
      const FwdVariant* general = find_fwd(dtype, d, d, false, false);
      const FwdVariant* gated = find_fwd(dtype, d, d, true, false);
      ASSERT_NE(plain, nullptr) << dtype_name(dtype) << " d=" << d;
      ASSERT_NE(general, nullptr) << dtype_name(dtype) << " d=" << d;
      ASSERT_NE(gated, nullptr) << dtype_name(dtype) << " d=" << d;
      EXPECT_EQ(find_fwd(dtype, d, d, true, true), nullptr);  // the gated instance runs every layout
      EXPECT_TRUE(plain->plain && !plain->gated);
      EXPECT_TRUE(!general->plain && !general->gated);
      EXPECT_TRUE(gated->gated && !gated->plain);
      EXPECT_EQ(plain->dtype, dtype);
      EXPECT_EQ(gated->head_dim, d);
      // The GPU tests check an instance family by prefix: the plain name starts the general
      // one, and neither starts the gated one.
      EXPECT_EQ(std::string(general->name).rfind(plain->name, 0), 0u) << general->name;
      EXPECT_EQ(std::string(gated->name).rfind("fwd_sm80_gated_", 0), 0u) << gated->name;
      EXPECT_EQ(std::string(plain->name).find("gated"), std::string::npos) << plain->name;
    }
  }
  EXPECT_EQ(find_fwd(DType::kFP8E4M3, 128, 128, false, true), nullptr);  // fp8 runs on the Hopper kernel only
  EXPECT_EQ(find_fwd(DType::kBF16, 192, 192, false, true), nullptr);  // 192 only with d_v 128 (MLA)
  ASSERT_NE(find_fwd(DType::kBF16, 192, 128, false, true), nullptr);
  EXPECT_EQ(find_fwd(DType::kBF16, 192, 128, false, true)->head_dim_v, 128);
}

TEST(CudaPlan, HopperPathOnComputeCapability90For128KeyBlocks) {
  const ProblemShape s = cuda_shape_of(300, 300, 4, 1, 128);
  EXPECT_EQ(choose_fwd_path(s, DenseParams{}, true, 9, 0), FwdPath::kHopper);
  EXPECT_EQ(choose_fwd_path(cuda_shape_of(17, 40, 8, 8, 64, DType::kFP16), DenseParams{}, true, 9, 0), FwdPath::kHopper);
  // Every policy with 128-key blocks runs there too; 64-key blocks keep the portable kernel.
  ASSERT_EQ(hopper_block_k(), 128);
  ExactGateParams gate;
  gate.block_k = 128;
  EXPECT_EQ(choose_fwd_path(s, gate, true, 9, 0), FwdPath::kHopper);
  gate.block_k = 64;
  EXPECT_EQ(choose_fwd_path(s, gate, true, 9, 0), FwdPath::kPortable);
  SoftmaxSkipParams skip;
  skip.block_k = 128;
  EXPECT_EQ(choose_fwd_path(s, skip, true, 9, 0), FwdPath::kHopper);
  skip.block_k = 64;
  EXPECT_EQ(choose_fwd_path(s, skip, true, 9, 0), FwdPath::kPortable);
  BlockSparseParams mask;
  mask.mask = BlockMask::empty(s, 128, 128, false);
  EXPECT_EQ(choose_fwd_path(s, mask, true, 9, 0), FwdPath::kHopper);
  mask.mask = BlockMask::empty(s, 128, 64, false);
  EXPECT_EQ(choose_fwd_path(s, mask, true, 9, 0), FwdPath::kPortable);
  EstimateSelectParams select;
  select.block = 128;
  EXPECT_EQ(choose_fwd_path(s, select, true, 9, 0), FwdPath::kHopper);
  select.mean_correction = true;
  EXPECT_EQ(choose_fwd_path(s, select, true, 9, 0), FwdPath::kHopper);
  // permute_stop: its Hopper attention kernel takes 128-key chunks.
  PermuteStopParams permute;
  EXPECT_EQ(permute.block_k, 128);
  EXPECT_EQ(choose_fwd_path(s, permute, true, 9, 0), FwdPath::kHopper);
  EXPECT_EQ(choose_fwd_path(cuda_shape_of(17, 40, 8, 8, 64, DType::kFP16), permute, true, 9, 0), FwdPath::kHopper);
  permute.block_k = 64;
  EXPECT_EQ(choose_fwd_path(s, permute, true, 9, 0), FwdPath::kPortable);
  permute.block_k = 128;
  // sm_90a code runs on compute capability 9.0 alone: Ampere, Ada and Blackwell stay portable.
  for (const Policy& policy : {Policy{DenseParams{}}, Policy{select}, Policy{permute}}) {
    EXPECT_EQ(choose_fwd_path(s, policy, true, 8, 0), FwdPath::kPortable);
    EXPECT_EQ(choose_fwd_path(s, policy, true, 8, 9), FwdPath::kPortable);
    EXPECT_EQ(choose_fwd_path(s, policy, true, 10, 0), FwdPath::kPortable);
    // Tensors TMA cannot describe stay portable.
    EXPECT_EQ(choose_fwd_path(s, policy, false, 9, 0), FwdPath::kPortable);
  }
}

// estimate_select's selector needs no tensor maps: Hopper on 9.0 for every compiled (dtype,
// head_dim), also where the tensors keep the attention portable; the override wins.
TEST(CudaPlan, HopperSelectorOnComputeCapability90) {
  for (const ProblemShape& s : {cuda_shape_of(300, 300, 4, 1, 128), cuda_shape_of(17, 40, 8, 8, 64, DType::kFP16)}) {
    EXPECT_EQ(choose_select_path(s, 9, 0, false), FwdPath::kHopper);
    EXPECT_EQ(choose_select_path(s, 9, 0, true), FwdPath::kPortable);
    EXPECT_EQ(choose_select_path(s, 8, 0, false), FwdPath::kPortable);
    EXPECT_EQ(choose_select_path(s, 8, 9, false), FwdPath::kPortable);
    EXPECT_EQ(choose_select_path(s, 10, 0, false), FwdPath::kPortable);
  }
  // fp8: one sm90 selector, head dim 128 (check_support refuses the others by name).
  EXPECT_EQ(choose_select_path(cuda_shape_of(300, 300, 4, 1, 128, DType::kFP8E4M3), 9, 0, false), FwdPath::kHopper);
  EXPECT_EQ(choose_select_path(cuda_shape_of(300, 300, 4, 1, 64, DType::kFP8E4M3), 9, 0, false), FwdPath::kPortable);
}

// A paged problem (shuffled pages, NaN in every storage no valid key uses) and its shape.
test::TestProblem paged_problem(int page_size, ProblemShape* shape) {
  const test::Inputs in = test::random_inputs({{40, 70}, {17, 33}, {5, 0}}, 4, 2, 64, DType::kBF16, 13, 1.0);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kPaged;
  opt.page_size = page_size;
  test::TestProblem tp = test::build_problem(in, opt);
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, shape).ok());
  return tp;
}

TEST(CudaPlan, PagedKvRunsEveryPolicy) {
  ProblemShape s;
  const test::TestProblem tp = paged_problem(16, &s);
  ASSERT_EQ(s.kv_layout, KvLayout::kPaged);
  int n = 0;
  ExactGateParams gate;
  gate.block_k = 64;
  for (const Policy& policy : {Policy{DenseParams{}}, Policy{gate}, Policy{SoftmaxSkipParams{}},
                               Policy{EstimateSelectParams{}}, Policy{PermuteStopParams{}}}) {
    const Status st = check_support(s, policy, &n);
    EXPECT_TRUE(st.ok()) << policy_name(policy) << ": " << st.to_string();
  }
  EXPECT_NE(support_summary().find("paged K/V (any page size): every policy on the portable path"), std::string::npos);
  EXPECT_NE(support_summary().find("contiguous or paged K/V of any page size"), std::string::npos);
}

TEST(CudaPlan, GatheredRowOffsetsFitThirtyTwoBitsOfSixteenByteUnits) {
  // [pages, page_size, h_kv 8, d 128]: rows 1024 elements apart, pages page_size rows.
  EXPECT_TRUE(gather_offsets_fit(1, 1, 1024, 1024));
  EXPECT_TRUE(gather_offsets_fit(1 << 20, 16, 16 * 1024, 1024));  // 16 M rows: 2^34 elements
  const std::int64_t limit = std::int64_t{1} << 35;               // elements
  // The last row of the last page starts at (pages - 1) · page_stride + (page_size - 1) · row_stride.
  EXPECT_TRUE(gather_offsets_fit(limit / 16384, 16, 16384, 1024));   // last row at 2^35 - 1024
  EXPECT_FALSE(gather_offsets_fit(limit / 16384 + 1, 16, 16384, 1024));
  EXPECT_TRUE(gather_offsets_fit(1, 1 << 25, 0, 1024));              // one page: last row at 2^35 - 1024
  EXPECT_FALSE(gather_offsets_fit(1, (1 << 25) + 1, 0, 1024));
  // A K and V interleaved cache ([pages, 2, page_size, ...]: page stride twice the rows).
  EXPECT_TRUE(gather_offsets_fit(4096, 16, 2 * 16 * 1024, 1024));
  // Strides the 16-byte units cannot express, negative ones, nothing to address.
  EXPECT_FALSE(gather_offsets_fit(2, 16, 16 * 1024 + 4, 1024));
  EXPECT_FALSE(gather_offsets_fit(2, 16, 16 * 1024, 1020));
  EXPECT_FALSE(gather_offsets_fit(2, 16, -16 * 1024, 1024));
  EXPECT_FALSE(gather_offsets_fit(2, 16, 16 * 1024, -1024));
  EXPECT_FALSE(gather_offsets_fit(0, 16, 16 * 1024, 1024));
  // Products that overflow 64 bits are refused, not wrapped.
  EXPECT_FALSE(gather_offsets_fit(std::int64_t{1} << 40, 16, std::int64_t{1} << 40, 1024));
  EXPECT_FALSE(gather_offsets_fit(2, 1 << 30, 0, std::int64_t{1} << 40));
}

TEST(CudaPlan, PagedKvOnTheHopperPathForEveryPageSize) {
  // TMA boxes for pages of 64 keys or more tiling the 128-key tile or holding whole tiles; rows
  // gathered for the rest.
  for (int page_size : {1, 2, 3, 4, 8, 12, 16, 20, 24, 32, 40, 96, 200}) EXPECT_TRUE(hopper_gathers_pages(page_size)) << page_size;
  for (int page_size : {64, 128, 256, 384, 512}) EXPECT_FALSE(hopper_gathers_pages(page_size)) << page_size;
  for (int page_size : {8, 16, 32, 64, 128, 256, 384}) EXPECT_TRUE(hopper_can_box_pages(page_size)) << page_size;
  for (int page_size : {1, 4, 12, 24, 40, 96, 200}) EXPECT_FALSE(hopper_can_box_pages(page_size)) << page_size;
  ExactGateParams gate128;
  gate128.block_k = 128;
  ExactGateParams gate64;
  gate64.block_k = 64;
  EstimateSelectParams select;
  select.block = 128;
  select.mean_correction = true;
  BlockSparseParams mask;
  for (int page_size : {1, 3, 8, 16, 24, 64, 256}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size));
    ProblemShape s;
    const test::TestProblem tp = paged_problem(page_size, &s);
    ASSERT_EQ(s.kv_layout, KvLayout::kPaged);
    mask.mask = BlockMask::empty(s, 128, 128, false);
    // Dense and the 128-key-block policies run the Hopper kernel's paged instances on 9.0
    // whatever the page size (TMA boxes for pages of whole tiles, gathered rows otherwise);
    // 64-key blocks keep the portable kernel, as do other devices and tensors TMA cannot
    // describe.
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{gate128}, Policy{select}, Policy{mask}}) {
      EXPECT_EQ(choose_fwd_path(s, policy, true, 9, 0), FwdPath::kHopper) << policy_name(policy);
      EXPECT_EQ(choose_fwd_path(s, policy, true, 8, 0), FwdPath::kPortable) << policy_name(policy);
      EXPECT_EQ(choose_fwd_path(s, policy, false, 9, 0), FwdPath::kPortable) << policy_name(policy);
    }
    EXPECT_EQ(choose_fwd_path(s, gate64, true, 9, 0), FwdPath::kPortable);
    // permute_stop's Hopper kernel gathers contiguous rows only.
    EXPECT_EQ(choose_fwd_path(s, PermuteStopParams{}, true, 9, 0), FwdPath::kPortable);
  }
}

TEST(CudaPlan, PagedParamsAndTheCompactBlockTable) {
  for (int page_size : {1, 3, 16, 64}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size));
    ProblemShape s;
    const test::TestProblem tp = paged_problem(page_size, &s);
    const AttentionProblem problem = tp.problem();
    const AttentionOutput out = tp.output();
    // Rows are found through the table from the tensor's start: no per-sequence K/V offset.
    for (const SeqInfo& info : make_seq_infos(problem, s, out)) {
      EXPECT_EQ(info.k_off, 0);
      EXPECT_EQ(info.v_off, 0);
    }
    const FwdParams p = make_fwd_params(problem, s, out, 64);
    EXPECT_EQ(p.paged.block_table, nullptr);  // uploaded by the dispatcher
    EXPECT_EQ(p.paged.page_size, page_size);
    EXPECT_EQ(p.paged.k_page_stride, problem.k.stride[0]);
    EXPECT_EQ(p.paged.v_page_stride, problem.v.stride[0]);
    EXPECT_EQ(p.paged.gather_rows, hopper_gathers_pages(page_size));
    EXPECT_EQ(p.k_row_stride, problem.k.stride[1]);
    EXPECT_EQ(p.k_head_stride, problem.k.stride[2]);
    // [batch, most pages used]: each sequence's used entries, zeros after them.
    const std::int64_t stride = (70 + page_size - 1) / page_size;
    EXPECT_EQ(p.paged.table_stride, stride);
    const std::vector<std::int32_t> table = compact_block_table(problem, s);
    ASSERT_EQ(table.size(), static_cast<std::size_t>(3 * stride));
    const auto* src = static_cast<const std::int32_t*>(problem.block_table.data);
    for (int b = 0; b < 3; ++b) {
      const std::int64_t used = (s.seq_k[static_cast<std::size_t>(b)] + page_size - 1) / page_size;
      for (std::int64_t i = 0; i < stride; ++i) {
        const std::int32_t want = i < used ? src[b * problem.block_table.stride[0] + i * problem.block_table.stride[1]] : 0;
        EXPECT_EQ(table[static_cast<std::size_t>(b * stride + i)], want) << "b " << b << " page " << i;
      }
    }
    // A strided (column-major) view of the same table compacts to the same entries.
    const std::int64_t rows = problem.block_table.shape[0], cols = problem.block_table.shape[1];
    std::vector<std::int32_t> transposed(static_cast<std::size_t>(rows * cols));
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < cols; ++c) {
        transposed[static_cast<std::size_t>(c * rows + r)] = src[r * problem.block_table.stride[0] + c * problem.block_table.stride[1]];
      }
    }
    AttentionProblem strided = problem;
    strided.block_table.data = transposed.data();
    strided.block_table.stride[0] = 1;
    strided.block_table.stride[1] = rows;
    EXPECT_EQ(compact_block_table(strided, s), table);
  }
  // Every sequence empty: the table still has one entry per sequence (a null device table
  // would read as contiguous K/V).
  const test::Inputs in = test::random_inputs({{4, 0}}, 2, 1, 64, DType::kBF16, 14, 1.0);
  test::LayoutOptions opt;
  opt.layout = test::Layout::kPaged;
  const test::TestProblem tp = test::build_problem(in, opt);
  ProblemShape s;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  EXPECT_EQ(compact_block_table(tp.problem(), s).size(), 1u);
}

// Staging paged K/V: a long prefill stages (the copy is a fraction of a percent of its
// attention), a short chunk over a long cache or a sparse call does not, a full device does not,
// and the staged shape reads varlen rows packed sequence after sequence.
// SPARSEPREFILL_CUDA_PATH: unset, empty and "auto" leave the choice to choose_fwd_path,
// "portable" and "hopper" force a path, anything else is an error naming the variable.
TEST(CudaPlan, PathOverrideFromTheEnvironment) {
  using CudaPath = ExecutionOverrides::CudaPath;
  CudaPath mode = CudaPath::kHopper;
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto"}) {
    ASSERT_TRUE(cuda_path_mode(v, &mode).ok()) << (v ? v : "(unset)");
    EXPECT_EQ(mode, CudaPath::kAuto) << (v ? v : "(unset)");
  }
  ASSERT_TRUE(cuda_path_mode("portable", &mode).ok());
  EXPECT_EQ(mode, CudaPath::kPortable);
  ASSERT_TRUE(cuda_path_mode("hopper", &mode).ok());
  EXPECT_EQ(mode, CudaPath::kHopper);
  for (const char* v : {"sm90", "Portable", "portable "}) {
    const Status st = cuda_path_mode(v, &mode);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << v;
    EXPECT_NE(st.message().find("SPARSEPREFILL_CUDA_PATH: expected \"auto\", \"portable\" or \"hopper\""),
              std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find(v), std::string::npos) << st.message();
  }
}

TEST(CudaPlan, PackGqaModeFromTheEnvironment) {
  PackGqa mode = PackGqa::kNever;
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto"}) {
    ASSERT_TRUE(pack_gqa_mode(v, &mode).ok()) << (v ? v : "(unset)");
    EXPECT_EQ(mode, PackGqa::kAuto) << (v ? v : "(unset)");
  }
  ASSERT_TRUE(pack_gqa_mode("always", &mode).ok());
  EXPECT_EQ(mode, PackGqa::kAlways);
  ASSERT_TRUE(pack_gqa_mode("never", &mode).ok());
  EXPECT_EQ(mode, PackGqa::kNever);
  for (const char* v : {"on", "1", "Always", "never "}) {
    const Status st = pack_gqa_mode(v, &mode);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << v;
    EXPECT_NE(st.message().find("SPARSEPREFILL_PACK_GQA: expected \"auto\", \"always\" or \"never\""),
              std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find(v), std::string::npos) << st.message();
  }
}

TEST(CudaPlan, GatePassesFromTheEnvironment) {
  GatePasses mode = GatePasses::kOne;
  for (const char* v : {static_cast<const char*>(nullptr), "", "auto"}) {
    ASSERT_TRUE(gate_passes_mode(v, &mode).ok()) << (v ? v : "(unset)");
    EXPECT_EQ(mode, GatePasses::kAuto) << (v ? v : "(unset)");
  }
  ASSERT_TRUE(gate_passes_mode("1", &mode).ok());
  EXPECT_EQ(mode, GatePasses::kOne);
  ASSERT_TRUE(gate_passes_mode("2", &mode).ok());
  EXPECT_EQ(mode, GatePasses::kTwo);
  for (const char* v : {"two", "3", "0", "1 "}) {
    const Status st = gate_passes_mode(v, &mode);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << v;
    EXPECT_NE(st.message().find("SPARSEPREFILL_EXACT_GATE_PASSES: expected \"auto\", \"1\" or \"2\""), std::string::npos)
        << st.message();
    EXPECT_NE(st.message().find(v), std::string::npos) << st.message();
  }
}

// Two passes only where a decision kernel reads K (contiguous 16-bit K/V, the path's decision
// instance compiled), and there unless one pass is asked for.
TEST(CudaPlan, GatePassesWhereTheDecisionKernelRuns) {
  const ProblemShape llama = cuda_shape_of(32768, 32768, 32, 8, 128);
  const ProblemShape smol = cuda_shape_of(8192, 8192, 9, 3, 64, DType::kFP16);
  for (const ProblemShape& s : {llama, smol}) {
    EXPECT_TRUE(choose_gate_passes(s, true, GatePasses::kAuto));
    EXPECT_TRUE(choose_gate_passes(s, true, GatePasses::kTwo));
    EXPECT_FALSE(choose_gate_passes(s, true, GatePasses::kOne));
    EXPECT_FALSE(choose_gate_passes(s, false, GatePasses::kTwo));
    EXPECT_FALSE(choose_gate_passes(s, false, GatePasses::kAuto));
  }
  ProblemShape paged = llama;
  paged.kv_layout = KvLayout::kPaged;
  EXPECT_FALSE(choose_gate_passes(paged, true, GatePasses::kTwo));
  const ProblemShape fp8 = cuda_shape_of(4096, 4096, 32, 8, 128, DType::kFP8E4M3);
  EXPECT_FALSE(choose_gate_passes(fp8, true, GatePasses::kTwo));
}

// The decision kernels' lists: every row's group A in its fixed room, and every row's gated
// blocks once (summed independently over the blocks here), for causal and non-causal varlen
// batches whose query blocks run past the shorter sequences' ends; and the per-sequence sums
// the rows' starts come from (gate_seq_gated), a sequence at a time.
TEST(CudaPlan, GateListEntriesCountEveryRowsBlocks) {
  for (bool causal : {true, false}) {
    for (int bk : {64, 128}) {
      ProblemShape s = cuda_shape_of(1000, 1300, 6, 2, 128);
      s.causal = causal;
      s.batch = 3;
      s.seq_q = {1000, 5, 260};
      s.seq_k = {1300, 1000, 200};
      s.q_start = {0, 1000, 1005};
      s.k_start = {0, 1300, 2300};
      const int num_q_blocks = 8;  // ceil(1000 / 128)
      std::int64_t full = 0;
      std::vector<std::int64_t> seq_gated = {0};
      for (int b = 0; b < s.batch; ++b) {
        const geom::BlockGeometry g{{s.seq_q[static_cast<std::size_t>(b)], s.seq_k[static_cast<std::size_t>(b)], causal}, 128, bk};
        std::int64_t gated = 0;
        for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
          for (int kb = 0; kb < g.visible_end(qb); ++kb) gated += causal ? g.is_full(qb, kb) : kb != g.num_k_blocks() - 1;
        }
        full += s.h_q * gated;
        seq_gated.push_back(seq_gated.back() + gated);
      }
      const GateListEntries e = gate_list_entries(s, bk, num_q_blocks);
      EXPECT_EQ(e.full, full) << (causal ? "causal" : "non-causal") << " bk " << bk;
      EXPECT_EQ(gate_seq_gated(s, bk), seq_gated) << (causal ? "causal" : "non-causal") << " bk " << bk;
      EXPECT_EQ(e.partial, std::int64_t{3} * 6 * num_q_blocks * (128 / bk + 1));
    }
  }
}

// The heads a decision CTA scores: the largest divisor of the group up to 4.
TEST(CudaPlan, GateHeadsPerCta) {
  const std::pair<int, int> cases[] = {{1, 1}, {2, 2}, {3, 3}, {4, 4}, {5, 1}, {6, 3}, {7, 1}, {8, 4}, {9, 3}, {12, 4}, {16, 4}};
  for (const auto& [group, heads] : cases) EXPECT_EQ(gate_heads_per_cta(group), heads) << "group " << group;
}

// GQA packing: only the group, only where every head of the group visits the same blocks, and
// under kAuto only where it saves 10% of the tiles.
TEST(CudaPlan, GqaPackingWhereTheGroupSharesItsVisits) {
  const PolicyMode dense = PolicyMode::kDense, mask = PolicyMode::kBlockMask;
  // Llama-3.1-8B (G = 4): a 32-token chunk fills one packed tile instead of four quarter-full
  // ones; 32K tokens fill their tiles either way.
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 32, 8, 128), dense, false, PackGqa::kAuto), 4);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32768, 32768, 32, 8, 128), dense, false, PackGqa::kAuto), 1);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32768, 32768, 32, 8, 128), dense, false, PackGqa::kAlways), 4);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 32, 8, 128), dense, false, PackGqa::kNever), 1);
  // The 10% rule: 200 rows, G = 4: 7 packed tiles against 8 (packs); 1000 rows: 32 against 32.
  EXPECT_EQ(choose_q_pack(cuda_shape_of(200, 200, 8, 2, 64), dense, false, PackGqa::kAuto), 4);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(1000, 1000, 8, 2, 64), dense, false, PackGqa::kAuto), 1);
  // Varlen: summed over the sequences (three of 40 rows and one of 128: 2 + 2 + 2 + 4 = 10
  // packed tiles of G = 4 against 4 · 4 = 16).
  ProblemShape ragged = cuda_shape_of(40, 40, 8, 2, 128);
  ragged.batch = 4;
  ragged.seq_q = {40, 40, 40, 128};
  ragged.seq_k = {40, 40, 40, 128};
  ragged.q_start = {0, 40, 80, 120};
  ragged.k_start = {0, 40, 80, 120};
  EXPECT_EQ(choose_q_pack(ragged, dense, false, PackGqa::kAuto), 4);
  // Block masks: only with one row per KV head.
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 32, 8, 128), mask, true, PackGqa::kAlways), 4);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 32, 8, 128), mask, false, PackGqa::kAlways), 1);
  // The gates decide per query head: never packed.
  for (PolicyMode gate : {PolicyMode::kExactGate, PolicyMode::kSoftmaxSkip}) {
    EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 32, 8, 128), gate, false, PackGqa::kAlways), 1);
  }
  // No group, or one that does not divide the 128-row tile (SmolLM2's 3, Qwen2.5-7B's 7).
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 8, 8, 128), dense, false, PackGqa::kAlways), 1);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 9, 3, 64), dense, false, PackGqa::kAlways), 1);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 28, 4, 128), dense, false, PackGqa::kAlways), 1);
  EXPECT_EQ(choose_q_pack(cuda_shape_of(32, 4096, 64, 4, 128), dense, false, PackGqa::kAlways), 16);
}

// The grid goes KV head outermost exactly when the call's K and V exceed the L2 (50 MiB here,
// an H100's; an H200 has 60): Llama-3.1-8B's 8 KV heads × d 128 in bf16 take 4 KiB per key.
TEST(CudaPlan, KvMajorGridOnceKvOutgrowsTheL2) {
  constexpr std::int64_t kL2 = std::int64_t{50} << 20;
  EXPECT_FALSE(kv_major_grid(cuda_shape_of(8192, 8192, 32, 8, 128), kL2));    // 32 MiB
  EXPECT_TRUE(kv_major_grid(cuda_shape_of(16384, 16384, 32, 8, 128), kL2));   // 64 MiB
  EXPECT_TRUE(kv_major_grid(cuda_shape_of(128, 16384, 32, 8, 128), kL2));     // a chunk reads every key
  EXPECT_FALSE(kv_major_grid(cuda_shape_of(8192, 8192, 9, 3, 64), kL2));      // SmolLM2: 6 MiB
  EXPECT_FALSE(kv_major_grid(cuda_shape_of(16384, 16384, 32, 8, 128, DType::kFP8E4M3), kL2));  // 32 MiB
  EXPECT_TRUE(kv_major_grid(cuda_shape_of(16384, 16384, 32, 8, 128, DType::kFP8E4M3), kL2 / 2));
  // The boundary: exactly the L2 stays heads-fastest (12800 keys × 4 KiB = 50 MiB).
  EXPECT_FALSE(kv_major_grid(cuda_shape_of(12800, 12800, 32, 8, 128), kL2));
  EXPECT_TRUE(kv_major_grid(cuda_shape_of(12801, 12801, 32, 8, 128), kL2));
  // Varlen: summed over the sequences (4 × 4096 keys = 64 MiB).
  ProblemShape four = cuda_shape_of(4096, 4096, 32, 8, 128);
  four.batch = 4;
  four.seq_q = four.seq_k = {4096, 4096, 4096, 4096};
  four.q_start = four.k_start = {0, 4096, 8192, 12288};
  EXPECT_TRUE(kv_major_grid(four, kL2));
}

TEST(CudaPlan, PagedKvStagedWhenTheCopyIsCheaperThanReadingPages) {
  constexpr std::size_t kFree = std::size_t{100} << 30;
  const auto paged = [](std::vector<std::int64_t> s_q, std::vector<std::int64_t> s_k) {
    ProblemShape s = cuda_shape_of(1, 1, 32, 8, 128);
    s.batch = static_cast<int>(s_q.size());
    s.seq_q = s_q;
    s.seq_k = s_k;
    s.q_start.assign(s_q.size(), 0);
    s.k_start.assign(s_q.size(), 0);
    s.kv_layout = KvLayout::kPaged;
    s.page_size = 16;
    return s;
  };
  // 32K one shot, Llama-3.1-8B: 256 MiB of K/V read and written against 8.8 TFLOP.
  const ProblemShape one_shot = paged({32768}, {32768});
  const KvStaging st = plan_kv_staging(one_shot, DenseParams{}, kFree);
  EXPECT_TRUE(st.stage);
  EXPECT_EQ(st.rows, 32768);
  EXPECT_EQ(st.bytes, std::size_t{2} * 32768 * 8 * 128 * 2);
  // Not with less than four times the staged bytes free.
  EXPECT_FALSE(plan_kv_staging(one_shot, DenseParams{}, 4 * st.bytes - 1).stage);
  EXPECT_TRUE(plan_kv_staging(one_shot, DenseParams{}, 4 * st.bytes).stage);
  // Contiguous K/V: nothing to stage.
  ProblemShape contiguous = one_shot;
  contiguous.kv_layout = KvLayout::kBatched;
  contiguous.page_size = 0;
  EXPECT_FALSE(plan_kv_staging(contiguous, DenseParams{}, kFree).stage);
  // 256 queries over a 128K cache: the copy of the cache would cost more than the reading.
  EXPECT_FALSE(plan_kv_staging(paged({256}, {131072}), DenseParams{}, kFree).stage);
  // 8K chunks over a 128K cache stage dense, not sparse (the attention is 20x cheaper there).
  const ProblemShape chunk = paged({8192}, {131072});
  EXPECT_TRUE(plan_kv_staging(chunk, DenseParams{}, kFree).stage);
  EXPECT_TRUE(plan_kv_staging(chunk, SoftmaxSkipParams{}, kFree).stage);
  EXPECT_FALSE(plan_kv_staging(chunk, EstimateSelectParams{}, kFree).stage);
  EXPECT_FALSE(plan_kv_staging(chunk, PermuteStopParams{}, kFree).stage);
  // A local window's pairs count: under a 4096-key window the chunk attends to 31x fewer, and the
  // copy of the cache would cost more than reading its pages.
  ProblemShape local = chunk;
  local.window_left = 4095;
  EXPECT_FALSE(plan_kv_staging(local, DenseParams{}, kFree).stage);
  local.window_left = 131071;  // a window that hides nothing stages as no window
  EXPECT_TRUE(plan_kv_staging(local, DenseParams{}, kFree).stage);
  // A block mask's own density counts: every visible block stages like dense, one block per
  // row does not.
  BlockSparseParams all;
  all.mask = BlockMask::all_visible(chunk, 128, 128, false);
  EXPECT_TRUE(plan_kv_staging(chunk, all, kFree).stage);
  BlockSparseParams one = all;
  for (std::size_t r = 0; r < one.mask.full_count.size(); ++r) {
    one.mask.full_count[r] = std::min(one.mask.full_count[r], 1);
    one.mask.partial_count[r] = 0;
  }
  EXPECT_FALSE(plan_kv_staging(chunk, one, kFree).stage);
  // Three sequences (one without keys): rows packed in order.
  const ProblemShape three = paged({16384, 16384, 16384}, {16384, 0, 20000});
  const KvStaging st3 = plan_kv_staging(three, DenseParams{}, kFree);
  EXPECT_TRUE(st3.stage);
  EXPECT_EQ(st3.k_start, (std::vector<std::int64_t>{0, 16384, 16384}));
  EXPECT_EQ(st3.rows, 36384);
  const ProblemShape to = staged_shape(three, st3);
  EXPECT_EQ(to.kv_layout, KvLayout::kVarlen);
  EXPECT_EQ(to.page_size, 0);
  EXPECT_EQ(to.k_start, st3.k_start);
  EXPECT_EQ(to.seq_k, three.seq_k);
  // Every sequence empty: nothing to copy.
  EXPECT_FALSE(plan_kv_staging(paged({128}, {0}), DenseParams{}, kFree).stage);
}

TEST(CudaPlan, TmaDescribesPositiveStridesBelow2To40Bytes) {
  const test::Inputs in = test::random_inputs({{40, 40}, {17, 33}}, 4, 2, 64, DType::kBF16, 11, 1.0);
  test::LayoutOptions varlen;
  varlen.layout = test::Layout::kVarlen;
  for (const test::TestProblem& tp : {test::build_problem(in), test::build_problem(in, varlen)}) {
    const AttentionProblem base = tp.problem();
    EXPECT_TRUE(tma_describable(base));
    const int row = base.k.rank - 3, head = base.k.rank - 2;
    AttentionProblem neg = base;
    neg.k.stride[row] = -neg.k.stride[row];
    EXPECT_FALSE(tma_describable(neg));
    AttentionProblem huge = base;
    huge.v.stride[head] = std::int64_t{1} << 39;  // 2^40 bytes of bf16
    EXPECT_FALSE(tma_describable(huge));
    AttentionProblem odd = base;
    odd.q.stride[head] = 68;  // 136 bytes: not a multiple of 16
    EXPECT_FALSE(tma_describable(odd));
  }
  // A dimension of extent 1 is never stepped over: its stride does not matter.
  const test::Inputs one = test::random_inputs({{40, 40}}, 4, 1, 64, DType::kBF16, 12, 1.0);
  const test::TestProblem tp = test::build_problem(one);
  AttentionProblem single = tp.problem();
  single.k.stride[single.k.rank - 2] = 3;
  EXPECT_TRUE(tma_describable(single));
}

TEST(CudaPlan, CompactMaskPacksRowsInOrder) {
  const ProblemShape s = cuda_shape_of(300, 300, 2, 1, 64);
  BlockMask m = BlockMask::empty(s, 128, 64, false);
  ASSERT_TRUE(m.add(s, 0, 0, 1, 0).ok());
  ASSERT_TRUE(m.add(s, 0, 0, 1, 3).ok());  // partial for q block 1 (rows 128..255)
  ASSERT_TRUE(m.add(s, 0, 1, 2, 4).ok());
  const CompactMask c = compact_mask(m);
  ASSERT_EQ(c.full_count.size(), m.full_count.size());
  const std::size_t r1 = static_cast<std::size_t>(m.row(0, 0, 1)), r2 = static_cast<std::size_t>(m.row(0, 1, 2));
  EXPECT_EQ(c.full_count[r1], 1);
  EXPECT_EQ(c.full_index[static_cast<std::size_t>(c.full_start[r1])], 0);
  EXPECT_EQ(c.partial_count[r1], 1);
  EXPECT_EQ(c.partial_index[static_cast<std::size_t>(c.partial_start[r1])], 3);
  EXPECT_EQ(c.full_count[r2] + c.partial_count[r2], 1);
  EXPECT_EQ(c.full_index.size() + c.partial_index.size(), 3u);
}

TEST(CudaPlan, BitsAndArraysBecomeMasks) {
  const ProblemShape s = cuda_shape_of(300, 300, 2, 1, 64);
  BlockMask want = BlockMask::empty(s, 128, 128, false);
  ASSERT_TRUE(want.add(s, 0, 1, 2, 0).ok());
  ASSERT_TRUE(want.add(s, 0, 1, 2, 2).ok());
  const int words = bitmap_words(want.num_k_blocks);
  std::vector<std::uint32_t> bits(want.full_count.size() * static_cast<std::size_t>(words), 0u);
  bits[static_cast<std::size_t>(want.row(0, 1, 2)) * static_cast<std::size_t>(words)] = 0b101u;
  BlockMask got;
  ASSERT_TRUE(mask_from_bits(s, 128, 128, false, bits, &got).ok());
  EXPECT_EQ(got.to_dense(), want.to_dense());

  // A bit for an invisible block is an internal error, not a silent mask.
  bits[0] = 0b100u;  // row (0, 0, 0) sees only block 0
  EXPECT_EQ(mask_from_bits(s, 128, 128, false, bits, &got).code(), StatusCode::kInternal);

  const std::size_t rows = want.full_count.size(), cap = static_cast<std::size_t>(want.num_k_blocks);
  std::vector<std::int32_t> fc(rows, 0), pc(rows, 0), fi(rows * cap, 7), pi(rows * cap, 7);
  const std::size_t r = static_cast<std::size_t>(want.row(0, 1, 2));
  fc[r] = 1;
  fi[r * cap] = 0;
  pc[r] = 1;
  pi[r * cap] = 2;
  ASSERT_TRUE(mask_from_arrays(s, 128, false, std::move(fc), std::move(fi), std::move(pc), std::move(pi), &got).ok());
  EXPECT_EQ(got.to_dense(), want.to_dense());
}

// The read-back conversions against BlockMask::add, array for array (the full/partial split, the
// order, the -1 past each count), on sequences of their own lengths under a local window:
// rows past a short sequence's end, both bands of the window and a short last key block.
TEST(CudaPlan, ReadBackMasksEqualTheMasksAddBuilds) {
  ProblemShape s = cuda_shape_of(700, 700, 4, 2, 64);
  s.batch = 3;
  s.seq_q = {700, 200, 450};
  s.seq_k = {700, 900, 450};
  s.q_start = {0, 700, 900};
  s.k_start = {0, 700, 1600};
  s.window_left = 300;
  for (const bool per_kv_head : {false, true}) {
    BlockMask want = BlockMask::empty(s, 128, 128, per_kv_head);
    const int words = bitmap_words(want.num_k_blocks);
    std::vector<std::uint32_t> bits(want.full_count.size() * static_cast<std::size_t>(words), 0u);
    std::uint32_t x = 12345u;
    int added = 0;
    for (int b = 0; b < want.batch; ++b) {
      for (int h = 0; h < want.heads; ++h) {
        for (int qb = 0; qb < want.num_q_blocks; ++qb) {
          for (int kb = want.num_k_blocks - 1; kb >= 0; --kb) {  // descending: add sorts
            x = x * 1664525u + 1013904223u;
            if ((x >> 16) % 3 == 0 || !want.add(s, b, h, qb, kb).ok()) continue;  // invisible: not added
            ++added;
            bits[static_cast<std::size_t>(want.row(b, h, qb)) * static_cast<std::size_t>(words) +
                 static_cast<std::size_t>(kb / 32)] |= 1u << (kb % 32);
          }
        }
      }
    }
    ASSERT_GT(added, 20);
    BlockMask got;
    ASSERT_TRUE(mask_from_bits(s, 128, 128, per_kv_head, bits, &got).ok());
    EXPECT_EQ(got.full_count, want.full_count);
    EXPECT_EQ(got.full_index, want.full_index);
    EXPECT_EQ(got.partial_count, want.partial_count);
    EXPECT_EQ(got.partial_index, want.partial_index);

    // The selector's arrays: its entries past each count are whatever the device left there.
    std::vector<std::int32_t> fi = want.full_index, pi = want.partial_index;
    for (std::size_t r = 0; r < want.full_count.size(); ++r) {
      const std::size_t cap = static_cast<std::size_t>(want.num_k_blocks);
      for (std::size_t i = static_cast<std::size_t>(want.full_count[r]); i < cap; ++i) fi[r * cap + i] = 77;
      for (std::size_t i = static_cast<std::size_t>(want.partial_count[r]); i < cap; ++i) pi[r * cap + i] = 1 << 30;
    }
    BlockMask arrays;
    ASSERT_TRUE(mask_from_arrays(s, 128, per_kv_head, std::vector<std::int32_t>(want.full_count), std::move(fi),
                                 std::vector<std::int32_t>(want.partial_count), std::move(pi), &arrays)
                    .ok());
    EXPECT_EQ(arrays.full_index, want.full_index);
    EXPECT_EQ(arrays.partial_index, want.partial_index);
    EXPECT_EQ(arrays.full_count, want.full_count);
    EXPECT_EQ(arrays.partial_count, want.partial_count);

    // A count past the capacity, or a block listed on the wrong side, is the selector's fault.
    std::vector<std::int32_t> bad_count = want.full_count;
    bad_count[1] = want.num_k_blocks + 1;
    EXPECT_EQ(mask_from_arrays(s, 128, per_kv_head, std::move(bad_count), std::vector<std::int32_t>(want.full_index),
                               std::vector<std::int32_t>(want.partial_count),
                               std::vector<std::int32_t>(want.partial_index), &arrays)
                  .code(),
              StatusCode::kInternal);
    const auto swapped =
        std::find_if(want.full_count.begin(), want.full_count.end(), [](std::int32_t c) { return c > 0; });
    ASSERT_NE(swapped, want.full_count.end());
    const std::size_t r = static_cast<std::size_t>(swapped - want.full_count.begin());
    std::vector<std::int32_t> fc = want.full_count, pc = want.partial_count;
    std::vector<std::int32_t> fi2 = want.full_index, pi2 = want.partial_index;
    const std::size_t cap = static_cast<std::size_t>(want.num_k_blocks);
    --fc[r];  // the row's last full block moved to the partial list, which it does not belong to
    pi2[r * cap + static_cast<std::size_t>(pc[r])] = fi2[r * cap + static_cast<std::size_t>(fc[r])];
    ++pc[r];
    std::sort(pi2.begin() + static_cast<std::ptrdiff_t>(r * cap),
              pi2.begin() + static_cast<std::ptrdiff_t>(r * cap + static_cast<std::size_t>(pc[r])));
    EXPECT_EQ(mask_from_arrays(s, 128, per_kv_head, std::move(fc), std::move(fi2), std::move(pc), std::move(pi2),
                               &arrays)
                  .code(),
              StatusCode::kInternal);
  }
}

TEST(CudaPlan, PermuteLayoutSlotsSegmentsAndPrefixes) {
  // Three sequences, segment 128: 300 x 300 (segments 0-2), 100 x 500 (rows at positions
  // 400..499: segment 3 alone, prefix 384), 200 x 50 (rows 0..149 at negative positions).
  ProblemShape s = cuda_shape_of(300, 300, 1, 1, 64);
  s.batch = 3;
  s.seq_q = {300, 100, 200};
  s.seq_k = {300, 500, 50};
  s.q_start = {0, 300, 400};
  s.k_start = {0, 300, 800};
  PermuteStopParams p;
  p.segment = 128;
  p.block_k = 64;
  PermuteLayout l;
  ASSERT_TRUE(permute_layout(s, p, &l).ok());
  EXPECT_EQ(l.max_segments, 3);
  EXPECT_EQ(l.max_s_q, 300);
  EXPECT_EQ(l.max_prefix, 384);
  EXPECT_EQ(l.tiles_per_segment, 1);
  EXPECT_EQ(l.rank_offsets, (std::vector<std::int32_t>{0, 0, 128, 384, 768, 768, 768, 768, 768, 768}));
  // Per (b, h): negative-position rows, each segment's rows (padded), slots past s_q.
  EXPECT_EQ(l.query_offsets, (std::vector<std::int32_t>{0, 0, 128, 256, 300, 300, 300, 400, 400, 400, 600, 750, 800,
                                                        800, 800, 900}));
  // Tiles in (batch, head, segment, tile) order with their counts and totals.
  const std::vector<std::int32_t> visited = {0, 1, 2, 3, 0, 0, 6, 0, 0};
  const std::vector<PermuteTile> tiles = permute_tiles(s, p, l, visited);
  ASSERT_EQ(tiles.size(), 5u);
  const int want[5][4] = {{0, 0, 0, 0}, {0, 1, 1, 2}, {0, 2, 2, 4}, {1, 3, 3, 6}, {2, 0, 6, 0}};
  for (std::size_t i = 0; i < tiles.size(); ++i) {
    EXPECT_EQ(tiles[i].batch, want[i][0]) << i;
    EXPECT_EQ(tiles[i].segment, want[i][1]) << i;
    EXPECT_EQ(tiles[i].chunks_visited, want[i][2]) << i;
    EXPECT_EQ(tiles[i].chunks_total, want[i][3]) << i;
    EXPECT_EQ(tiles[i].tile, 0) << i;
  }
}

TEST(CudaPlan, PermuteTilesMatchTheCpuBackendsTiles) {
  // The kernel's (item, tile) counts mapped back give the CPU backend's tile list exactly.
  const test::Inputs in = test::random_inputs({{700, 900}, {15, 40}, {300, 17}}, 2, 1, 64, DType::kBF16, 21, 1.0);
  test::LayoutOptions varlen;
  varlen.layout = test::Layout::kVarlen;
  test::TestProblem tp = test::build_problem(in, varlen);
  ProblemShape s;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  PermuteStopParams p;
  p.segment = 200;
  p.block_k = 64;
  p.tau = 0.05;
  RunOptions opt;
  opt.backend = Backend::kCPU;
  Decisions cpu;
  ASSERT_TRUE(run(tp.problem(), p, tp.output(), opt, nullptr, &cpu).ok());
  PermuteLayout l;
  ASSERT_TRUE(permute_layout(s, p, &l).ok());
  std::vector<std::int32_t> visited(static_cast<std::size_t>(l.rank_offsets.size() - 1) *
                                    static_cast<std::size_t>(l.tiles_per_segment), -1);
  for (const PermuteTile& t : cpu.tiles) {
    const geom::SegmentGeometry sg{{s.seq_q[static_cast<std::size_t>(t.batch)], s.seq_k[static_cast<std::size_t>(t.batch)], true},
                                   p.segment};
    const std::int64_t item = (std::int64_t{t.batch} * s.h_q + t.head) * l.max_segments + (t.segment - sg.first());
    visited[static_cast<std::size_t>(item * l.tiles_per_segment + t.tile)] = t.chunks_visited;
  }
  const std::vector<PermuteTile> tiles = permute_tiles(s, p, l, visited);
  ASSERT_EQ(tiles.size(), cpu.tiles.size());
  for (std::size_t i = 0; i < tiles.size(); ++i) {
    EXPECT_EQ(tiles[i].batch, cpu.tiles[i].batch) << i;
    EXPECT_EQ(tiles[i].head, cpu.tiles[i].head) << i;
    EXPECT_EQ(tiles[i].segment, cpu.tiles[i].segment) << i;
    EXPECT_EQ(tiles[i].tile, cpu.tiles[i].tile) << i;
    EXPECT_EQ(tiles[i].chunks_visited, cpu.tiles[i].chunks_visited) << i;
    EXPECT_EQ(tiles[i].chunks_total, cpu.tiles[i].chunks_total) << i;
  }
  // The slot arrays have the layout of Decisions::query_order.
  EXPECT_EQ(l.query_offsets.back(), static_cast<std::int32_t>(cpu.query_order.size()));
}

TEST(CudaPlan, RankKeysSortInTheOraclesRankingOrder) {
  // Descending by score, NaN after every number, ties (+0 and -0 included) by lower index: the
  // oracle's order of its fp32-rounded scores, against a stable descending sort by rank_key
  // (CUB's sort in the kernels).
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> score = {0.5f, -0.0f, nan, -kInf, 0.0f, 3.0f, kInf, -2.5f, nan, 0.5f, -1e-38f, 1e-38f,
                              -kInf, 3.0f, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                              std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()};
  test::Random rng(5);
  for (int i = 0; i < 100; ++i) {
    // fp64 values rounded as the oracle's ranking_score does: x and x·(1 + 1e-9) differ in fp64
    // and (almost always) tie in fp32, so the ties by index are exercised.
    const double x = std::ldexp(rng.uniform(), static_cast<int>(rng.below(40)) - 20);
    score.push_back(static_cast<float>(x));
    score.push_back(static_cast<float>(x * (1.0 + 1e-9)));
  }
  std::vector<std::size_t> want(score.size()), got(score.size());
  for (std::size_t i = 0; i < score.size(); ++i) want[i] = got[i] = i;
  std::stable_sort(want.begin(), want.end(), [&](std::size_t a, std::size_t b) {
    const bool a_nan = std::isnan(score[a]), b_nan = std::isnan(score[b]);
    if (a_nan != b_nan) return b_nan;
    return !a_nan && score[a] > score[b];
  });
  std::stable_sort(got.begin(), got.end(), [&](std::size_t a, std::size_t b) { return rank_key(score[a]) > rank_key(score[b]); });
  EXPECT_EQ(got, want);
  EXPECT_EQ(rank_key(-0.0f), rank_key(0.0f));
  EXPECT_LT(rank_key(nan), rank_key(-kInf));
  EXPECT_LT(rank_key(-std::numeric_limits<float>::denorm_min()), rank_key(0.0f));
}

TEST(CudaPlan, CalibrationStatisticsSupport) {
  const ProblemShape s = cuda_shape_of(300, 300, 4, 1, 128);
  EXPECT_TRUE(check_calib_support(s, 128, 64).ok());
  EXPECT_TRUE(check_calib_support(s, 64, 128).ok());
  const Status blocks = check_calib_support(s, 32, 128);
  EXPECT_EQ(blocks.code(), StatusCode::kUnsupported);
  EXPECT_EQ(blocks.message(), "calibration statistics: the CUDA kernel needs block_q and block_k of 64 or 128, got 32 x 128");
  const Status dim = check_calib_support(cuda_shape_of(300, 300, 4, 1, 80), 128, 128);
  EXPECT_NE(dim.message().find("no compiled CUDA kernel for bf16 head_dim 80"), std::string::npos) << dim.message();
  const Status fp32 = check_calib_support(cuda_shape_of(300, 300, 4, 1, 64, DType::kFP32), 128, 128);
  EXPECT_NE(fp32.message().find("dtype fp32"), std::string::npos) << fp32.message();
  EstimateSelectParams base;
  base.block = 128;
  EXPECT_TRUE(check_select_statistics_support(s, base).ok());
  base.block = 64;
  const Status select = check_select_statistics_support(s, base);
  EXPECT_EQ(select.message(), "estimate_select statistics: the CUDA selector needs block = 128, got 64");
}

// Two sequences (300 x 300 and 100 x 200) in a [batch, heads, 3, 3] capacity layout of block
// 128: each record gets its own corner, and g gets + ln s_k.
TEST(CudaPlan, StatisticsArraysSplitPerSequence) {
  ProblemShape s = cuda_shape_of(300, 300, 2, 1, 64);
  s.batch = 2;
  s.seq_q = {300, 100};
  s.seq_k = {300, 200};
  s.q_start = {0, 300};
  s.k_start = {0, 300};
  const CalibParams p = make_calib_params(AttentionProblem{}, s, 128, 128);
  ASSERT_EQ(p.num_q_blocks, 3);
  ASSERT_EQ(p.num_k_blocks, 3);
  std::vector<float> block_max(2 * 2 * 3 * 3), skip_g(block_max.size());
  for (std::size_t i = 0; i < block_max.size(); ++i) {
    block_max[i] = static_cast<float>(i);
    skip_g[i] = -static_cast<float>(i);
  }
  const std::vector<BlockStatistics> st = block_statistics_from_device(s, 128, 128, 3, 3, block_max, skip_g);
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].s_q, 300);
  EXPECT_EQ(st[0].block_max.size(), 2u * 3 * 3);
  EXPECT_EQ(st[0].block_max[1 * 9 + 2 * 3 + 1], 1 * 9 + 2 * 3 + 1);  // head 1, qb 2, kb 1
  EXPECT_DOUBLE_EQ(st[0].skip_g[5], -5.0 + std::log(300.0));
  // Sequence 1: 1 query block x 2 key blocks; (head h, kb) from [1][h][0][kb].
  EXPECT_EQ(st[1].s_k, 200);
  ASSERT_EQ(st[1].block_max.size(), 2u * 1 * 2);
  EXPECT_EQ(st[1].block_max[1 * 2 + 1], 18 + 9 + 1);
  EXPECT_DOUBLE_EQ(st[1].skip_g[1], -19.0 + std::log(200.0));
  EstimateSelectParams base;
  base.block = 128;
  base.pack_gqa = true;
  const std::vector<SelectStatistics> sel = select_statistics_from_device(s, base, 3, 3, std::vector<float>(2 * 1 * 9, 0.5f));
  ASSERT_EQ(sel.size(), 2u);
  EXPECT_EQ(sel[1].units, 1);
  EXPECT_TRUE(sel[1].pack_gqa);
  EXPECT_EQ(sel[1].ratio, std::vector<double>(2, 0.5));
}

TEST(CudaPlan, ChunkedSelectTableOnlyWhenChunked) {
  // A one-shot call uploads nothing (select_seqs stays null, the kernels use the call's tail
  // and compute every mean); prompt_len or a cache gives one entry per sequence.
  ProblemShape shape = cuda_shape_of(256, 1000, 2, 1, 64);
  EstimateSelectParams p;
  detail::EstimateChunks chunks;
  ASSERT_TRUE(detail::read_estimate_chunks(p, shape, &chunks).ok());
  EXPECT_TRUE(make_select_seqs(p, chunks).empty());
  EXPECT_EQ(mean_cache(p.k_block_means).data, nullptr);

  HostTensor len(DType::kInt32, {1}), valid(DType::kInt32, {1});
  HostTensor k(DType::kBF16, {1, 1, 9, 64}), v(DType::kBF16, {1, 1, 9, 64});
  len.as<std::int32_t>()[0] = 4096;
  valid.as<std::int32_t>()[0] = 5;
  p.prompt_len = len.view();
  ASSERT_TRUE(detail::read_estimate_chunks(p, shape, &chunks).ok());
  std::vector<SelectSeq> t = make_select_seqs(p, chunks);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].prompt_len, 4096);
  EXPECT_EQ(t[0].cached, 0);

  p.k_block_means = k.view();
  p.v_block_means = v.view();
  p.k_block_means.device = p.v_block_means.device = shape.device;  // views only: never dereferenced here
  p.block_means_valid = valid.view();
  ASSERT_TRUE(detail::read_estimate_chunks(p, shape, &chunks).ok());
  EXPECT_EQ(chunks.complete[0], 1000 / 128);
  t = make_select_seqs(p, chunks);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].cached, 5);
  const MeanCache c = mean_cache(p.v_block_means);
  EXPECT_EQ(c.data, p.v_block_means.data);
  EXPECT_EQ(c.batch_stride, 9 * 64);
  EXPECT_EQ(c.head_stride, 9 * 64);
  EXPECT_EQ(c.block_stride, 64);
  // The cache without prompt_len: the call's own tail (0), the cached count.
  p.prompt_len = TensorView{};
  ASSERT_TRUE(detail::read_estimate_chunks(p, shape, &chunks).ok());
  t = make_select_seqs(p, chunks);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].prompt_len, 0);
  EXPECT_EQ(t[0].cached, 5);
  // Valid beyond the 7 complete blocks of 1000 keys.
  valid.as<std::int32_t>()[0] = 8;
  EXPECT_EQ(detail::read_estimate_chunks(p, shape, &chunks).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace sparseprefill::cuda
