// SPDX-License-Identifier: Apache-2.0
// The CUDA kernels against the fp64 oracle: every policy within the calibrated tolerance, the
// CPU backend's (and the oracle's) decisions exactly on inputs placed away from ties, poisoned
// outputs fully written, NaN K/V in blocks that must not be read, odd lengths, s_q != s_k,
// GQA groups 1/4/8 (and the Hopper kernel's packed GQA tiles against its unpacked ones), varlen,
// both dtypes and head dims, and clear errors for what is not built.
// Every case runs on both forward paths: the default one (on an sm_90 device the Hopper kernel
// for dense and 128-key blocks) and the portable kernel (forced).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "common/cases.h"
#include "common/chunks.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/poison.h"
#include "common/results.h"
#include "common/tolerance.h"
#include "core/geometry.h"
#include "cuda/cuda_backend.h"
#include "cuda/plan.h"
#include "cuda/registry.h"
#include "gpu_harness.cuh"
#include "reference/decide.h"
#include "reference/reference.h"
#include "reference/sequence.h"
#include "sparseprefill/attention.h"
#include "sparseprefill/plan.h"

namespace sparseprefill::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SP_REQUIRE_GPU() \
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device"

Decisions cpu_decisions(TestProblem* tp, const Policy& policy) {
  RunOptions opt;
  opt.backend = Backend::kCPU;
  Decisions d;
  const Status st = run(tp->problem(), policy, tp->output(), opt, nullptr, &d);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return d;
}

// Paged K/V staged into contiguous rows (always) or read through the table (never) for the
// guard's lifetime, whatever plan_kv_staging would decide.
class StagedKv {
 public:
  explicit StagedKv(bool on) {
    cuda::set_kv_staging_for_testing(on ? cuda::KvStagingForTesting::kAlways : cuda::KvStagingForTesting::kNever);
  }
  ~StagedKv() { cuda::set_kv_staging_for_testing(cuda::KvStagingForTesting::kAuto); }
  StagedKv(const StagedKv&) = delete;
  StagedKv& operator=(const StagedKv&) = delete;
};

// exact_gate's execution forced to one or two passes (choose_gate_passes) for the guard's
// lifetime, whatever SPARSEPREFILL_EXACT_GATE_PASSES and the plan would choose.
thread_local int t_forced_gate_passes = 0;
class GatePassesForced {
 public:
  explicit GatePassesForced(int passes) {
    cuda::set_gate_passes_for_testing(passes);
    t_forced_gate_passes = passes;
  }
  ~GatePassesForced() {
    cuda::set_gate_passes_for_testing(0);
    t_forced_gate_passes = 0;
  }
  GatePassesForced(const GatePassesForced&) = delete;
  GatePassesForced& operator=(const GatePassesForced&) = delete;
};

// Whether an exact_gate call of `shape` runs two passes on the Hopper or the portable path:
// the plan's choice (host-tested in cuda_plan_host_test) under the forced execution, if any.
bool runs_two_passes(const ProblemShape& shape, bool hopper) {
  const cuda::GateVariant* gate = hopper ? cuda::find_gate90(shape.dtype, shape.d) : cuda::find_gate(shape.dtype, shape.d);
  const cuda::GatePasses mode = t_forced_gate_passes == 1   ? cuda::GatePasses::kOne
                                : t_forced_gate_passes == 2 ? cuda::GatePasses::kTwo
                                                            : cuda::GatePasses::kAuto;
  return cuda::choose_gate_passes(shape, gate != nullptr, mode);
}

// The forward kernel family the default path must launch for (tp, policy) on this device: the
// plan's choice (host-tested in cuda_plan_host_test) on an sm_90 device, the portable one elsewhere.
std::string expected_instance_prefix(const TestProblem& tp, const Policy& policy, bool portable) {
  ProblemShape shape;
  const Status st = validate_problem(tp.problem(), nullptr, &shape);
  EXPECT_TRUE(st.ok()) << st.to_string();
  const bool hopper = st.ok() && !portable && hopper_device() &&
                      cuda::choose_fwd_path(shape, policy, true, 9, 0) == cuda::FwdPath::kHopper;
  // permute_stop has its own kernel family (gathered, permuted tiles) on both paths.
  const bool permute = std::holds_alternative<PermuteStopParams>(policy);
  // The portable forward kernel runs the gates in its gated instances and every other policy in
  // the ungated ones (whose names are not prefixes of the gated ones'); exact_gate in two
  // passes runs a block mask.
  const bool exact = std::holds_alternative<ExactGateParams>(policy);
  const bool gated = (exact && !(st.ok() && runs_two_passes(shape, hopper))) ||
                     std::holds_alternative<SoftmaxSkipParams>(policy);
  const std::string fwd80 =
      gated ? "fwd_sm80_gated_" : std::string("fwd_sm80_") + (tp.q.dtype() == DType::kFP16 ? "fp16_" : "bf16_");
  if (permute) return hopper ? "permute_sm90_" : "permute_sm80_";
  return hopper ? "fwd_sm90_" : fwd80;
}

// The policy through both forward paths: the default one (on an sm_90 device the Hopper kernel
// for dense and 128-key blocks, asserted through the instance that ran) and the portable
// kernel (forced). Each run within the calibrated tolerance of the oracle, every element
// written, and exactly the oracle's and the CPU backend's decisions; the references are
// computed once. The runs in that order.
std::vector<GpuRun> expect_both_paths_match(TestProblem* tp, const Policy& policy) {
  const ref::Result ref64 = oracle(*tp, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(tp->problem(), policy, ref64.decisions, &lowp);
  EXPECT_TRUE(st.ok()) << st.to_string();
  TestProblem copy = *tp;
  const Decisions cpu = cpu_decisions(&copy, policy);
  std::vector<GpuRun> runs;
  for (bool portable : {false, true}) {
    SCOPED_TRACE(portable ? "portable path" : "default path");
    const PortableOnly guard(portable);
    GpuRun r = run_gpu(tp, policy);
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    if (r.status.ok()) {
      EXPECT_TRUE(fully_written(r.out, ref64));
      EXPECT_TRUE(close_calibrated(tp->q.dtype(), r.out, ref64, lowp));
      EXPECT_TRUE(same_decisions(ref64.decisions, r.decisions));
      EXPECT_TRUE(same_decisions(cpu, r.decisions));
      const std::string want = expected_instance_prefix(*tp, policy, portable);
      const std::string ran = cuda::last_fwd_instance_for_testing();
      EXPECT_EQ(ran.rfind(want, 0), 0u) << "ran " << ran << ", expected " << want << "*";
      if (std::holds_alternative<EstimateSelectParams>(policy)) {
        const std::string selector = expected_selector_prefix(portable);
        const std::string chosen = cuda::last_select_instance_for_testing();
        EXPECT_EQ(chosen.rfind(selector, 0), 0u) << "selected with " << chosen << ", expected " << selector << "*";
      }
    }
    runs.push_back(std::move(r));
  }
  return runs;
}

// As expect_both_paths_match; the default path's run.
GpuRun expect_gpu_matches(TestProblem* tp, const Policy& policy) { return expect_both_paths_match(tp, policy).front(); }

std::vector<GpuRun> expect_dense_matches(TestProblem* tp) { return expect_both_paths_match(tp, DenseParams{}); }

Inputs make_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                   DType dtype = DType::kBF16, double scale = 1.5) {
  return random_inputs(lengths, h_q, h_kv, d, dtype, seed, scale);
}

// Sets K or V of key positions [k0, k1) of KV head g in sequence b to NaN.
void poison_keys(Inputs* in, int b, bool value, int g, std::int64_t k0, std::int64_t k1) {
  SequenceData& s = in->seqs[static_cast<std::size_t>(b)];
  HostTensor* t = value ? &s.v : &s.k;
  for (std::int64_t pos = k0; pos < k1; ++pos) {
    for (int c = 0; c < in->d; ++c) set(t, (pos * in->h_kv + g) * in->d + c, kNaN);
  }
}

// Attention structure for the selectors (iid random keys have none: every block looks alike):
// key chunks c of `chunk` positions with c % 3 == 0 are "hot". scale_hot_keys multiplies the
// other keys by `cold` (lower scores: softmax_skip skips them); shift_hot_keys adds `shift` to
// every element of the hot keys (their mean keys stand out: estimate_select prunes the rest).
void scale_hot_keys(Inputs* in, int chunk, double cold) {
  for (SequenceData& s : in->seqs) {
    for (std::int64_t t = 0; t < s.k.shape()[0]; ++t) {
      if ((t / chunk) % 3 == 0) continue;
      for (std::int64_t i = t * in->h_kv * in->d; i < (t + 1) * in->h_kv * in->d; ++i) set(&s.k, i, get(s.k, i) * cold);
    }
  }
}
void shift_hot_keys(Inputs* in, int chunk, double shift) {
  for (SequenceData& s : in->seqs) {
    for (std::int64_t t = 0; t < s.k.shape()[0]; ++t) {
      if ((t / chunk) % 3 != 0) continue;
      for (std::int64_t i = t * in->h_kv * in->d; i < (t + 1) * in->h_kv * in->d; ++i) set(&s.k, i, get(s.k, i) + shift);
    }
  }
}

// ------------------------------------------------------------------ dense

// overrides.cuda_path (SPARSEPREFILL_CUDA_PATH's per-call form) = portable sends a call the
// plan would give the Hopper kernel to the portable one, with the portable kernel's result bit
// for bit (the same kernel as the test hook's); = hopper runs the Hopper kernel on a 9.0 device
// and fails elsewhere; RunStats::execution names what ran.
TEST(CudaDense, PathOverrideForcesEitherPath) {
  SP_REQUIRE_GPU();
  Inputs in = make_inputs({{300, 300}}, 4, 2, 128, 1700);
  TestProblem tp = make_problem(in);
  GpuRun hook;
  {
    const PortableOnly portable(true);
    hook = run_gpu(&tp, DenseParams{});
    ASSERT_TRUE(hook.status.ok()) << hook.status.to_string();
  }
  ExecutionOverrides portable;
  portable.cuda_path = ExecutionOverrides::CudaPath::kPortable;
  const GpuRun forced = run_gpu(&tp, DenseParams{}, nullptr, portable);
  ASSERT_TRUE(forced.status.ok()) << forced.status.to_string();
  EXPECT_EQ(forced.stats.execution.path, "cuda-portable");
  EXPECT_EQ(forced.stats.execution.instance.rfind("fwd_sm80_", 0), 0u) << forced.stats.execution.instance;
  EXPECT_TRUE(same_result(forced.out, hook.out, 0.0));
  ExecutionOverrides hopper;
  hopper.cuda_path = ExecutionOverrides::CudaPath::kHopper;
  const GpuRun on_hopper = run_gpu(&tp, DenseParams{}, nullptr, hopper);
  if (hopper_device()) {
    ASSERT_TRUE(on_hopper.status.ok()) << on_hopper.status.to_string();
    EXPECT_EQ(on_hopper.stats.execution.path, "cuda-hopper");
    EXPECT_EQ(on_hopper.stats.execution.instance.rfind("fwd_sm90_", 0), 0u) << on_hopper.stats.execution.instance;
  } else {
    EXPECT_EQ(on_hopper.status.code(), StatusCode::kUnsupported);
    EXPECT_NE(on_hopper.status.message().find("hopper"), std::string::npos) << on_hopper.status.message();
  }
  // No override: the plan's choice.
  const GpuRun chosen = run_gpu(&tp, DenseParams{});
  ASSERT_TRUE(chosen.status.ok()) << chosen.status.to_string();
  EXPECT_EQ(chosen.stats.execution.instance.rfind(expected_instance_prefix(tp, DenseParams{}, false), 0), 0u)
      << chosen.stats.execution.instance;
}

TEST(CudaDense, OddLengthsBothDtypesAndHeadDims) {
  SP_REQUIRE_GPU();
  int seed = 1;
  for (std::int64_t s : {1, 15, 17, 113, 1023}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      const int d = (seed % 2 == 0) ? 64 : 128;
      SCOPED_TRACE("s = " + std::to_string(s) + " " + dtype_name(dtype) + " d = " + std::to_string(d));
      const Inputs in = make_inputs({{s, s}}, 4, 1, d, static_cast<std::uint64_t>(100 + seed++), dtype);
      TestProblem tp = make_problem(in);
      expect_dense_matches(&tp);
    }
  }
}

TEST(CudaDense, GqaGroupsCausalAndNonCausal) {
  SP_REQUIRE_GPU();
  for (int h_kv : {8, 2, 1}) {  // groups 1, 4, 8
    for (bool causal : {true, false}) {
      SCOPED_TRACE("group " + std::to_string(8 / h_kv) + (causal ? " causal" : " non-causal"));
      const Inputs in = make_inputs({{257, 257}}, 8, h_kv, 128, 200 + static_cast<std::uint64_t>(h_kv));
      TestProblem tp = make_problem(in, causal);
      expect_dense_matches(&tp);
    }
  }
}

TEST(CudaDense, VarlenChunkedPrefillAndEmptyRows) {
  SP_REQUIRE_GPU();
  // s_q < s_k (cached prefix), s_q > s_k (the first s_q - s_k rows see no key: O = 0,
  // LSE = -inf), a single row, and an empty key sequence.
  const std::vector<SeqLen> lengths = {{1, 1}, {15, 40}, {17, 300}, {113, 113}, {300, 17}, {5, 0}};
  for (bool causal : {true, false}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      SCOPED_TRACE(std::string(causal ? "causal " : "non-causal ") + dtype_name(dtype));
      const Inputs in = make_inputs(lengths, 4, 2, 64, 300, dtype);
      TestProblem tp = make_problem(in, causal, Layout::kVarlen);
      for (const GpuRun& r : expect_dense_matches(&tp)) {
        if (!causal || !r.status.ok()) continue;
        // Sequence {300, 17}: rows 0..282 are empty (a whole 128-row block and part of another).
        const std::int64_t row0 = 1 + 15 + 17 + 113;
        const std::int64_t rows = static_cast<std::int64_t>(r.out.lse.size()) / in.h_q;
        for (int h = 0; h < in.h_q; ++h) {
          for (std::int64_t row : {row0, row0 + 200, row0 + 282}) {
            EXPECT_EQ(r.out.lse[static_cast<std::size_t>(h * rows + row)], -kInf);
            EXPECT_EQ(r.out.o[static_cast<std::size_t>((row * in.h_q + h) * in.d)], 0.0);
          }
          EXPECT_NE(r.out.lse[static_cast<std::size_t>(h * rows + row0 + 283)], -kInf);
        }
      }
    }
  }
}

TEST(CudaDense, LongSequence4224) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{4224, 4224}}, 2, 1, 64, 400, DType::kFP16);
  TestProblem tp = make_problem(in);
  expect_dense_matches(&tp);
}

TEST(CudaDense, UnequalLengthsHeadDim128) {
  SP_REQUIRE_GPU();
  // s_q < s_k with an offset that is no multiple of the 128-key tile (two partial tiles per
  // query block), s_q > s_k (leading empty rows), and s_q = s_k, at both dtypes.
  struct Case {
    SeqLen len;
    bool causal;
    DType dtype;
  };
  for (const Case& c : {Case{{2200, 2200}, true, DType::kBF16}, Case{{1023, 2200}, true, DType::kFP16},
                        Case{{2200, 1023}, true, DType::kBF16}, Case{{1023, 2200}, false, DType::kBF16}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal " : " non-causal ") +
                 dtype_name(c.dtype));
    const Inputs in = make_inputs({c.len}, 2, 1, 128, 410 + static_cast<std::uint64_t>(c.len.s_q), c.dtype);
    TestProblem tp = make_problem(in, c.causal);
    expect_dense_matches(&tp);
  }
}

TEST(CudaDense, BatchedUnequalKeysNeverReadCapacity) {
  SP_REQUIRE_GPU();
  // Batched K/V [b, max s_k, h_kv, d] with seqused_k: the storage past each sequence's keys is
  // NaN (build_problem), so reading it would show in O.
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    const Inputs in = make_inputs({{300, 700}, {300, 129}, {300, 1}}, 4, 2, 128, 420);
    TestProblem tp = make_problem(in, causal);
    expect_dense_matches(&tp);
  }
}

TEST(CudaDense, NaNInputsPropagateWithoutCrashing) {
  SP_REQUIRE_GPU();
  Inputs in = make_inputs({{200, 200}}, 2, 1, 64, 450);
  set(&in.seqs[0].q, (150 * in.h_q + 1) * in.d + 3, kNaN);  // row 150 of head 1
  TestProblem tp = make_problem(in);
  for (const GpuRun& r : expect_dense_matches(&tp)) {
    ASSERT_TRUE(r.status.ok());
    EXPECT_TRUE(std::isnan(r.out.lse[static_cast<std::size_t>(1 * 200 + 150)]));
    EXPECT_FALSE(std::isnan(r.out.lse[static_cast<std::size_t>(1 * 200 + 149)]));
  }
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
      expect_dense_matches(&tp);
    }
  }
}

// ------------------------------------------------------------------ block_sparse

// A random mask over `shape` that never selects the "dead" key blocks (every third block of
// every row, per mask head) so that their K and V can be NaN.
BlockMask random_mask(const ProblemShape& shape, int block_k, bool per_kv, std::uint64_t seed,
                      std::vector<std::vector<int>>* dead_by_head) {
  BlockMask m = BlockMask::empty(shape, 128, block_k, per_kv);
  Random rng(seed);
  dead_by_head->assign(static_cast<std::size_t>(m.heads), {});
  for (int h = 0; h < m.heads; ++h) {
    for (int kb = 0; kb < m.num_k_blocks; ++kb) {
      if ((kb + h) % 3 == 1) (*dead_by_head)[static_cast<std::size_t>(h)].push_back(kb);
    }
  }
  for (int b = 0; b < m.batch; ++b) {
    const geom::BlockGeometry g = geometry(shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)],
                                           shape.causal, 128, block_k);
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        for (int kb = 0; kb < g.visible_end(qb); ++kb) {
          if ((kb + h) % 3 == 1 || rng.below(4) == 0) continue;
          EXPECT_TRUE(m.add(shape, b, h, qb, kb).ok());
        }
      }
    }
  }
  return m;
}

TEST(CudaBlockSparse, RandomMasksWithNaNInUnselectedBlocks) {
  SP_REQUIRE_GPU();
  struct Case {
    SeqLen len;
    int h_q, h_kv, d, block_k;
    bool per_kv, causal;
  };
  for (const Case& c : {Case{{700, 700}, 4, 1, 128, 64, false, true}, Case{{700, 1100}, 8, 2, 64, 128, true, true},
                        Case{{333, 333}, 2, 2, 128, 128, false, false}, Case{{129, 900}, 4, 4, 64, 64, true, true},
                        Case{{1023, 1023}, 4, 1, 128, 128, false, true}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + " block_k " + std::to_string(c.block_k) +
                 (c.per_kv ? " per kv head" : " per q head"));
    Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, c.d, 500 + static_cast<std::uint64_t>(c.len.s_k));
    TestProblem clean = make_problem(in, c.causal);
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(clean.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams p;
    p.mask = random_mask(shape, c.block_k, c.per_kv, 77, &dead);
    // NaN K and V of blocks no row of a KV head can select (with per-q-head masks: blocks dead
    // for every q head of the group).
    const geom::BlockGeometry g = geometry(c.len.s_q, c.len.s_k, c.causal, 128, c.block_k);
    for (int kvh = 0; kvh < c.h_kv; ++kvh) {
      for (int kb = 0; kb < g.num_k_blocks(); ++kb) {
        bool all_dead = true;
        const int group = c.h_q / c.h_kv;
        for (int h = 0; h < (c.per_kv ? 1 : group); ++h) {
          const auto& list = dead[static_cast<std::size_t>(c.per_kv ? kvh : kvh * group + h)];
          all_dead &= std::find(list.begin(), list.end(), kb) != list.end();
        }
        if (!all_dead) continue;
        poison_keys(&in, 0, false, kvh, g.key_begin(kb), g.key_end(kb));
        poison_keys(&in, 0, true, kvh, g.key_begin(kb), g.key_end(kb));
      }
    }
    TestProblem dirty = make_problem(in, c.causal);
    expect_gpu_matches(&dirty, p);
  }
}

TEST(CudaBlockSparse, AllVisibleMaskEqualsDenseBitwise) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{600, 800}}, 4, 2, 128, 600);
  TestProblem tp = make_problem(in);
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  // block_k 64: the same 64-key steps in the same order as dense, so the same roundings.
  BlockSparseParams p;
  p.mask = BlockMask::all_visible(shape, 128, 64, false);
  const GpuRun sparse = run_gpu(&tp, p);
  ASSERT_TRUE(sparse.status.ok()) << sparse.status.to_string();
  {
    const PortableOnly portable(true);  // the same kernel: the Hopper one tiles keys by 128
    const GpuRun dense = run_gpu(&tp, DenseParams{});
    ASSERT_TRUE(dense.status.ok()) << dense.status.to_string();
    EXPECT_TRUE(same_result(sparse.out, dense.out, 0.0));
  }
  if (!hopper_device()) return;
  // block_k 128 on the Hopper kernel: the partial then the full list, each descending, are
  // dense's descending tiles, through the same code.
  p.mask = BlockMask::all_visible(shape, 128, 128, false);
  const GpuRun sparse128 = run_gpu(&tp, p);
  ASSERT_TRUE(sparse128.status.ok()) << sparse128.status.to_string();
  EXPECT_EQ(cuda::last_fwd_instance_for_testing().rfind("fwd_sm90_", 0), 0u);
  const GpuRun dense90 = run_gpu(&tp, DenseParams{});
  ASSERT_TRUE(dense90.status.ok()) << dense90.status.to_string();
  EXPECT_TRUE(same_result(sparse128.out, dense90.out, 0.0));
}

// ------------------------------------------------------------------ exact_gate

ExactGateParams gate_params(const HostTensor& thr, int bk) {
  ExactGateParams p;
  p.block_q = 128;
  p.block_k = bk;
  p.thresholds = thr.view();
  return p;
}

// FP8 (e4m3) inputs with per-(batch, kv head) descales that are not powers of two, bf16 output:
// dense and 128 x 128 block masks on the Hopper kernel's fp8 instance against the oracle on
// the dequantized values, within the calibrated tolerance (its low-precision reference rounds
// P to e4m3 as the kernel does); batched and varlen, causal or not, GQA groups 1 to 4, key
// counts that are not multiples of 128 (the transposed V's zero padding) and a sequence without
// keys. A wrong key order in the transposed V or a descale of the wrong head fails it. Other
// devices refuse, saying why.
TEST(CudaFp8, DenseAndBlockSparseMatchTheOracle) {
  SP_REQUIRE_GPU();
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv;
    bool causal;
    Layout layout;
  };
  for (const Case& c : {Case{{{300, 300}}, 4, 1, true, Layout::kBatched},
                        Case{{{700, 1100}, {129, 40}, {5, 0}}, 8, 2, true, Layout::kVarlen},
                        Case{{{333, 333}, {333, 333}}, 2, 2, false, Layout::kBatched},
                        Case{{{520, 520}, {257, 300}}, 8, 8, false, Layout::kVarlen}}) {
    SCOPED_TRACE(std::to_string(c.lens.size()) + " sequence(s), h_q " + std::to_string(c.h_q) + ", h_kv " +
                 std::to_string(c.h_kv) + (c.causal ? ", causal" : ", non-causal"));
    const Inputs in = random_inputs(c.lens, c.h_q, c.h_kv, 128, DType::kFP8E4M3, 900 + c.h_q, 3.0);
    TestProblem tp = make_problem(in, c.causal, c.layout);
    const int batch = static_cast<int>(c.lens.size());
    tp.q_descale = HostTensor(DType::kFP32, {batch, c.h_kv});
    tp.k_descale = HostTensor(DType::kFP32, {batch, c.h_kv});
    tp.v_descale = HostTensor(DType::kFP32, {batch, c.h_kv});
    for (int i = 0; i < batch * c.h_kv; ++i) {
      set(&tp.q_descale, i, 0.3 + 0.05 * i);
      set(&tp.k_descale, i, 0.7 - 0.03 * i);
      set(&tp.v_descale, i, 1.3 + 0.11 * (i % 5));
    }
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams mask;
    mask.mask = random_mask(shape, 128, false, 31, &dead);
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}}) {
      SCOPED_TRACE(policy_name(policy));
      if (!hopper_device()) {
        const GpuRun r = run_gpu(&tp, policy);
        EXPECT_EQ(r.status.code(), StatusCode::kUnsupported);
        EXPECT_NE(r.status.message().find("fp8_e4m3 inputs run on the Hopper kernel only"), std::string::npos)
            << r.status.message();
        continue;
      }
      const ref::Result ref64 = oracle(tp, policy);
      ref::Result lowp;
      ASSERT_TRUE(run_lowp_reference(tp.problem(), policy, ref64.decisions, &lowp).ok());
      const GpuRun r = run_gpu(&tp, policy);
      ASSERT_TRUE(r.status.ok()) << r.status.to_string();
      EXPECT_EQ(cuda::last_fwd_instance_for_testing(), "fwd_sm90_fp8_hd128");
      EXPECT_TRUE(fully_written(r.out, ref64));
      EXPECT_TRUE(close_calibrated(DType::kFP8E4M3, r.out, ref64, lowp));
    }
  }
}

// FP8's error does not grow with the number of keys a row sums. The row sums that normalise O
// are sums of positive terms over the whole row, and an FP8 wgmma adds into its accumulator at
// about 14 significant bits (truncating), so a kernel that kept a whole row's sum in the P·V
// accumulator normalised long rows by a sum too low in proportion to the key count. Reference:
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

TEST(CudaExactGate, MidpointThresholdsCausalChunkedAndNonCausal) {
  SP_REQUIRE_GPU();
  struct Case {
    SeqLen len;
    bool causal;
    int h_q, h_kv, d, block_k;
    DType dtype;
  };
  for (const Case& c : {Case{{600, 600}, true, 4, 1, 128, 64, DType::kBF16},
                        Case{{200, 1500}, true, 2, 2, 64, 128, DType::kFP16},
                        Case{{300, 500}, false, 8, 2, 128, 128, DType::kBF16},
                        Case{{1023, 1023}, true, 2, 1, 64, 128, DType::kBF16}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal") +
                 " block_k " + std::to_string(c.block_k));
    const Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, c.d, 700 + static_cast<std::uint64_t>(c.len.s_q), c.dtype);
    TestProblem tp = make_problem(in, c.causal);
    const HostTensor thr = midpoint_thresholds(in, c.causal, 128, c.block_k, 0.4);
    const GpuRun r = expect_gpu_matches(&tp, gate_params(thr, c.block_k));
    if (!r.status.ok()) continue;
    const std::int64_t visible = visible_blocks({c.len}, c.h_q, c.causal, 128, c.block_k);
    EXPECT_LT(r.decisions.kept.selected_blocks(), visible) << "the thresholds should skip some blocks";
  }
}

TEST(CudaExactGate, MinusInfinityKeepsAllAndEqualsDense) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{500, 700}}, 4, 1, 128, 800);
  TestProblem tp = make_problem(in);
  HostTensor thr(DType::kFP32, {4, 3});
  for (int i = 0; i < 12; ++i) thr.as<float>()[i] = -std::numeric_limits<float>::infinity();
  // block_k 64 (the portable kernel on every device: the Hopper one tiles keys by 128): every
  // block is kept, and O matches the dense oracle within its tolerance. Not compared with the
  // portable dense run directly: the gated instance takes the exact running-max update and
  // dense the lazy one (softmax.cuh), so their P roundings differ.
  const GpuRun gate = expect_gpu_matches(&tp, gate_params(thr, 64));
  EXPECT_EQ(gate.decisions.kept.selected_blocks(), visible_blocks({{500, 700}}, 4, true, 128, 64));
  // block_k 128 decides on whole blocks (the portable kernel: one rescale per block): within
  // the tolerance on both paths.
  const GpuRun gate128 = expect_gpu_matches(&tp, gate_params(thr, 128));
  EXPECT_EQ(gate128.decisions.kept.selected_blocks(), visible_blocks({{500, 700}}, 4, true, 128, 128));
  if (!hopper_device()) return;
  // The Hopper kernel gates 128-key tiles with dense's softmax steps: a kept-all gate is dense.
  const GpuRun dense90 = run_gpu(&tp, DenseParams{});
  ASSERT_TRUE(dense90.status.ok()) << dense90.status.to_string();
  EXPECT_TRUE(same_result(gate128.out, dense90.out, 0.0));
}

TEST(CudaExactGate, NaNValuesOfSkippedBlocksAreNeverRead) {
  SP_REQUIRE_GPU();
  // One query block over a long prefix: every prefix block is full and gated. V of the blocks
  // the gate skips for every head of the KV group is NaN (K stays: the gate reads it). block_k
  // 128 runs the Hopper kernel on an sm_90 device (its producer must not request those V tiles).
  const SeqLen len{100, 1400};
  for (int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    Inputs in = make_inputs({len}, 2, 2, 128, 900);
    TestProblem clean = make_problem(in);
    const HostTensor thr = midpoint_thresholds(in, true, 128, block_k, 0.3);
    const std::vector<GpuRun> want = expect_both_paths_match(&clean, gate_params(thr, block_k));
    ASSERT_TRUE(want[0].status.ok() && want[1].status.ok());
    const geom::BlockGeometry g = geometry(len.s_q, len.s_k, true, 128, block_k);
    int poisoned = 0;
    for (int h = 0; h < in.h_q; ++h) {
      for (int kb = 0; kb < g.visible_end(0); ++kb) {
        if (!want[0].decisions.kept.contains(0, h, 0, kb)) {
          poison_keys(&in, 0, true, h, g.key_begin(kb), g.key_end(kb));
          ++poisoned;
        }
      }
    }
    ASSERT_GT(poisoned, 0);
    TestProblem dirty = make_problem(in);
    for (bool portable : {false, true}) {
      SCOPED_TRACE(portable ? "portable path" : "default path");
      const PortableOnly guard(portable);
      // In one pass and in two: each run on the poisoned inputs equals the same execution's run
      // on the clean ones.
      for (int passes : {1, 2}) {
        SCOPED_TRACE(std::to_string(passes) + " pass(es)");
        const GatePassesForced forced(passes);
        const GpuRun ref = run_gpu(&clean, gate_params(thr, block_k));
        const GpuRun got = run_gpu(&dirty, gate_params(thr, block_k));
        ASSERT_TRUE(ref.status.ok() && got.status.ok());
        EXPECT_EQ(cuda::last_gate_passes_for_testing(), passes);
        EXPECT_TRUE(same_result(got.out, ref.out, 0.0));
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
  const GpuRun r = expect_gpu_matches(&tp, gate_params(thr, 128));
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
  for (int passes : {1, 2}) {
    SCOPED_TRACE(std::to_string(passes) + " pass(es)");
    const GatePassesForced forced(passes);
    const std::vector<GpuRun> runs = expect_both_paths_match(&tp, gate_params(thr, 128));
    for (const GpuRun& r : runs) {
      ASSERT_TRUE(r.status.ok());
      EXPECT_EQ(cuda::last_gate_passes_for_testing(), passes);
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
// calibrated tolerance of the oracle, every element written, the oracle's and the CPU
// backend's decisions. On the Hopper path both executions compute S with the same wgmma and
// visit the kept blocks in the same order with the same softmax steps, so every output bit
// agrees too (the portable gated instance rescales group A exactly, the plain one lazily).
// GQA groups 1, 3, 4 and 8 (the Hopper decision kernel scores 1, 3, 4 and 4 heads per CTA; 8:
// two CTAs per KV head), head dims 64 and 128, bf16 and fp16, block_k 64 and 128, causal with
// s_q < s_k, a query block of 5 rows whose short last key block is gated, non-causal with a
// short last block, and a varlen batch with a sequence without keys.
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
    const HostTensor thr = midpoint_thresholds(in, c.causal, 128, c.block_k, 0.3);
    const Policy policy = gate_params(thr, c.block_k);
    const ref::Result ref64 = oracle(tp, policy);
    ref::Result lowp;
    ASSERT_TRUE(run_lowp_reference(tp.problem(), policy, ref64.decisions, &lowp).ok());
    TestProblem copy = tp;
    const Decisions cpu = cpu_decisions(&copy, policy);
    EXPECT_LT(ref64.decisions.kept.selected_blocks(), visible_blocks(c.lens, c.h_q, c.causal, 128, c.block_k))
        << "the thresholds should skip some blocks";
    for (bool portable : {false, true}) {
      SCOPED_TRACE(portable ? "portable path" : "default path");
      const PortableOnly guard(portable);
      std::vector<GpuRun> runs;
      for (int passes : {1, 2}) {
        SCOPED_TRACE(std::to_string(passes) + " pass(es)");
        const GatePassesForced forced(passes);
        runs.push_back(run_gpu(&tp, policy));
        const GpuRun& r = runs.back();
        ASSERT_TRUE(r.status.ok()) << r.status.to_string();
        EXPECT_EQ(cuda::last_gate_passes_for_testing(), passes);
        EXPECT_TRUE(fully_written(r.out, ref64));
        EXPECT_TRUE(close_calibrated(c.dtype, r.out, ref64, lowp));
        EXPECT_TRUE(same_decisions(ref64.decisions, r.decisions));
        EXPECT_TRUE(same_decisions(cpu, r.decisions));
      }
      const bool hopper = cuda::last_fwd_instance_for_testing().rfind("fwd_sm90_", 0) == 0;
      if (hopper) EXPECT_TRUE(same_result(runs[1].out, runs[0].out, 0.0));
    }
  }
}

// ------------------------------------------------------------------ softmax_skip

SoftmaxSkipParams skip_params(double a, int bk) {
  SoftmaxSkipParams p;
  p.a = a;
  p.block_q = 128;
  p.block_k = bk;
  return p;
}

std::vector<double> scale_factors(std::int64_t s_k) {
  std::vector<double> out;
  for (double lambda : {0.1, 0.03, 0.3, 0.01, 0.003, 0.001}) out.push_back(lambda * static_cast<double>(s_k));
  return out;
}

TEST(CudaSoftmaxSkip, StableScaleFactorsAgainstOracle) {
  SP_REQUIRE_GPU();
  struct Case {
    SeqLen len;
    bool causal;
    int h_q, h_kv, d, block_k;
  };
  for (const Case& c : {Case{{700, 700}, true, 4, 1, 128, 64}, Case{{150, 1200}, true, 2, 2, 64, 128},
                        Case{{400, 400}, false, 4, 4, 64, 64}, Case{{900, 900}, true, 4, 1, 128, 128},
                        Case{{400, 700}, false, 4, 2, 128, 128}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal"));
    Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, c.d, 1000 + static_cast<std::uint64_t>(c.len.s_k), DType::kBF16, 3.0);
    scale_hot_keys(&in, 64, 0.1);
    TestProblem tp = make_problem(in, c.causal);
    const double a = stable_parameter(tp, scale_factors(c.len.s_k),
                                      [&](double x) -> Policy { return skip_params(x, c.block_k); },
                                      some_skipped(visible_blocks({c.len}, c.h_q, c.causal, 128, c.block_k)));
    ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
    expect_gpu_matches(&tp, skip_params(a, c.block_k));
  }
}

TEST(CudaSoftmaxSkip, OffWhenContextShorterThanA) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{300, 300}}, 2, 1, 64, 1100, DType::kBF16, 3.0);
  TestProblem tp = make_problem(in);
  const GpuRun r = expect_gpu_matches(&tp, skip_params(301.0, 64));
  EXPECT_EQ(r.decisions.kept.selected_blocks(), visible_blocks({{300, 300}}, 2, true, 128, 64));
}

// ------------------------------------------------------------------ estimate_select

EstimateSelectParams select_params(double alpha, bool correction, bool pack) {
  EstimateSelectParams p;
  p.block = 128;
  p.alpha = alpha;
  p.sink = 1;
  p.window = 2;
  p.tail = 1;
  p.mean_correction = correction;
  p.pack_gqa = pack;
  return p;
}

TEST(CudaEstimateSelect, StableAlphaAgainstOracle) {
  SP_REQUIRE_GPU();
  struct Case {
    SeqLen len;
    int h_q, h_kv, d;
    bool correction, pack;
  };
  for (const Case& c : {Case{{1300, 1300}, 4, 1, 128, false, false}, Case{{1300, 1300}, 4, 1, 64, true, false},
                        Case{{300, 1500}, 4, 1, 128, true, true}, Case{{1023, 1023}, 8, 2, 64, false, true},
                        Case{{900, 700}, 2, 2, 128, true, false}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + " d " + std::to_string(c.d) +
                 (c.correction ? " corrected" : "") + (c.pack ? " pack_gqa" : ""));
    Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, c.d, 1000 + static_cast<std::uint64_t>(c.len.s_k), DType::kBF16, 2.5);
    shift_hot_keys(&in, 128, 1.5);
    TestProblem tp = make_problem(in);
    const int units = c.pack ? c.h_kv : c.h_q;
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1, 0.05, 0.7},
                                          [&](double x) -> Policy { return select_params(x, c.correction, c.pack); },
                                          some_skipped(visible_blocks({c.len}, units, true, 128, 128)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const GpuRun r = expect_gpu_matches(&tp, select_params(alpha, c.correction, c.pack));
    if (c.correction && r.status.ok()) EXPECT_GT(r.decisions.corrected.selected_blocks(), 0);
  }
}

TEST(CudaEstimateSelect, VarlenBatchOfTwo) {
  SP_REQUIRE_GPU();
  Inputs in = make_inputs({{700, 900}, {1100, 1100}}, 2, 1, 64, 1300, DType::kFP16, 2.5);
  shift_hot_keys(&in, 128, 1.5);
  TestProblem tp = make_problem(in, true, Layout::kVarlen);
  const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                        [&](double x) -> Policy { return select_params(x, true, false); },
                                        some_skipped(visible_blocks({{700, 900}, {1100, 1100}}, 2, true, 128, 128)));
  ASSERT_FALSE(std::isnan(alpha));
  expect_gpu_matches(&tp, select_params(alpha, true, false));
}

// ------------------------------------------------------------------ GQA packing

// `policy` with the Hopper kernel's tiles packed (overrides.pack_gqa = always: 128 / G rows
// of each of a KV group's G query heads per tile, choose_q_pack) and unpacked (never): the packed
// run matches the oracle and equals the unpacked one element for element (every row sees the
// same key tiles in the same order, only its place in the tile moves). The instance that ran
// packed exactly on an sm_90 device; nothing packs elsewhere.
void expect_packed_equals_unpacked(TestProblem* tp, const Policy& policy, int group) {
  const ref::Result ref64 = oracle(*tp, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(tp->problem(), policy, ref64.decisions, &lowp);
  ASSERT_TRUE(st.ok()) << st.to_string();
  GpuRun packed, unpacked;
  int packed_q = 0, unpacked_q = 0;
  ExecutionOverrides pack;
  pack.pack_gqa = ExecutionOverrides::Choice::kAlways;
  packed = run_gpu(tp, policy, nullptr, pack);
  packed_q = packed.stats.execution.q_pack;
  pack.pack_gqa = ExecutionOverrides::Choice::kNever;
  unpacked = run_gpu(tp, policy, nullptr, pack);
  unpacked_q = unpacked.stats.execution.q_pack;
  ASSERT_TRUE(packed.status.ok()) << packed.status.to_string();
  ASSERT_TRUE(unpacked.status.ok()) << unpacked.status.to_string();
  EXPECT_EQ(packed_q, hopper_device() ? group : 1);
  EXPECT_EQ(unpacked_q, 1);
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
    mask.mask = random_mask(shape, 128, true, 91 + static_cast<std::uint64_t>(seed), &dead);
    SCOPED_TRACE("block_sparse, a mask row per KV head");
    expect_packed_equals_unpacked(&tp, mask, group);
  }
  Inputs in = make_inputs({{300, 1500}}, 8, 2, 128, 1950, DType::kBF16, 2.5);
  shift_hot_keys(&in, 128, 1.5);
  TestProblem tp = make_problem(in);
  const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1, 0.05},
                                        [&](double x) -> Policy { return select_params(x, true, true); },
                                        some_skipped(visible_blocks({{300, 1500}}, 2, true, 128, 128)));
  ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
  SCOPED_TRACE("estimate_select, pack_gqa, mean correction");
  expect_packed_equals_unpacked(&tp, select_params(alpha, true, true), 4);
}

// ------------------------------------------------------------------ permute_stop

PermuteStopParams permute_params(double tau, int segment, int block_k) {
  PermuteStopParams p;
  p.tau = tau;
  p.segment = segment;
  p.block_q = 128;
  p.block_k = block_k;
  return p;
}

// Some tile stops before the end of its ranked prefix, and some visits at least two chunks.
bool stops_early(const Decisions& d) {
  bool early = false, several = false;
  for (const PermuteTile& t : d.tiles) {
    early |= t.chunks_visited < t.chunks_total;
    several |= t.chunks_visited >= 2;
  }
  return early && several;
}

// Structure for the ranking and the stop rule: every query element shifted by 0.5 and the hot
// keys' (shift_hot_keys) by 1.0, so that the hot keys hold most of a row's mass, rank first,
// and the chunks after them add little (iid keys give every chunk about the same gain).
Inputs permute_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                      DType dtype = DType::kBF16) {
  Inputs in = make_inputs(lengths, h_q, h_kv, d, seed, dtype, 2.5);
  shift_hot_keys(&in, 64, 1.0);
  for (SequenceData& s : in.seqs) {
    for (std::int64_t i = 0; i < s.q.numel(); ++i) set(&s.q, i, get(s.q, i) + 0.5);
  }
  return in;
}

// A tau whose oracle decisions are stable (kMargin) and stop some tiles early.
double stable_tau(const TestProblem& tp, int segment, int block_k) {
  return stable_parameter(tp, {0.05, 0.1, 0.02, 0.2, 0.03, 0.01, 0.3},
                          [&](double x) -> Policy { return permute_params(x, segment, block_k); }, stops_early);
}

TEST(CudaPermuteStop, StableTauAgainstOracle) {
  SP_REQUIRE_GPU();
  struct Case {
    SeqLen len;
    int h_q, h_kv, d;
    DType dtype;
    int segment, block_k;
  };
  // GQA groups 4, 8 and 1; odd lengths; s_q < s_k (a cached prefix no segment of the call owns)
  // and s_q > s_k (rows at negative positions: O = 0, LSE = -inf); segments that are and are
  // not multiples of the 128-row tile.
  for (const Case& c : {Case{{1300, 1300}, 4, 1, 128, DType::kBF16, 256, 128},
                        Case{{1023, 1023}, 8, 1, 64, DType::kFP16, 320, 64},
                        Case{{300, 1500}, 2, 2, 128, DType::kBF16, 384, 64},
                        Case{{900, 700}, 4, 1, 64, DType::kBF16, 200, 128},
                        Case{{2113, 2113}, 2, 1, 128, DType::kFP16, 1024, 128}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + " d " + std::to_string(c.d) + " group " +
                 std::to_string(c.h_q / c.h_kv) + " segment " + std::to_string(c.segment) + " block_k " +
                 std::to_string(c.block_k));
    const Inputs in = permute_inputs({c.len}, c.h_q, c.h_kv, c.d, 1700 + static_cast<std::uint64_t>(c.len.s_k), c.dtype);
    TestProblem tp = make_problem(in);
    const double tau = stable_tau(tp, c.segment, c.block_k);
    ASSERT_FALSE(std::isnan(tau)) << "no tau with a margin stops a tile early";
    expect_gpu_matches(&tp, permute_params(tau, c.segment, c.block_k));
  }
}

TEST(CudaPermuteStop, VarlenWithEmptyRowsAndShortSequences) {
  SP_REQUIRE_GPU();
  const std::vector<SeqLen> lengths = {{1, 1}, {15, 40}, {300, 17}, {700, 900}, {113, 113}, {5, 0}};
  const Inputs in = permute_inputs(lengths, 4, 2, 64, 1800);
  TestProblem tp = make_problem(in, true, Layout::kVarlen);
  const double tau = stable_tau(tp, 128, 64);
  ASSERT_FALSE(std::isnan(tau));
  expect_gpu_matches(&tp, permute_params(tau, 128, 64));
}

TEST(CudaPermuteStop, TauZeroVisitsEverythingAndEqualsDense) {
  SP_REQUIRE_GPU();
  const Inputs in = make_inputs({{777, 777}}, 4, 2, 128, 1900);
  TestProblem tp = make_problem(in);
  const GpuRun r = expect_gpu_matches(&tp, permute_params(0.0, 256, 128));
  for (const PermuteTile& t : r.decisions.tiles) EXPECT_EQ(t.chunks_visited, t.chunks_total);
  const ref::Result dense = oracle(tp, DenseParams{});
  ref::Result lowp;
  const Status st = run_lowp_reference(tp.problem(), DenseParams{}, dense.decisions, &lowp);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(close_calibrated(tp.q.dtype(), r.out, dense, lowp));
}

// Keys of a cached prefix that no segment of the call owns are read only through pass 2: the
// ones that no tile of any query head of their KV group visits get NaN values (V does not
// move the decisions), and the output must not see them. 128-key chunks run the Hopper kernel
// on sm_90, which loads the chunk after a stop before it knows of the stop.
TEST(CudaPermuteStop, NaNValuesOfUnvisitedChunksAreNeverRead) {
  SP_REQUIRE_GPU();
  for (const int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    const int segment = 256;
    Inputs in = permute_inputs({{300, 1500}}, 4, 2, 128, 2000);
    TestProblem tp = make_problem(in);
    const double tau = stable_tau(tp, segment, block_k);
    ASSERT_FALSE(std::isnan(tau));
    const PermuteStopParams params = permute_params(tau, segment, block_k);
    const ref::Result before = oracle(tp, params);
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    const ref::Sequence seq = ref::gather_sequence(tp.problem(), shape, 0);
    const std::int64_t own_begin = (1500 - 300) / segment * segment;  // the first segment's first key
    std::vector<std::vector<bool>> read(static_cast<std::size_t>(in.h_kv),
                                       std::vector<bool>(static_cast<std::size_t>(own_begin)));
    for (const PermuteTile& t : before.decisions.tiles) {
      const ref::SegmentOrder ord = ref::order_segment(seq, t.head, t.segment, params);
      const std::int64_t n = geom::min64(static_cast<std::int64_t>(t.chunks_visited) * block_k, ord.prefix);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t key = ord.ranked[static_cast<std::size_t>(i)];
        const auto group = static_cast<std::size_t>(t.head / (in.h_q / in.h_kv));
        if (key < own_begin) read[group][static_cast<std::size_t>(key)] = true;
      }
  }
  int poisoned = 0;
  for (int g = 0; g < in.h_kv; ++g) {
    for (std::int64_t key = 0; key < own_begin; ++key) {
      if (read[static_cast<std::size_t>(g)][static_cast<std::size_t>(key)]) continue;
      poison_keys(&in, 0, true, g, key, key + 1);
      ++poisoned;
    }
  }
  ASSERT_GT(poisoned, 0) << "every cached key is visited: the case tests nothing";
  TestProblem poisoned_tp = make_problem(in);
  const GpuRun r = expect_gpu_matches(&poisoned_tp, params);
  EXPECT_TRUE(same_decisions(before.decisions, r.decisions));
  }
}


// ------------------------------------------------------------------ paged K/V

// Page sizes of the paged checks. Portable kernel: one key per page and pages smaller than a
// 64-key sub-tile (a sub-tile spans pages: rows translated one by one), equal to it and larger
// than a 128-key block (a sub-tile lies in one page: translated once). Hopper kernel: rows
// gathered through the table (1, 3, 16, 24, whose pages straddle key tiles, and 32:
// hopper_gathers_pages), one TMA box per page (64) and two tiles per page (256, boxes of 128
// rows).
constexpr int kPageSizes[] = {1, 3, 16, 24, 32, 64, 256};

TestProblem paged_problem(const Inputs& in, int page_size, bool causal = true) {
  LayoutOptions opt;
  opt.layout = Layout::kPaged;
  opt.page_size = page_size;
  opt.page_seed = 40 + static_cast<std::uint64_t>(page_size);
  opt.causal = causal;
  return build_problem(in, opt);
}

// The forward kernel `ran` must be for a call whose expected_instance_prefix is `want`: on the
// Hopper path a paged call runs the paged instance, any other call a contiguous one.
void expect_instance(const std::string& ran, const std::string& want, bool paged) {
  const std::string prefix = paged && want == "fwd_sm90_" ? "fwd_sm90_paged_" : want;
  EXPECT_EQ(ran.rfind(prefix, 0), 0u) << "ran " << ran << ", expected " << prefix << "*";
  if (!paged) EXPECT_NE(ran.rfind("fwd_sm90_paged_", 0), 0u) << "ran " << ran << " on contiguous K/V";
}

// `policy` on paged K/V (shuffled pages, NaN in every storage no valid key uses) at every page
// size of kPageSizes against the same call on contiguous varlen K/V, on both paths (the
// default one, asserted through the instance that ran, and the portable kernel, forced), with
// the pages read by the kernels and staged into contiguous rows first (both forced): the
// same decisions (the oracle's and the CPU backend's too), O and LSE bit for bit with the
// contiguous call on the same kernel (the same tiles reach shared memory, only their
// addresses differ; the Hopper kernel's paged boxes compose into the contiguous tile, rows
// past s_k masked as there; staged rows are the contiguous rows), every output written and
// within the calibrated tolerance of the oracle.
void expect_paged_equals_contiguous(const Inputs& in, const Policy& policy, bool causal = true) {
  TestProblem contiguous = make_problem(in, causal, Layout::kVarlen);
  const ref::Result ref64 = oracle(contiguous, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(contiguous.problem(), policy, ref64.decisions, &lowp);
  ASSERT_TRUE(st.ok()) << st.to_string();
  TestProblem copy = contiguous;
  const Decisions cpu = cpu_decisions(&copy, policy);
  std::vector<GpuRun> want;  // contiguous: default path, portable path
  for (bool portable : {false, true}) {
    SCOPED_TRACE(portable ? "contiguous, portable path" : "contiguous, default path");
    const PortableOnly guard(portable);
    want.push_back(run_gpu(&contiguous, policy));
    const GpuRun& w = want.back();
    ASSERT_TRUE(w.status.ok()) << w.status.to_string();
    expect_instance(cuda::last_fwd_instance_for_testing(), expected_instance_prefix(contiguous, policy, portable), false);
    EXPECT_TRUE(fully_written(w.out, ref64));
    EXPECT_TRUE(close_calibrated(in.dtype, w.out, ref64, lowp));
    EXPECT_TRUE(same_decisions(ref64.decisions, w.decisions));
    EXPECT_TRUE(same_decisions(cpu, w.decisions));
  }
  const std::string contiguous_prefix[2] = {expected_instance_prefix(contiguous, policy, false),
                                            expected_instance_prefix(contiguous, policy, true)};
  // exact_gate over pages read in the kernel runs one pass (runs_two_passes), the contiguous
  // calls two: compared with contiguous one-pass runs, on each path.
  const bool exact = std::holds_alternative<ExactGateParams>(policy);
  std::vector<GpuRun> want_one_pass;
  if (exact) {
    const GatePassesForced forced(1);
    for (bool portable : {false, true}) {
      const PortableOnly guard(portable);
      want_one_pass.push_back(run_gpu(&contiguous, policy));
      ASSERT_TRUE(want_one_pass.back().status.ok()) << want_one_pass.back().status.to_string();
    }
  }
  for (int page : kPageSizes) {
    TestProblem paged = paged_problem(in, page, causal);
    for (bool staged : {false, true}) {
      for (bool portable : {false, true}) {
        SCOPED_TRACE("page_size " + std::to_string(page) + (staged ? ", staged" : ", pages read in the kernel") +
                     (portable ? ", portable path" : ", default path"));
        const PortableOnly guard(portable);
        const StagedKv staging(staged);
        const GpuRun got = run_gpu(&paged, policy);
        ASSERT_TRUE(got.status.ok()) << got.status.to_string();
        EXPECT_EQ(cuda::last_call_staged_kv_for_testing(), staged);
        // Staged: the contiguous call's kernel on the staged rows.
        const std::string expected = expected_instance_prefix(staged ? contiguous : paged, policy, portable);
        expect_instance(cuda::last_fwd_instance_for_testing(), expected, !staged);
        EXPECT_TRUE(fully_written(got.out, ref64));
        EXPECT_TRUE(close_calibrated(in.dtype, got.out, ref64, lowp));
        EXPECT_TRUE(same_decisions(ref64.decisions, got.decisions));
        // Bit for bit the contiguous run of the same kernel family (paged permute_stop reads
        // pages on the portable kernel only).
        if (exact && !staged) {
          EXPECT_TRUE(same_result(got.out, want_one_pass[portable ? 1 : 0].out, 0.0));
          continue;
        }
        const int same = expected == contiguous_prefix[0] ? 0 : 1;
        EXPECT_EQ(expected, contiguous_prefix[same]);
        EXPECT_TRUE(same_result(got.out, want[same].out, 0.0));
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
    expect_paged_equals_contiguous(small, DenseParams{}, causal);
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
    p.mask = random_mask(shape, block_k, per_kv, 78, &dead);
    // K and V of the blocks no query head of a KV group selects are NaN in every sequence
    // (with per-KV-head masks: a third of the blocks), so reading a skipped page shows.
    Inputs dirty = in;
    int poisoned = 0;
    for (int b = 0; b < shape.batch; ++b) {
      const geom::BlockGeometry g =
          geometry(shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)], true, 128, block_k);
      for (int kvh = 0; kvh < in.h_kv; ++kvh) {
        for (int kb = 0; kb < g.num_k_blocks(); ++kb) {
          bool all_dead = true;
          const int group = in.h_q / in.h_kv;
          for (int h = 0; h < (per_kv ? 1 : group); ++h) {
            const auto& list = dead[static_cast<std::size_t>(per_kv ? kvh : kvh * group + h)];
            all_dead &= std::find(list.begin(), list.end(), kb) != list.end();
          }
          if (!all_dead) continue;
          poison_keys(&dirty, b, false, kvh, g.key_begin(kb), g.key_end(kb));
          poison_keys(&dirty, b, true, kvh, g.key_begin(kb), g.key_end(kb));
          ++poisoned;
        }
      }
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
    const HostTensor thr = midpoint_thresholds(in, true, 128, block_k, 0.4);
    expect_paged_equals_contiguous(in, gate_params(thr, block_k));
  }
}

TEST(CudaPaged, SoftmaxSkipEqualsContiguous) {
  SP_REQUIRE_GPU();
  Inputs in = make_inputs({{700, 1300}}, 4, 2, 64, 1604, DType::kBF16, 3.0);
  scale_hot_keys(&in, 64, 0.1);
  const TestProblem tp = make_problem(in, true, Layout::kVarlen);
  const double a = stable_parameter(tp, scale_factors(1300), [](double x) -> Policy { return skip_params(x, 64); },
                                    some_skipped(visible_blocks({{700, 1300}}, 4, true, 128, 64)));
  ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
  expect_paged_equals_contiguous(in, skip_params(a, 64));
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
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                          [&](double x) -> Policy { return select_params(x, corrected, corrected); },
                                          some_skipped(visible_blocks({{700, 900}, {1100, 1100}}, units, true, 128, 128)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    expect_paged_equals_contiguous(in, select_params(alpha, corrected, corrected));
  }
}

TEST(CudaPaged, PermuteStopEqualsContiguous) {
  SP_REQUIRE_GPU();
  // A cached prefix no segment of the call owns (read only through the ranked pass, gathered
  // through the table), and a prompt with several segments; GQA group 2.
  for (const SeqLen len : {SeqLen{300, 1500}, SeqLen{1023, 1023}}) {
    SCOPED_TRACE(std::to_string(len.s_q) + "x" + std::to_string(len.s_k));
    const Inputs in = permute_inputs({len}, 4, 2, 128, 1607);
    const double tau = stable_tau(make_problem(in), 256, 64);
    ASSERT_FALSE(std::isnan(tau)) << "no tau with a margin stops a tile early";
    expect_paged_equals_contiguous(in, permute_params(tau, 256, 64));
  }
}

// ------------------------------------------------------------------ chunked prefill

constexpr int kQueryBlock = 128;  // block_q of every policy on CUDA

// A prompt of `n` tokens prefilled in chunks of 512 and of 1024 queries, each chunk a paged
// call (pages of 16 keys) over the prefix so far plus itself, against the one-shot call, on
// both paths (the default one, asserted through the instance that ran: on an sm_90 device the
// Hopper kernel's paged instance for dense and 128-key blocks; and the portable kernel,
// forced): every chunk's decisions equal the one-shot oracle's rows exactly, and the chunks'
// outputs put together are within the calibrated tolerance of the one-shot oracle.
// `chunk_policy` gives the policy of the chunk ending at key c1 (softmax_skip rescales `a`:
// docs/cuda.md).
void expect_chunks_equal_one_shot(const Inputs& full, const Policy& policy,
                                  const std::function<Policy(std::int64_t)>& chunk_policy) {
  const std::int64_t n = full.s_q(0);
  const TestProblem one_shot = make_problem(full);
  const ref::Result ref64 = oracle(one_shot, policy);
  ref::Result lowp;
  const Status st = run_lowp_reference(one_shot.problem(), policy, ref64.decisions, &lowp);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const bool dense = std::holds_alternative<DenseParams>(policy);
  for (const auto& [chunk, portable] :
       std::initializer_list<std::pair<std::int64_t, bool>>{{512, false}, {512, true}, {1024, false}, {1024, true}}) {
    SCOPED_TRACE("chunks of " + std::to_string(chunk) + (portable ? ", portable path" : ", default path"));
    const PortableOnly guard(portable);
    ref::Result joined;
    joined.o.assign(ref64.o.size(), kNaN);
    joined.lse.assign(ref64.lse.size(), kNaN);
    std::size_t tiles_seen = 0;
    for (std::int64_t c0 = 0; c0 < n; c0 += chunk) {
      const std::int64_t c1 = std::min(n, c0 + chunk);
      SCOPED_TRACE("chunk [" + std::to_string(c0) + ", " + std::to_string(c1) + ")");
      TestProblem tp = paged_problem(chunk_of(full, c0, c1), 16);
      const Policy chunk_call = chunk_policy(c1);
      const GpuRun r = run_gpu(&tp, chunk_call);
      ASSERT_TRUE(r.status.ok()) << r.status.to_string();
      expect_instance(cuda::last_fwd_instance_for_testing(), expected_instance_prefix(tp, chunk_call, portable), true);
      const std::int64_t rows = c1 - c0, row_elems = static_cast<std::int64_t>(full.h_q) * full.d;
      std::copy(r.out.o.begin(), r.out.o.end(), joined.o.begin() + c0 * row_elems);
      for (int h = 0; h < full.h_q; ++h) {
        std::copy(r.out.lse.begin() + h * rows, r.out.lse.begin() + (h + 1) * rows, joined.lse.begin() + h * n + c0);
      }
      if (dense) continue;
      const Decisions& d = r.decisions;
      const int heads = d.kept.heads;
      for (int h = 0; h < heads; ++h) {
        for (int qb = 0; qb < d.kept.num_q_blocks; ++qb) {
          const int qb_full = static_cast<int>(c0 / kQueryBlock) + qb;
          EXPECT_EQ(kept_blocks(d.kept, 0, h, qb), kept_blocks(ref64.decisions.kept, 0, h, qb_full))
              << "head " << h << " query block " << qb_full;
          if (d.corrected.heads == 0) continue;
          EXPECT_EQ(kept_blocks(d.corrected, 0, h, qb), kept_blocks(ref64.decisions.corrected, 0, h, qb_full))
              << "corrected, head " << h << " query block " << qb_full;
        }
      }
      // permute_stop (chunks of whole segments): the chunk's tiles are the one-shot call's
      // tiles of the same (absolute) segments, and its query order is theirs shifted by c0.
      for (const PermuteTile& t : d.tiles) {
        const auto& all = ref64.decisions.tiles;
        const auto it = std::find_if(all.begin(), all.end(), [&](const PermuteTile& o) {
          return o.head == t.head && o.segment == t.segment && o.tile == t.tile;
        });
        ASSERT_NE(it, all.end()) << "head " << t.head << " segment " << t.segment << " tile " << t.tile;
        EXPECT_EQ(t.chunks_visited, it->chunks_visited) << "head " << t.head << " segment " << t.segment << " tile " << t.tile;
        EXPECT_EQ(t.chunks_total, it->chunks_total) << "head " << t.head << " segment " << t.segment << " tile " << t.tile;
      }
      tiles_seen += d.tiles.size();
      if (!d.query_order.empty()) {
        ASSERT_EQ(d.query_order.size(), static_cast<std::size_t>(full.h_q * rows));
        for (int h = 0; h < full.h_q; ++h) {
          for (std::int64_t i = 0; i < rows; ++i) {
            EXPECT_EQ(d.query_order[static_cast<std::size_t>(h * rows + i)] + c0,
                      ref64.decisions.query_order[static_cast<std::size_t>(h * n + c0 + i)])
                << "head " << h << " slot " << c0 + i;
          }
        }
      }
    }
    EXPECT_EQ(tiles_seen, ref64.decisions.tiles.size());
    EXPECT_TRUE(close_calibrated(full.dtype, joined, ref64, lowp));
  }
}

// The chunked test prompt: 4096 tokens with hot key chunks of 128 (shifted: estimate_select's
// means stand out) and cold ones scaled down (softmax_skip skips them).
Inputs chunk_prompt() {
  Inputs in = make_inputs({{4096, 4096}}, 2, 1, 64, 1700, DType::kBF16, 2.5);
  shift_hot_keys(&in, 128, 1.5);
  scale_hot_keys(&in, 128, 0.1);
  return in;
}

TEST(CudaChunked, DenseEqualsOneShot) {
  SP_REQUIRE_GPU();
  const Inputs in = chunk_prompt();
  expect_chunks_equal_one_shot(in, DenseParams{}, [](std::int64_t) -> Policy { return DenseParams{}; });
}

TEST(CudaChunked, ExactGateEqualsOneShot) {
  SP_REQUIRE_GPU();
  // Thresholds at absolute positions: every chunk reads the rows of its own query blocks.
  const Inputs in = chunk_prompt();
  const HostTensor thr = midpoint_thresholds(in, true, 128, 128, 0.4);
  const Policy gate = gate_params(thr, 128);
  expect_chunks_equal_one_shot(in, gate, [&](std::int64_t) { return gate; });
}

TEST(CudaChunked, SoftmaxSkipEqualsOneShot) {
  SP_REQUIRE_GPU();
  // λ = a / s_k of the call: a chunk ending at key c1 decides as the one-shot call with
  // a · c1 / n.
  const Inputs in = chunk_prompt();
  const std::int64_t n = in.s_k(0);
  const double a = stable_parameter(make_problem(in), scale_factors(n), [](double x) -> Policy { return skip_params(x, 128); },
                                    some_skipped(visible_blocks({{n, n}}, 2, true, 128, 128)));
  ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
  expect_chunks_equal_one_shot(in, skip_params(a, 128), [&](std::int64_t c1) -> Policy {
    return skip_params(a * static_cast<double>(c1) / static_cast<double>(n), 128);
  });
}

TEST(CudaChunked, EstimateSelectEqualsOneShot) {
  SP_REQUIRE_GPU();
  // tail = 0: the last `tail` query tiles of every call keep all their blocks, so with a tail
  // each chunk's last tiles would differ from the one-shot call (docs/cuda.md).
  const Inputs in = chunk_prompt();
  const std::int64_t n = in.s_k(0);
  for (bool corrected : {false, true}) {
    SCOPED_TRACE(corrected ? "mean correction" : "no correction");
    const auto make = [&](double alpha) -> Policy {
      EstimateSelectParams p = select_params(alpha, corrected, false);
      p.tail = 0;
      return p;
    };
    const double alpha = stable_parameter(make_problem(in), {0.3, 0.2, 0.5, 0.1}, make,
                                          some_skipped(visible_blocks({{n, n}}, 2, true, 128, 128)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const Policy p = make(alpha);
    expect_chunks_equal_one_shot(in, p, [&](std::int64_t) { return p; });
  }
}

TEST(CudaChunked, PermuteStopEqualsOneShot) {
  SP_REQUIRE_GPU();
  // Segments of 256 at absolute positions: chunks of 512 and 1024 hold whole segments, whose
  // ranked prefix is the cached part of the prompt, ranked as in the one-shot call.
  const Inputs in = permute_inputs({{2048, 2048}}, 2, 1, 64, 1701);
  const double tau = stable_tau(make_problem(in), 256, 64);
  ASSERT_FALSE(std::isnan(tau)) << "no tau with a margin stops a tile early";
  const Policy p = permute_params(tau, 256, 64);
  expect_chunks_equal_one_shot(in, p, [&](std::int64_t) { return p; });
}

// estimate_select's chunked-prefill inputs (docs/semantics.md §1): the tail counted over the
// prompt and the block means kept in a cache across the chunks.

TEST(CudaChunked, EstimateSelectWithCachedMeansAndPromptTailEqualsOneShot) {
  SP_REQUIRE_GPU();
  // The tail (1 tile) counted over the prompt and the means of complete blocks kept in a cache
  // across the chunks: every chunk decides exactly as the one-shot oracle's rows, the chunks'
  // outputs put together are within the calibrated tolerance of the one-shot call, and the
  // cache holds the recomputed means; contiguous (varlen) and paged K/V at 16 and 64 keys per
  // page, on both forward paths.
  const Inputs in = chunk_prompt();
  const std::int64_t n = in.s_k(0);
  for (bool corrected : {false, true}) {
    SCOPED_TRACE(corrected ? "mean correction" : "no correction");
    const auto make = [&](double alpha) -> Policy { return select_params(alpha, corrected, false); };
    const TestProblem one_shot = make_problem(in);
    const double alpha = stable_parameter(one_shot, {0.3, 0.2, 0.5, 0.1}, make,
                                          some_skipped(visible_blocks({{n, n}}, 2, true, 128, 128)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const EstimateSelectParams p = select_params(alpha, corrected, false);
    const ref::Result ref64 = oracle(one_shot, p);
    ref::Result lowp;
    const Status st = run_lowp_reference(one_shot.problem(), p, ref64.decisions, &lowp);
    ASSERT_TRUE(st.ok()) << st.to_string();
    for (int page : {0, 16, 64}) {
      LayoutOptions layout;
      layout.layout = page == 0 ? Layout::kVarlen : Layout::kPaged;
      layout.page_size = page == 0 ? 16 : page;
      layout.page_seed = 40 + static_cast<std::uint64_t>(page);
      const std::int64_t chunk = page == 16 ? 512 : 1024;
      for (bool portable : {false, true}) {
        SCOPED_TRACE(std::string(page == 0 ? "contiguous" : "paged " + std::to_string(page)) +
                     (portable ? ", portable path" : ", default path") + ", chunks of " + std::to_string(chunk));
        const PortableOnly guard(portable);
        MeansCache cache(in, 128, n / 128);
        const auto policy_for = [&](std::int64_t c0, std::int64_t) -> Policy {
          cache.advance(c0);
          return cache.attach(p);
        };
        const ChunkCall call = [](TestProblem* tp, const Policy& policy, ref::Result* out) {
          GpuRun r = run_gpu(tp, policy);
          out->o = std::move(r.out.o);
          out->lse = std::move(r.out.lse);
          out->decisions = std::move(r.decisions);
          return r.status;
        };
        ref::Result joined;
        EXPECT_TRUE(chunks_decide_as_one_shot(in, chunk, kQueryBlock, layout, policy_for, call, ref64.decisions, &joined));
        EXPECT_TRUE(close_calibrated(in.dtype, joined, ref64, lowp));
        expect_cache_holds_recomputed_means(in, cache, p);
      }
    }
  }
}

TEST(CudaEstimateSelect, CachedMeansVarlenAndPagedMatchOracle) {
  SP_REQUIRE_GPU();
  // Two chunks of different prompts in one call (varlen queries; 12 and 6 complete blocks),
  // with 8 and 3 leading blocks cached and NaN in every cache entry past them: the cached
  // entries are read, the NaN ones never, on both paths, contiguous and paged; the call
  // writes back the blocks it completes. Then the same call through the suite's harness.
  Inputs in = make_inputs({{512, 1536}, {200, 777}}, 4, 2, 64, 1750, DType::kBF16, 2.5);
  shift_hot_keys(&in, 128, 1.5);
  constexpr std::int64_t kMaxBlocks = 12;
  const std::int32_t kValid[2] = {8, 3};
  for (bool corrected : {false, true}) {
    for (int page : {0, 16, 64}) {
      SCOPED_TRACE(std::string(corrected ? "mean correction, pack_gqa, " : "per query head, ") +
                   (page == 0 ? "contiguous" : "paged " + std::to_string(page)));
      MeansCache cache(in, 128, kMaxBlocks);
      cache.prompt_len.as<std::int32_t>()[0] = 4096;
      cache.prompt_len.as<std::int32_t>()[1] = 1000;
      TestProblem tp = page == 0 ? make_problem(in, true, Layout::kVarlen) : paged_problem(in, page);
      // Fill the cache's complete blocks through the oracle (valid 0), then keep 8 and 3 and
      // set everything past them to NaN.
      oracle(tp, cache.attach(select_params(0.2, corrected, corrected)));
      const auto poison_past_valid = [&]() {
        for (int b = 0; b < 2; ++b) {
          cache.valid.as<std::int32_t>()[b] = kValid[b];
          for (int hk = 0; hk < in.h_kv; ++hk) {
            for (std::int64_t j = kValid[b]; j < kMaxBlocks; ++j) {
              for (int i = 0; i < in.d; ++i) {
                const std::int64_t at = ((b * in.h_kv + hk) * kMaxBlocks + j) * in.d + i;
                set(&cache.k, at, kNaN);
                set(&cache.v, at, kNaN);
              }
            }
          }
        }
      };
      poison_past_valid();
      const int units = corrected ? 2 : 4;
      // The trials write the blocks each call completes back into the cache (never read).
      const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                            [&](double x) -> Policy { return cache.attach(select_params(x, corrected, corrected)); },
                                            some_skipped(visible_blocks({{512, 1536}, {200, 777}}, units, true, 128, 128)));
      ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
      const EstimateSelectParams p = select_params(alpha, corrected, corrected);
      poison_past_valid();
      MeansCache oracle_cache = cache;
      const ref::Result ref64 = oracle(tp, oracle_cache.attach(p));
      ref::Result lowp;
      const Status st = run_lowp_reference(tp.problem(), p, ref64.decisions, &lowp);
      ASSERT_TRUE(st.ok()) << st.to_string();
      for (bool portable : {false, true}) {
        SCOPED_TRACE(portable ? "portable path" : "default path");
        const PortableOnly guard(portable);
        MeansCache gpu_cache = cache;  // NaN past the valid blocks
        const GpuRun r = run_gpu(&tp, gpu_cache.attach(p));
        ASSERT_TRUE(r.status.ok()) << r.status.to_string();
        EXPECT_TRUE(fully_written(r.out, ref64));
        EXPECT_TRUE(close_calibrated(in.dtype, r.out, ref64, lowp));
        EXPECT_TRUE(same_decisions(ref64.decisions, r.decisions));
        expect_cache_holds_recomputed_means(in, gpu_cache, p);
      }
      expect_both_paths_match(&tp, cache.attach(p));
    }
  }
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

  const Inputs odd = make_inputs({{64, 64}}, 2, 1, 96, 1401);
  TestProblem tp96 = make_problem(odd);
  const GpuRun d96 = run_gpu(&tp96, DenseParams{});
  EXPECT_EQ(d96.status.code(), StatusCode::kUnsupported);
  EXPECT_NE(d96.status.message().find("head_dim 96"), std::string::npos) << d96.status.message();

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

// CUDA graphs: after one warm-up call outside capture, a captured call records only device
// work (its metadata comes from the device-side cache), and replaying the graph on new
// contents of the same buffers equals a direct call on those contents, bit for bit.
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
  const HostTensor thr = midpoint_thresholds(first, true, 128, 128, 0.3);
  const Policy gate = gate_params(thr, 128);
  for (const Policy& policy :
       {Policy{DenseParams{}}, Policy{skip_params(40.0, 64)}, Policy{skip_params(40.0, 128)}, gate}) {
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

// ------------------------------------------------------------------ select() and plans

// select() on the device returns the GPU selector's mask: exactly the CPU backend's selection
// (inputs away from ties), with the same statistics.
TEST(CudaSelect, EstimateSelectEqualsCpuSelect) {
  SP_REQUIRE_GPU();
  for (const bool pack : {false, true}) {
    SCOPED_TRACE(pack ? "pack_gqa, corrected" : "per q head, corrected");
    Inputs in = make_inputs({{1300, 1300}}, 4, 1, 128, 1700, DType::kBF16, 2.5);
    shift_hot_keys(&in, 128, 1.5);
    TestProblem tp = make_problem(in);
    const int units = pack ? 1 : 4;
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                          [&](double x) -> Policy { return select_params(x, true, pack); },
                                          some_skipped(visible_blocks({{1300, 1300}}, units, true, 128, 128)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const Policy policy = select_params(alpha, true, pack);
    RunOptions cpu;
    cpu.backend = Backend::kCPU;
    Decisions expected, actual;
    RunStats cpu_stats, gpu_stats;
    ASSERT_TRUE(select(tp.problem(), policy, cpu, &expected, &cpu_stats).ok());
    DeviceBuffer q, k, v;
    AttentionProblem dev = tp.problem();
    dev.q = to_device(tp.q, &q);
    dev.k = to_device(tp.k, &k);
    dev.v = to_device(tp.v, &v);
    RunOptions gpu;
    gpu.backend = Backend::kCUDA;
    for (const bool portable : {false, true}) {  // the Hopper selector on an sm_90 device, and the portable one
      SCOPED_TRACE(portable ? "portable selector" : "default selector");
      const PortableOnly guard(portable);
      const Status st = select(dev, policy, gpu, &actual, &gpu_stats);
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_EQ(cuda::last_select_instance_for_testing().rfind(expected_selector_prefix(portable), 0), 0u)
          << cuda::last_select_instance_for_testing();
      EXPECT_TRUE(same_decisions(expected, actual));
      EXPECT_GT(actual.corrected.selected_blocks(), 0);
      EXPECT_EQ(gpu_stats.density(), cpu_stats.density());
      EXPECT_LT(gpu_stats.density(), 1.0);
    }
  }
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

  cudaGraph_t graph = nullptr;
  SP_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const Status captured = run(plan, dev, out, opt);
  SP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  ASSERT_TRUE(captured.ok()) << captured.to_string();
  const std::string want = expected_instance_prefix(tp, policy, false);
  EXPECT_EQ(cuda::last_fwd_instance_for_testing().rfind(want, 0), 0u) << "captured " << cuda::last_fwd_instance_for_testing();
  if (std::holds_alternative<ExactGateParams>(policy)) EXPECT_EQ(cuda::last_gate_passes_for_testing(), 2);
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

    TestProblem planned = *in;
    poison(&planned.o);
    poison(&planned.lse);
    SP_CUDA_CHECK(cudaMemcpy(o.ptr, planned.o.data(), o.bytes, cudaMemcpyHostToDevice));
    SP_CUDA_CHECK(cudaMemcpy(lse.ptr, planned.lse.data(), lse.bytes, cudaMemcpyHostToDevice));
    const Status st = run(plan, dev, out, opt);
    ASSERT_TRUE(st.ok()) << st.to_string();
    SP_CUDA_CHECK(cudaStreamSynchronize(stream));
    to_host(o, &planned.o);
    to_host(lse, &planned.lse);

    TestProblem direct = *in;
    const GpuRun r = run_gpu(&direct, policy);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    ref::Result ref64;
    EXPECT_TRUE(matches_reference(direct.problem(), policy, direct.output(), {}, &ref64));
    EXPECT_TRUE(fully_written(r.out, ref64));
    EXPECT_EQ(std::memcmp(planned.o.data(), direct.o.data(), direct.o.nbytes()), 0) << "run(plan) O differs from run()";
    EXPECT_EQ(std::memcmp(planned.lse.data(), direct.lse.data(), direct.lse.nbytes()), 0);
    EXPECT_EQ(std::memcmp(replayed.o.data(), direct.o.data(), direct.o.nbytes()), 0) << "replayed O differs";
    EXPECT_EQ(std::memcmp(replayed.lse.data(), direct.lse.data(), direct.lse.nbytes()), 0);
  }
  SP_CUDA_CHECK(cudaGraphExecDestroy(exec));
  SP_CUDA_CHECK(cudaGraphDestroy(graph));
  SP_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Plans on the device: run(plan) equals run() bit for bit, and a call made with the plan is
// captured into a CUDA graph with no warm-up call of its shape, replaying on new inputs as a
// direct call does. block_sparse: the plan holds the mask and the sequence table, and has
// cached the Hopper kernel's tensor maps of its tensors; exact_gate (two passes, on a varlen
// batch of three sequences): the plan has also cached the decision pass's gated-block sums per
// sequence (gate_seq_gated). block_k 128: the Hopper kernels on an sm_90 device.
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
      thr = midpoint_thresholds(first, true, 128, 128, 0.3);
      policy = gate_params(thr, 128);
    } else {
      std::vector<std::vector<int>> dead;
      BlockSparseParams bs;
      bs.mask = random_mask(shape, 128, false, 1803, &dead);
      policy = bs;
    }
    check_plan_capture(tp, tp2, policy);
  }
}

}  // namespace
}  // namespace sparseprefill::test
