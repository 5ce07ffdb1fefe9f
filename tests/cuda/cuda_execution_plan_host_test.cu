// SPDX-License-Identifier: Apache-2.0
// The CUDA execution plan as a value (cuda/execution_plan.h), no GPU needed: for each call shape
// and policy, on an H200's and an A100's capabilities, the path, instances, passes, packing,
// staging and grid the plan holds, the overrides (parsed, merged, forced), and its errors.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "common/inputs.h"
#include "cuda/execution_plan.h"

namespace sparseprefill::cuda {
namespace {

using test::cuda_shape_of;
using test::with_pages;

constexpr DeviceCaps kH200{9, 0, std::int64_t{60} << 20, 132};
constexpr DeviceCaps kA100{8, 0, std::int64_t{40} << 20, 108};
constexpr DeviceCaps kAda{8, 9, std::int64_t{72} << 20, 128, 101376};  // its shared memory per CTA known
constexpr TmaFacts kTma{true, true};

ExecutionPlan plan_of(const ProblemShape& s, const Policy& policy, const DeviceCaps& caps = kH200,
                      const ExecutionOverrides& ov = {}, std::size_t free_bytes = std::size_t{100} << 30,
                      TmaFacts tma = kTma) {
  ExecutionPlan plan;
  const Status st = plan_execution(s, policy, tma, caps, ov, free_bytes, &plan);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return plan;
}

ExactGateParams gate(int block_k = 128) {
  ExactGateParams g;
  g.block_k = block_k;
  return g;
}

TEST(CudaExecutionPlan, DenseRunsTheHopperKernelOnAnH200AndThePortableOneElsewhere) {
  const ProblemShape s = cuda_shape_of(4096, 4096);
  const ExecutionPlan h = plan_of(s, DenseParams{});
  EXPECT_EQ(h.path, FwdPath::kHopper);
  ASSERT_NE(h.fwd90, nullptr);
  EXPECT_STREQ(h.fwd90->name, "fwd_sm90_bf16_hd128");
  ASSERT_NE(h.fwd, nullptr);  // the fallback where the driver cannot encode the tensor maps
  EXPECT_EQ(h.mode, PolicyMode::kDense);
  EXPECT_EQ(h.q_pack, 1);
  EXPECT_EQ(h.grid, 32 * 32);  // 32 tiles of 128 rows x 32 heads
  const ExecutionInfo info = execution_info(h, 0);
  EXPECT_EQ(info.path, "cuda-hopper");
  EXPECT_EQ(info.instance, "fwd_sm90_bf16_hd128");

  const ExecutionPlan a = plan_of(s, DenseParams{}, kA100);
  EXPECT_EQ(a.path, FwdPath::kPortable);
  EXPECT_EQ(a.fwd90, nullptr);
  ASSERT_NE(a.fwd, nullptr);
  EXPECT_FALSE(a.fwd->gated);
  EXPECT_TRUE(a.fwd->plain);
  EXPECT_EQ(execution_info(a, 0).path, "cuda-portable");
  EXPECT_EQ(a.grid, 32 * 32);

  // Strides TMA cannot describe keep the portable kernel on the H200 too.
  EXPECT_EQ(plan_of(s, DenseParams{}, kH200, {}, 0, TmaFacts{true, false}).path, FwdPath::kPortable);
}

// A portable instance whose CTA needs more shared memory than the device offers is refused when
// the call is planned, naming both counts: head_dim 256 (160 KB + 640 B) on a GPU with 99 KB per
// CTA (sm_89), while d 128 runs there and d 256 runs on an A100's 163 KB; its gated instance
// (192 KB + 640 B: softmax_skip) on an H100's 227 KB only. Devices whose limit is not known (0)
// are not checked.
TEST(CudaExecutionPlan, PortableInstancesNeedTheirSharedMemory) {
  constexpr DeviceCaps kA100Limit{8, 0, std::int64_t{40} << 20, 108, 166912};
  const ProblemShape wide = cuda_shape_of(300, 300, 4, 1, 256);
  ExecutionPlan plan;
  const Status st = plan_execution(wide, DenseParams{}, kTma, kAda, {}, std::size_t{100} << 30, &plan);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("fwd_sm80_bf16_hd256 needs 164480 bytes of shared memory per CTA; this device (compute "
                              "capability 8.9) offers 101376"),
            std::string::npos)
      << st.message();
  EXPECT_EQ(plan_of(cuda_shape_of(300, 300, 4, 1, 128), DenseParams{}, kAda).path, FwdPath::kPortable);
  EXPECT_EQ(plan_of(wide, DenseParams{}, kA100Limit).path, FwdPath::kPortable);
  EXPECT_EQ(plan_of(wide, DenseParams{}, kA100).path, FwdPath::kPortable);  // limit not known
  EXPECT_EQ(plan_of(wide, DenseParams{}, kH200).path, FwdPath::kHopper);  // its Hopper instance at 256
  const Status gated = plan_execution(wide, SoftmaxSkipParams{}, kTma, kA100Limit, {}, std::size_t{100} << 30, &plan);
  EXPECT_EQ(gated.code(), StatusCode::kUnsupported);
  EXPECT_NE(gated.message().find("fwd_sm80_gated_bf16_hd256 needs 197248 bytes of shared memory per CTA; this device "
                                 "(compute capability 8.0) offers 166912: head_dim 256 runs where a CTA may hold that "
                                 "much (A100: 166912 bytes, H100 and H200: 232448)"),
            std::string::npos)
      << gated.message();
  constexpr DeviceCaps kH200Limit{9, 0, std::int64_t{60} << 20, 132, 232448};
  EXPECT_STREQ(plan_of(wide, SoftmaxSkipParams{}, kH200Limit).fwd->name, "fwd_sm80_gated_bf16_hd256");
}

// The portable selector's CTA holds a Q tile and two chunks of k̄ (32 + 2 x 16 KB at d 128) and
// λ for each query half and key block (8 bytes a block): at 600K keys (4688 blocks) that is
// 103040 bytes, more than sm_89's 101376, so the call is refused when planned, naming the
// instance and both counts; the H200 runs it (its wgmma selector, 227 KB), and so does sm_89 at
// 32K keys. The selector at d 96 lays its rows at d 128's pitch: the same bytes.
TEST(CudaExecutionPlan, TheSelectorNeedsItsSharedMemory) {
  EstimateSelectParams es;
  for (const int d : {128, 96}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const ProblemShape s = cuda_shape_of(300, 600000, 4, 1, d);
    ExecutionPlan plan;
    const Status st = plan_execution(s, es, kTma, kAda, {}, std::size_t{100} << 30, &plan);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find("estimate_select: select_sm80_bf16_hd" + std::to_string(d) +
                                " needs 103040 bytes of shared memory per CTA at 4688 key blocks; this device "
                                "(compute capability 8.9) offers 101376"),
              std::string::npos)
        << st.message();
    EXPECT_STREQ(plan_of(cuda_shape_of(300, 32768, 4, 1, d), es, kAda).select->name,
                 ("select_sm80_bf16_hd" + std::to_string(d)).c_str());
  }
  EXPECT_STREQ(plan_of(cuda_shape_of(300, 600000, 4, 1, 128), es, kH200).select->name, "select_sm90_bf16_hd128");
  EXPECT_STREQ(plan_of(cuda_shape_of(300, 600000, 4, 1, 96), es, kH200).select->name, "select_sm80_bf16_hd96");
}

TEST(CudaExecutionPlan, ShortChunksPackTheGqaGroupAndTheOverrideDecides) {
  const ProblemShape s = cuda_shape_of(32, 4096);
  const ExecutionPlan packed = plan_of(s, DenseParams{});
  EXPECT_EQ(packed.q_pack, 4);
  EXPECT_EQ(packed.grid, 1 * 8);  // 32 rows x 4 heads = one tile per KV head
  ExecutionOverrides never;
  never.pack_gqa = ExecutionOverrides::Choice::kNever;
  const ExecutionPlan unpacked = plan_of(s, DenseParams{}, kH200, never);
  EXPECT_EQ(unpacked.q_pack, 1);
  EXPECT_EQ(unpacked.grid, 32);
  ExecutionOverrides always;
  always.pack_gqa = ExecutionOverrides::Choice::kAlways;
  EXPECT_EQ(plan_of(cuda_shape_of(8192, 8192), DenseParams{}, kH200, always).q_pack, 4);
  // The gates decide per query head: never packed.
  EXPECT_EQ(plan_of(s, gate(), kH200, always).q_pack, 1);
}

TEST(CudaExecutionPlan, ExactGateTakesTwoPassesWhereTheDecisionKernelRuns) {
  const ProblemShape s = cuda_shape_of(8192, 8192);
  const ExecutionPlan two = plan_of(s, gate());
  EXPECT_EQ(two.passes, 2);
  ASSERT_NE(two.gate, nullptr);
  EXPECT_STREQ(two.gate->name, "gate_sm90_bf16_hd128");
  EXPECT_EQ(two.mode, PolicyMode::kBlockMask);
  EXPECT_FALSE(two.fwd->gated);  // the fallback runs the decided mask, not the gate
  const ExecutionInfo info = execution_info(two, 0);
  EXPECT_EQ(info.decision_instance, "gate_sm90_bf16_hd128");
  EXPECT_EQ(info.passes, 2);

  ExecutionOverrides one;
  one.gate_passes = 1;
  const ExecutionPlan in_loop = plan_of(s, gate(), kH200, one);
  EXPECT_EQ(in_loop.passes, 1);
  EXPECT_EQ(in_loop.gate, nullptr);
  EXPECT_EQ(in_loop.mode, PolicyMode::kExactGate);
  EXPECT_TRUE(in_loop.fwd->gated);

  // The portable path has its own decision kernel; block_k 64 runs there.
  const ExecutionPlan a = plan_of(s, gate(), kA100);
  EXPECT_EQ(a.passes, 2);
  EXPECT_STREQ(a.gate->name, "gate_sm80_bf16_hd128");
  const ExecutionPlan k64 = plan_of(s, gate(64));
  EXPECT_EQ(k64.path, FwdPath::kPortable);
  EXPECT_EQ(k64.block_k, 64);

  // Paged K/V read in the kernels: one pass (the decision kernels read contiguous rows).
  const ExecutionPlan pages = plan_of(with_pages(cuda_shape_of(64, 8192), 16), gate());
  EXPECT_FALSE(pages.staging.stage);
  EXPECT_EQ(pages.passes, 1);

  ExecutionOverrides bad;
  bad.gate_passes = 3;
  ExecutionPlan plan;
  const Status st = plan_execution(s, gate(), kTma, kH200, bad, 0, &plan);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("gate_passes"), std::string::npos) << st.message();
}

// At the family head dims exact_gate runs in two passes on contiguous K/V, its decisions from the
// portable gate kernel (no Hopper one there: one head a CTA) ahead of the Hopper forward instance
// (the portable plain one on an A100), and in one pass (the portable gated instance) over pages
// read in the kernel (no paged Hopper instance at these head dims).
TEST(CudaExecutionPlan, FamilyHeadDimsRunExactGateInOneOrTwoPasses) {
  for (const auto& [d, d_v, tag] :
       {std::tuple{256, 256, "hd256"}, std::tuple{192, 128, "hd192v128"}, std::tuple{96, 96, "hd96"}}) {
    SCOPED_TRACE(tag);
    ProblemShape s = cuda_shape_of(4096, 4096, 8, 2, d);
    s.d_v = d_v;
    const ExecutionPlan two = plan_of(s, gate());
    EXPECT_EQ(two.path, FwdPath::kHopper);
    EXPECT_EQ(two.passes, 2);
    ASSERT_NE(two.gate, nullptr);
    EXPECT_EQ(std::string(two.gate->name), "gate_sm80_bf16_hd" + std::to_string(d));
    EXPECT_EQ(two.gate_heads_per_cta, 1);
    EXPECT_EQ(std::string(two.fwd90->name), std::string("fwd_sm90_bf16_") + tag);
    const ExecutionPlan a100 = plan_of(s, gate(), kA100);
    EXPECT_EQ(a100.path, FwdPath::kPortable);
    EXPECT_EQ(a100.passes, 2);
    EXPECT_TRUE(a100.fwd->plain);
    ProblemShape chunk = with_pages(cuda_shape_of(64, 8192, 8, 2, d), 16);
    chunk.d_v = d_v;
    const ExecutionPlan one = plan_of(chunk, gate());
    EXPECT_FALSE(one.staging.stage);
    EXPECT_EQ(one.path, FwdPath::kPortable);
    EXPECT_EQ(one.passes, 1);
    EXPECT_EQ(std::string(one.fwd->name), std::string("fwd_sm80_gated_bf16_") + tag);
  }
  // At 128 the Hopper decision kernel scores a KV group's heads together.
  const ExecutionPlan h128 = plan_of(cuda_shape_of(4096, 4096, 8, 2), gate());
  ASSERT_NE(h128.gate, nullptr);
  EXPECT_STREQ(h128.gate->name, "gate_sm90_bf16_hd128");
  EXPECT_EQ(h128.gate_heads_per_cta, gate_heads_per_cta(4));
}

// FP8 exact_gate and softmax_skip run in the fp8 instance's loop at both of its head dims: one
// pass (no decision kernel reads e4m3), no GQA packing (gated visits differ per head).
TEST(CudaExecutionPlan, Fp8GatesRunInOnePassOnTheFp8Instances) {
  for (const int d : {128, 256}) {
    SCOPED_TRACE("d " + std::to_string(d));
    const ProblemShape s = cuda_shape_of(4096, 4096, 8, 2, d, DType::kFP8E4M3);
    const ExecutionPlan eg = plan_of(s, gate());
    EXPECT_EQ(eg.path, FwdPath::kHopper);
    EXPECT_EQ(eg.passes, 1);
    EXPECT_EQ(eg.gate, nullptr);
    EXPECT_EQ(eg.mode, PolicyMode::kExactGate);
    EXPECT_EQ(eg.q_pack, 1);
    EXPECT_EQ(std::string(eg.fwd90->name), "fwd_sm90_fp8_hd" + std::to_string(d));
    SoftmaxSkipParams skip;
    skip.block_k = 128;
    const ExecutionPlan sk = plan_of(s, skip);
    EXPECT_EQ(sk.mode, PolicyMode::kSoftmaxSkip);
    EXPECT_EQ(sk.q_pack, 1);
    EXPECT_EQ(std::string(sk.fwd90->name), "fwd_sm90_fp8_hd" + std::to_string(d));
  }
}

TEST(CudaExecutionPlan, EstimateSelectNamesItsSelector) {
  const ProblemShape s = cuda_shape_of(8192, 8192);
  const ExecutionPlan h = plan_of(s, EstimateSelectParams{});
  ASSERT_NE(h.select, nullptr);
  EXPECT_STREQ(h.select->name, "select_sm90_bf16_hd128");
  EXPECT_EQ(h.mode, PolicyMode::kBlockMask);
  EXPECT_EQ(execution_info(h, 0).decision_instance, "select_sm90_bf16_hd128");
  ExecutionOverrides portable;
  portable.cuda_path = ExecutionOverrides::CudaPath::kPortable;
  const ExecutionPlan p = plan_of(s, EstimateSelectParams{}, kH200, portable);
  EXPECT_EQ(p.path, FwdPath::kPortable);
  EXPECT_STREQ(p.select->name, "select_sm80_bf16_hd128");
  EstimateSelectParams mc;
  mc.mean_correction = true;
  EXPECT_FALSE(plan_of(s, mc, kA100).fwd->plain);  // mean-correction tiles: the general instance
}

TEST(CudaExecutionPlan, LongPagedPrefillsStageAndShortChunksReadPages) {
  const ProblemShape long_prefill = with_pages(cuda_shape_of(32768, 32768), 16);
  const ExecutionPlan staged = plan_of(long_prefill, DenseParams{});
  EXPECT_TRUE(staged.staging.stage);
  EXPECT_EQ(staged.staging.rows, 32768);
  ASSERT_NE(staged.fwd90, nullptr);
  EXPECT_FALSE(staged.fwd90->paged);  // the staged rows are contiguous
  EXPECT_TRUE(execution_info(staged, 0).kv_staged);
  // The same on a full device declines; and the override decides either way.
  EXPECT_FALSE(plan_of(long_prefill, DenseParams{}, kH200, {}, std::size_t{1} << 20).staging.stage);
  ExecutionOverrides never;
  never.kv_staging = ExecutionOverrides::Choice::kNever;
  const ExecutionPlan pages = plan_of(long_prefill, DenseParams{}, kH200, never);
  EXPECT_FALSE(pages.staging.stage);
  EXPECT_TRUE(pages.fwd90->paged);
  EXPECT_FALSE(pages.fwd->plain);  // the portable fallback's general instance reads pages

  const ProblemShape chunk = with_pages(cuda_shape_of(64, 32768), 16);
  EXPECT_FALSE(plan_of(chunk, DenseParams{}).staging.stage);
  ExecutionOverrides always;
  always.kv_staging = ExecutionOverrides::Choice::kAlways;
  EXPECT_TRUE(plan_of(chunk, DenseParams{}, kH200, always).staging.stage);
  // Staged, exact_gate's K/V are contiguous: two passes again.
  EXPECT_EQ(plan_of(chunk, gate(), kH200, always).passes, 2);
}

TEST(CudaExecutionPlan, ForcingTheHopperPathFailsWhereItCannotRun) {
  ExecutionOverrides hopper;
  hopper.cuda_path = ExecutionOverrides::CudaPath::kHopper;
  const ExecutionPlan h = plan_of(cuda_shape_of(1024, 1024), DenseParams{}, kH200, hopper);
  EXPECT_EQ(h.path, FwdPath::kHopper);
  EXPECT_TRUE(h.hopper_forced);
  const struct {
    ProblemShape shape;
    Policy policy;
    DeviceCaps caps;
    const char* why;
  } cases[] = {
      {cuda_shape_of(1024, 1024), DenseParams{}, kA100, "compute capability 8.0"},
      {cuda_shape_of(1024, 1024), Policy{gate(64)}, kH200, "128 keys"},
  };
  for (const auto& c : cases) {
    ExecutionPlan plan;
    const Status st = plan_execution(c.shape, c.policy, kTma, c.caps, hopper, 0, &plan);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported) << c.why;
    EXPECT_NE(st.message().find("hopper"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(c.why), std::string::npos) << st.message();
  }
  // FP8 has no portable kernel.
  ExecutionOverrides portable;
  portable.cuda_path = ExecutionOverrides::CudaPath::kPortable;
  ExecutionPlan plan;
  const Status st = plan_execution(cuda_shape_of(1024, 1024, 32, 8, 128, DType::kFP8E4M3), DenseParams{}, kTma, kH200,
                                   portable, 0, &plan);
  EXPECT_EQ(st.code(), StatusCode::kUnsupported);
  EXPECT_NE(st.message().find("portable"), std::string::npos) << st.message();
}

TEST(CudaExecutionPlan, TheGridOrderFollowsTheL2) {
  // Llama shape: K and V of 16K keys (64 MiB) exceed the H200's 60 MiB of L2; 8K do not.
  EXPECT_TRUE(plan_of(cuda_shape_of(16384, 16384), DenseParams{}).kv_major);
  EXPECT_FALSE(plan_of(cuda_shape_of(8192, 8192), DenseParams{}).kv_major);
}

TEST(CudaExecutionPlan, PermuteStopPlansItsRankingAndAttention) {
  PermuteStopParams ps;
  const ExecutionPlan h = plan_of(cuda_shape_of(4096, 4096), ps);
  ASSERT_NE(h.permute, nullptr);
  ASSERT_NE(h.permute90, nullptr);
  EXPECT_EQ(execution_info(h, 0).instance, h.permute90->name);
  EXPECT_GT(h.grid, 0);
  ps.block_k = 64;
  const ExecutionPlan p = plan_of(cuda_shape_of(4096, 4096), ps);
  EXPECT_EQ(p.permute90, nullptr);
  EXPECT_EQ(execution_info(p, 0).instance, p.permute->name);
}

// A local window changes no choice of the plan for dense and block_sparse (the same path,
// instances, packing and grid as the window-free call: windows are runtime values of those
// instances), on both devices and paged or not; only K/V staging counts the window's pairs
// (cuda_plan_host_test), and neither stages here. The other policies are refused, by name.
TEST(CudaExecutionPlan, LocalWindowsPlanAsWithoutOneForDenseAndBlockSparse) {
  for (const ProblemShape& base :
       {cuda_shape_of(4096, 4096), cuda_shape_of(32, 4096), with_pages(cuda_shape_of(300, 9000), 16)}) {
    ProblemShape local = base;
    local.window_left = 1023;
    BlockSparseParams mask;
    mask.mask = BlockMask::all_visible(local, 128, 128, true);
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}}) {
      for (const DeviceCaps& caps : {kH200, kA100}) {
        SCOPED_TRACE(std::string(policy_name(policy)) + " on " + std::to_string(caps.cc_major) + ".x, s_q " +
                     std::to_string(base.seq_q[0]));
        const ExecutionPlan w = plan_of(local, policy, caps), plain = plan_of(base, policy, caps);
        EXPECT_EQ(w.path, plain.path);
        EXPECT_EQ(w.fwd, plain.fwd);
        EXPECT_EQ(w.fwd90, plain.fwd90);
        EXPECT_EQ(w.mode, plain.mode);
        EXPECT_EQ(w.q_pack, plain.q_pack);
        EXPECT_EQ(w.grid, plain.grid);
        EXPECT_EQ(w.passes, plain.passes);
      }
    }
    ExecutionPlan refused;
    const Status st = plan_execution(local, gate(), kTma, kH200, {}, std::size_t{100} << 30, &refused);
    EXPECT_EQ(st.code(), StatusCode::kUnsupported);
    EXPECT_NE(st.message().find("runs dense and block_sparse on CUDA, not exact_gate"), std::string::npos) << st.message();
  }
}

TEST(CudaExecutionPlan, OverridesParseOnceAndTheCallsWin) {
  OverrideEnv env;
  env.cuda_path = "portable";
  env.pack_gqa = "never";
  env.kv_staging = "always";
  env.gate_passes = "1";
  ExecutionOverrides parsed;
  ASSERT_TRUE(parse_overrides(env, &parsed).ok());
  EXPECT_EQ(parsed.cuda_path, ExecutionOverrides::CudaPath::kPortable);
  EXPECT_EQ(parsed.pack_gqa, ExecutionOverrides::Choice::kNever);
  EXPECT_EQ(parsed.kv_staging, ExecutionOverrides::Choice::kAlways);
  EXPECT_EQ(parsed.gate_passes, 1);
  ExecutionOverrides call;
  call.cuda_path = ExecutionOverrides::CudaPath::kHopper;
  call.gate_passes = 2;
  const ExecutionOverrides merged = merge_overrides(parsed, call);
  EXPECT_EQ(merged.cuda_path, ExecutionOverrides::CudaPath::kHopper);
  EXPECT_EQ(merged.pack_gqa, ExecutionOverrides::Choice::kNever);
  EXPECT_EQ(merged.kv_staging, ExecutionOverrides::Choice::kAlways);
  EXPECT_EQ(merged.gate_passes, 2);
  EXPECT_EQ(merge_overrides(parsed, {}).cuda_path, ExecutionOverrides::CudaPath::kPortable);

  env.kv_staging = "sometimes";
  const Status st = parse_overrides(env, &parsed);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("SPARSEPREFILL_KV_STAGING"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace sparseprefill::cuda
