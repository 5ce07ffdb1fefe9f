// SPDX-License-Identifier: Apache-2.0
// Backend conformance: every scenario runs on every target (targets.h: the oracle behind the
// public API, the CPU backend, the CUDA backend's portable and Hopper kernels, forced) and is
// checked against the fp64 oracle alike: outputs within the calibrated tolerance
// (tests/common/tolerance.h) and every element written (outputs poisoned first), decisions
// equal to the oracle's exactly (on inputs and parameters placed away from ties:
// stable_parameter), RunStats::execution naming the target's path; a call the target does not
// serve (docs/semantics.md, docs/cuda.md) is refused with kUnsupported and the reason.
// Scenarios: every policy with odd lengths, s_q != s_k, empty sequences, GQA groups, bf16/fp16
// (fp32 and fp8 where served), causal or not, on batched, varlen and paged K/V; NaN inputs, NaN
// K/V that a policy must not read; chunked prefill against the one-shot call; estimate_select's
// cache of block means; select() and plans; the model-family features (local windows, sinks,
// softcap, head dims 96 and 256, q/k 192 with v 128), which the CUDA targets refuse by name
// until their kernels take them (local windows: dense and block_sparse run there). Shapes are
// the CUDA kernels' (block_q 128, head_dim 64 or 128 but for those features) and small enough
// for the oracle (a few hundred tokens).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "common/cases.h"
#include "common/chunks.h"
#include "common/cuda_paths.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/poison.h"
#include "common/results.h"
#include "common/tolerance.h"
#include "conformance/targets.h"
#include "core/geometry.h"
#include "reference/reference.h"
#include "reference/row_sets.h"
#include "reference/sequence.h"
#include "sparseprefill/attention.h"
#include "sparseprefill/plan.h"

namespace sparseprefill::test {
namespace {

constexpr int kBlock = 128;  // block_q of every policy (the CUDA kernels'), and estimate_select's block

Inputs make_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                   DType dtype = DType::kBF16, double scale = 1.5) {
  return random_inputs(lengths, h_q, h_kv, d, dtype, seed, scale);
}

bool is_paged(const TestProblem& tp) { return tp.problem().block_table.defined(); }

// The model-family features of one scenario (docs/semantics.md §1): causal or not, FlashAttention's
// window (-1: no bound), softcap, sinks and the head dims of q/k and v.
struct Features {
  std::string name = "plain";
  // The sequences (s_q, s_k) of the scenario; policy_cases ignores them (its callers pass theirs).
  std::vector<SeqLen> lengths;
  bool causal = true;
  int left = -1, right = -1;
  double softcap = 0.0;
  std::vector<double> sinks;  // [h_q]; empty: none
  int d = 64;
  int d_v = 0;  // 0: d
  // Whether the policies can skip work here (parameters are then chosen to skip some). A window
  // no wider than a 128-key block leaves them nothing (exact_gate finds no full block to gate,
  // permute_stop's ranked keys fit in one chunk): only stable parameters are required.
  bool sparse = true;
  int chunk = 0;  // attention_chunk: 0 none

  static Features plain(bool causal) {
    Features f;
    f.causal = causal;
    return f;
  }
  LayoutOptions layout(Layout l = Layout::kBatched) const {
    LayoutOptions o;
    o.layout = l;
    o.causal = causal;
    o.window_left = left;
    o.window_right = right;
    o.attention_chunk = chunk;
    o.softcap = softcap;
    return o;
  }
  // in with v's head dim (new values from `seed` when it is not d) and the sinks.
  Inputs apply(Inputs in, std::uint64_t seed) const {
    if (d_v > 0 && d_v != in.d_v) {
      in.d_v = d_v;
      Random rng(seed);
      for (SequenceData& sd : in.seqs) {
        sd.v = HostTensor(in.dtype, {sd.k.shape()[0], in.h_kv, d_v});
        fill_random(&sd.v, rng.next(), 1.5);
      }
    }
    in.sinks = sinks;
    return in;
  }
};

TestProblem make_problem(const Inputs& in, const Features& f, Layout layout = Layout::kBatched) {
  return build_problem(in, f.layout(layout));
}

// Why CUDA refuses the features of tp under `policy` (a fragment of its message), "" when it
// takes them: local windows, softcap and sinks run dense and block_sparse only (softcap and sinks
// on 16-bit inputs); head dim 96 runs every policy (the portable kernels), 256 and q/k 192 with
// v 128 (MLA) every policy but permute_stop;
// other V head dims unlike Q/K's and head dims have no kernel yet (docs/cuda.md), and
// check_support names them before anything else.
std::string cuda_feature_refusal(const TestProblem& tp, const Policy& policy) {
  ProblemShape s;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  const bool featured_policy =
      std::holds_alternative<DenseParams>(policy) || std::holds_alternative<BlockSparseParams>(policy);
  const std::string others = std::string(" runs dense and block_sparse on CUDA, not ") + policy_name(policy);
  if (s.local() && !featured_policy) {
    return (s.attention_chunk > 0 ? "attention_chunk: chunked local attention"
                                  : "window_left/window_right: local (sliding-window) attention") + others;
  }
  if (s.softcap != 0.0 && !featured_policy) return "softcap: score soft-capping" + others;
  if (s.sinks && !featured_policy) return "sinks: learned attention sinks" + others;
  if ((s.softcap != 0.0 || s.sinks) && s.dtype == DType::kFP8E4M3) return "fp8_e4m3 inputs on CUDA take no softcap or sinks";
  // variants.py's WIDE_HEAD_DIMS, 16-bit: every policy but permute_stop
  const bool mla = s.d == 192 && s.d_v == 128 && s.dtype != DType::kFP8E4M3;
  const bool family = (s.d == 256 && s.d_v == s.d) || mla;
  if (s.d_v != s.d && !mla) return "v: a V head dim unlike Q/K's (d_v " + std::to_string(s.d_v) + ", d " + std::to_string(s.d) + ")";
  if (family && std::holds_alternative<PermuteStopParams>(policy) && s.dtype != DType::kFP8E4M3) {
    return "head_dim " + std::to_string(s.d) + (mla ? " (d_v 128)" : "") +
           " runs dense, block_sparse, exact_gate, softmax_skip and estimate_select on CUDA, not permute_stop";
  }
  if (s.d != 64 && s.d != 96 && s.d != 128 && !family) return "head_dim " + std::to_string(s.d);
  return {};
}

// Why `t` refuses (tp, policy), as a fragment of its kUnsupported message, or "" when it runs
// it: estimate_select and permute_stop are causal only (every backend); CUDA refuses the
// model-family features it has no kernel for, has no fp32 kernels and runs fp8 on the Hopper
// kernels only (every policy but permute_stop); cuda-hopper runs what the Hopper kernels serve.
std::string refusal(Target t, const TestProblem& tp, const Policy& policy) {
  const bool causal_only = std::holds_alternative<EstimateSelectParams>(policy) ||
                           std::holds_alternative<PermuteStopParams>(policy);
  if (!tp.causal && causal_only) return "causal";
  if (!is_cuda(t)) return {};
  const std::string feature = cuda_feature_refusal(tp, policy);
  if (!feature.empty()) return feature;
  if (tp.q.dtype() == DType::kFP32) return "fp32";
  // fp8: the policy rules of check_support first (both CUDA targets), then the path.
  if (tp.q.dtype() == DType::kFP8E4M3) {
    if (std::holds_alternative<PermuteStopParams>(policy)) {
      return "fp8_e4m3 inputs on CUDA run dense, block_sparse, exact_gate, softmax_skip and estimate_select";
    }
    const auto* eg = std::get_if<ExactGateParams>(&policy);
    const auto* skip = std::get_if<SoftmaxSkipParams>(&policy);
    if ((eg != nullptr && eg->block_k != 128) || (skip != nullptr && skip->block_k != 128)) {
      return "fp8_e4m3 inputs on CUDA need 128 x 128 blocks";
    }
  }
  if (tp.q.dtype() == DType::kFP8E4M3 && t == Target::kCudaPortable) return "fp8_e4m3 inputs run on the Hopper kernel only";
  // The suite reads pages in the kernels (target_options).
  const auto d = static_cast<int>(tp.q.shape().back()), d_v = static_cast<int>(tp.v.shape().back());
  if (t == Target::kCudaHopper && tp.q.dtype() != DType::kFP8E4M3 && !hopper_compiles(d, d_v, is_paged(tp))) {
    return "no Hopper instance is compiled for";  // the portable kernel's alone (variants.py)
  }
  if (t == Target::kCudaHopper && !hopper_serves(policy, is_paged(tp), d)) return "hopper";
  return {};
}

// The oracle's result and the low-precision reference under its decisions.
struct Oracle {
  ref::Result ref64;
  ref::Result lowp;
};
Oracle oracle_of(const TestProblem& tp, const Policy& policy) {
  Oracle o;
  o.ref64 = oracle(tp, policy);
  const Status st = run_lowp_reference(tp.problem(), policy, o.ref64.decisions, &o.lowp);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return o;
}

// Visible (query block, key block) pairs of a problem's sequences at 128-row blocks, per unit.
std::int64_t visible(const std::vector<SeqLen>& lengths, int units, bool causal, int bk) {
  return visible_blocks(lengths, units, causal, kBlock, bk);
}

// Threshold tables of exact_gate that outlive the policies viewing them (stable_parameter
// builds one per candidate).
class Tables {
 public:
  // [h_q, positions] filled with c.
  ExactGateParams constant(int h_q, int positions, double c, int bk) {
    tables_.emplace_back(DType::kFP32, std::vector<std::int64_t>{h_q, positions});
    for (std::int64_t i = 0; i < tables_.back().numel(); ++i) set(&tables_.back(), i, c);
    return gate_params(tables_.back(), kBlock, bk);
  }
  ExactGateParams keep(HostTensor table, int bk) {
    tables_.push_back(std::move(table));
    return gate_params(tables_.back(), kBlock, bk);
  }

 private:
  std::deque<HostTensor> tables_;
};

class Conformance : public ::testing::TestWithParam<Target> {
 protected:
  void SetUp() override {
    const std::string why = target_unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << target_path(GetParam()) << ": " << why;
  }
  Target target() const { return GetParam(); }

  // Runs (tp, policy) on the target and checks it against `want`, or that the target refuses
  // it (refusal). Returns the run; `refused` says which.
  TargetRun check(TestProblem* tp, const Policy& policy, const Oracle& want, bool* refused = nullptr) {
    TargetRun r = run_on(target(), tp, policy);
    const std::string why = refusal(target(), *tp, policy);
    if (refused != nullptr) *refused = !why.empty();
    if (!why.empty()) {
      EXPECT_EQ(r.status.code(), StatusCode::kUnsupported) << r.status.to_string();
      EXPECT_NE(r.status.message().find(why), std::string::npos) << "expected the reason \"" << why << "\", got "
                                                                 << r.status.message();
      return r;
    }
    EXPECT_TRUE(r.status.ok()) << r.status.to_string();
    if (!r.status.ok()) return r;
    EXPECT_EQ(r.stats.execution.path, target_path(target()));
    if (is_cuda(target())) {
      const std::string family = instance_family(target_path(target()), policy);
      EXPECT_EQ(r.stats.execution.instance.rfind(family, 0), 0u) << "ran " << r.stats.execution.instance << ", expected " << family << "*";
    }
    EXPECT_TRUE(fully_written(r.out, want.ref64));
    EXPECT_TRUE(close_calibrated(tp->q.dtype(), r.out, want.ref64, want.lowp));
    EXPECT_TRUE(same_decisions(want.ref64.decisions, r.decisions));
    return r;
  }
  // The same against the oracle of (tp, policy), computed unless every backend refuses it.
  TargetRun check(TestProblem* tp, const Policy& policy, bool* refused = nullptr) {
    const bool everywhere = !refusal(Target::kReference, *tp, policy).empty();
    return check(tp, policy, everywhere ? Oracle{} : oracle_of(*tp, policy), refused);
  }
};

// ------------------------------------------------------------------ dense

TEST_P(Conformance, DenseOddLengthsDtypesAndHeadDims) {
  int seed = 1;
  for (std::int64_t s : {1, 15, 17, 113, 257}) {
    for (DType dtype : {DType::kBF16, DType::kFP16, DType::kFP32}) {
      const int d = std::vector<int>{64, 96, 128, 256}[static_cast<std::size_t>(seed % 4)];
      SCOPED_TRACE("s = " + std::to_string(s) + " " + dtype_name(dtype) + " d = " + std::to_string(d));
      TestProblem tp = make_problem(make_inputs({{s, s}}, 4, 1, d, static_cast<std::uint64_t>(100 + seed++), dtype));
      check(&tp, DenseParams{});
    }
  }
}

TEST_P(Conformance, DenseGqaGroupsCausalAndNonCausal) {
  for (int h_kv : {8, 2, 1}) {  // groups 1, 4, 8
    for (bool causal : {true, false}) {
      SCOPED_TRACE("group " + std::to_string(8 / h_kv) + (causal ? " causal" : " non-causal"));
      TestProblem tp = make_problem(make_inputs({{200, 200}}, 8, h_kv, 64, 200 + static_cast<std::uint64_t>(h_kv)), causal);
      check(&tp, DenseParams{});
    }
  }
}

TEST_P(Conformance, DenseVarlenChunkedPrefillAndEmptySequences) {
  // s_q < s_k (a cached prefix, with an offset that is no multiple of 128), s_q > s_k (the
  // first s_q - s_k rows see no key: O = 0, LSE = -inf; whole 128-row blocks among them), a
  // single row, a sequence without keys and one without queries.
  const std::vector<SeqLen> lengths = {{1, 1}, {15, 40}, {17, 300}, {113, 113}, {300, 17}, {5, 0}, {0, 7}};
  for (bool causal : {true, false}) {
    for (DType dtype : {DType::kBF16, DType::kFP16}) {
      SCOPED_TRACE(std::string(causal ? "causal " : "non-causal ") + dtype_name(dtype));
      const Inputs in = make_inputs(lengths, 4, 2, 64, 300, dtype);
      TestProblem tp = make_problem(in, causal, Layout::kVarlen);
      const TargetRun r = check(&tp, DenseParams{});
      if (!r.status.ok()) continue;
      const std::int64_t rows = static_cast<std::int64_t>(r.out.lse.size()) / in.h_q;
      // Sequence {300, 17} causal: rows 0 .. 282 see no key; sequence {5, 0} none either way.
      const std::int64_t seq300 = 1 + 15 + 17 + 113, seq5 = seq300 + 300;
      for (int h = 0; h < in.h_q; ++h) {
        std::vector<std::int64_t> empty = {seq5, seq5 + 4};
        if (causal) empty.insert(empty.end(), {seq300, seq300 + 200, seq300 + 282});
        for (std::int64_t row : empty) {
          EXPECT_EQ(r.out.lse[static_cast<std::size_t>(h * rows + row)], -kInf) << "row " << row;
          EXPECT_EQ(r.out.o[static_cast<std::size_t>((row * in.h_q + h) * in.d)], 0.0) << "row " << row;
        }
        EXPECT_TRUE(std::isfinite(r.out.lse[static_cast<std::size_t>(h * rows + seq300 + 283)]));
      }
    }
  }
}

TEST_P(Conformance, DenseLocalWindowsOnEveryLayoutAndGroup) {
  // FlashAttention's window_size on dense attention: a causal window narrower than a key block
  // (both of a row's bounds inside one block) and one over two blocks, a non-causal window with
  // both bounds, and FlashAttention's causal as a non-causal (-1, 0); GQA groups 1 and 8 (the
  // Hopper kernel packs a group's heads into one tile for the short sequences); batched K/V,
  // and varlen and paged K/V with a chunk over a longer prefix, fewer keys than queries and a
  // single row. Under (-1, 0) the rows at negative positions see no key: O = 0, LSE = -inf.
  struct Window {
    bool causal;
    int left, right;
  };
  std::uint64_t seed = 4000;
  for (const Window& w : {Window{true, 5, -1}, Window{true, 300, -1}, Window{false, 70, 9}, Window{false, -1, 0}}) {
    Features f = Features::plain(w.causal);
    f.left = w.left;
    f.right = w.right;
    for (const int h_kv : {8, 1}) {
      SCOPED_TRACE(std::string(w.causal ? "causal" : "non-causal") + " window (" + std::to_string(w.left) + ", " +
                   std::to_string(w.right) + "), group " + std::to_string(8 / h_kv));
      TestProblem batched = make_problem(make_inputs({{257, 257}}, 8, h_kv, 64, seed++), f);
      check(&batched, DenseParams{});
      const Inputs in = make_inputs({{130, 600}, {200, 90}, {1, 1}}, 8, h_kv, 128, seed++);
      const Oracle want = oracle_of(make_problem(in, f, Layout::kVarlen), DenseParams{});
      for (const Layout layout : {Layout::kVarlen, Layout::kPaged}) {
        SCOPED_TRACE(layout == Layout::kVarlen ? "varlen" : "paged");
        TestProblem tp = make_problem(in, f, layout);
        const TargetRun r = check(&tp, DenseParams{}, want);
        if (!r.status.ok() || w.right != 0 || w.causal) continue;
        // Sequence {200, 90}: rows 0 .. 109 sit at negative positions; row 110 sees key 0.
        const std::int64_t rows = static_cast<std::int64_t>(r.out.lse.size()) / in.h_q;
        for (int h = 0; h < in.h_q; ++h) {
          for (const std::int64_t row : {130, 130 + 109}) {
            EXPECT_EQ(r.out.lse[static_cast<std::size_t>(h * rows + row)], -kInf) << "row " << row;
            EXPECT_EQ(r.out.o[static_cast<std::size_t>((row * in.h_q + h) * in.d)], 0.0) << "row " << row;
          }
          EXPECT_TRUE(std::isfinite(r.out.lse[static_cast<std::size_t>(h * rows + 130 + 110)]));
        }
      }
    }
  }
}

TEST_P(Conformance, DenseBatchedUnequalKeysNeverReadCapacity) {
  // Batched K/V [b, max s_k, h_kv, d] with seqused_k: the storage past each sequence's keys is
  // NaN (build_problem), so reading it would show in O.
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    TestProblem tp = make_problem(make_inputs({{130, 451}, {130, 129}, {130, 1}}, 4, 2, 64, 420), causal);
    check(&tp, DenseParams{});
  }
}

// ------------------------------------------------------------------ block_sparse

TEST_P(Conformance, BlockSparseRandomMasksWithNaNInUnselectedBlocks) {
  // Random masks over the visible blocks, 64- and 128-key blocks, per query head or per KV head
  // (GQA packing on the Hopper kernel where it pays), causal or not; and under local windows
  // (the window then cuts the visible blocks and their bands): a causal one over blocks of 64
  // and of 128 keys, one narrower than a 64-key block (both bounds in one block), a non-causal
  // one with both bounds, and FlashAttention's causal as a non-causal (-1, 0) over fewer keys
  // than queries (rows at negative positions see nothing).
  struct Case {
    SeqLen len;
    int h_q, h_kv, d, block_k;
    bool per_kv, causal;
    int left = -1, right = -1;
  };
  for (const Case& c : {Case{{300, 300}, 4, 1, 128, 64, false, true}, Case{{200, 450}, 8, 2, 64, 128, true, true},
                        Case{{333, 333}, 2, 2, 128, 128, false, false}, Case{{129, 600}, 4, 4, 64, 64, true, true},
                        Case{{260, 200}, 4, 2, 64, 128, true, false}, Case{{300, 700}, 4, 2, 64, 64, true, true, 200},
                        Case{{200, 450}, 8, 2, 128, 128, true, true, 130}, Case{{129, 600}, 4, 4, 64, 64, false, true, 40},
                        Case{{333, 333}, 2, 2, 128, 128, false, false, 100, 40},
                        Case{{260, 200}, 4, 2, 64, 128, true, false, -1, 0}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + " block_k " + std::to_string(c.block_k) +
                 (c.per_kv ? " per kv head" : " per q head") + (c.causal ? " causal" : " non-causal") + " window (" +
                 std::to_string(c.left) + ", " + std::to_string(c.right) + ")");
    Features f = Features::plain(c.causal);
    f.left = c.left;
    f.right = c.right;
    Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, c.d, 500 + static_cast<std::uint64_t>(c.len.s_k + c.left + 1));
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(make_problem(in, f).problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams p;
    p.mask = random_mask(shape, kBlock, c.block_k, c.per_kv, 77, &dead);
    const geom::BlockGeometry g = geometry(c.len.s_q, c.len.s_k, c.causal, kBlock, c.block_k, c.left, c.right);
    const int poisoned = poison_dead_blocks(&in, 0, g, c.per_kv, dead);
    if (c.per_kv) EXPECT_GT(poisoned, 0);  // per query head masks leave few blocks dead for a whole group
    TestProblem dirty = make_problem(in, f);
    check(&dirty, p);
  }
}

// ------------------------------------------------------------------ exact_gate

TEST_P(Conformance, ExactGateMidpointThresholdsCausalChunkedAndNonCausal) {
  struct Case {
    SeqLen len;
    bool causal;
    int h_q, h_kv, d, block_k;
    DType dtype;
  };
  for (const Case& c : {Case{{300, 300}, true, 4, 1, 64, 64, DType::kBF16}, Case{{130, 600}, true, 2, 2, 64, 128, DType::kFP16},
                        Case{{200, 300}, false, 4, 2, 128, 128, DType::kBF16}, Case{{257, 257}, true, 2, 1, 64, 128, DType::kBF16}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal") +
                 " block_k " + std::to_string(c.block_k));
    const Inputs in = make_inputs({c.len}, c.h_q, c.h_kv, c.d, 700 + static_cast<std::uint64_t>(c.len.s_q), c.dtype, 2.0);
    TestProblem tp = make_problem(in, c.causal);
    const HostTensor thr = midpoint_thresholds(in, c.causal, kBlock, c.block_k, 0.4);
    const Policy policy = gate_params(thr, kBlock, c.block_k);
    const Oracle want = oracle_of(tp, policy);
    EXPECT_LT(want.ref64.decisions.kept.selected_blocks(), visible({c.len}, c.h_q, c.causal, c.block_k))
        << "the thresholds should skip some blocks";
    check(&tp, policy, want);
  }
}

TEST_P(Conformance, ExactGateMinusInfinityKeepsEveryBlockAndEqualsDense) {
  const SeqLen len{300, 450};
  TestProblem tp = make_problem(make_inputs({len}, 4, 1, 64, 800));
  HostTensor thr(DType::kFP32, {4, 3});
  for (int i = 0; i < 12; ++i) thr.as<float>()[i] = -std::numeric_limits<float>::infinity();
  const Oracle dense = oracle_of(tp, DenseParams{});
  for (int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    const Policy gate = gate_params(thr, kBlock, block_k);
    const Oracle want = oracle_of(tp, gate);
    EXPECT_EQ(want.ref64.decisions.kept.selected_blocks(), visible({len}, 4, true, block_k));
    bool refused = false;
    const TargetRun r = check(&tp, gate, want, &refused);
    if (refused || !r.status.ok()) continue;
    EXPECT_TRUE(close_calibrated(DType::kBF16, r.out, dense.ref64, dense.lowp)) << "a kept-all gate is dense attention";
  }
}

// V of the blocks a policy skips for every query head is NaN in a second copy of the inputs:
// the target's run on it equals its run on the clean inputs bit for bit, with the same
// decisions. Heads h_q = h_kv, one query block over a long prefix: every skipped block is read
// by no other work of its KV head. Returns the number of poisoned blocks.
int expect_skipped_values_never_read(Target t, const Inputs& clean, const Policy& policy, const Decisions& kept,
                                     int block_k) {
  const geom::BlockGeometry g = geometry(clean.s_q(0), clean.s_k(0), true, kBlock, block_k);
  Inputs dirty_in = clean;
  int poisoned = 0;
  for (int h = 0; h < clean.h_q; ++h) {
    for (int kb = 0; kb < g.visible_end(0); ++kb) {
      if (kept.kept.contains(0, h, 0, kb)) continue;
      poison_keys(&dirty_in, 0, true, h, g.key_begin(kb), g.key_end(kb));
      ++poisoned;
    }
  }
  TestProblem a = make_problem(clean), b = make_problem(dirty_in);
  const TargetRun want = run_on(t, &a, policy), got = run_on(t, &b, policy);
  EXPECT_TRUE(want.status.ok() && got.status.ok()) << want.status.to_string() << " / " << got.status.to_string();
  EXPECT_TRUE(same_result(got.out, want.out, 0.0));
  EXPECT_TRUE(same_decisions(want.decisions, got.decisions));
  return poisoned;
}

TEST_P(Conformance, ExactGateNaNValuesOfSkippedBlocksAreNeverRead) {
  const SeqLen len{100, 700};
  const Inputs in = make_inputs({len}, 2, 2, 64, 900, DType::kBF16, 2.0);
  for (int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    const HostTensor thr = midpoint_thresholds(in, true, kBlock, block_k, 0.3);
    const Policy policy = gate_params(thr, kBlock, block_k);
    TestProblem tp = make_problem(in);
    bool refused = false;
    const TargetRun r = check(&tp, policy, &refused);
    if (refused || !r.status.ok()) continue;
    EXPECT_GT(expect_skipped_values_never_read(target(), in, policy, r.decisions, block_k), 0);
  }
}

// ------------------------------------------------------------------ softmax_skip

// Inputs whose cold key blocks (every block of `block_k` keys but each third, scaled by 0.1)
// score far below the hot ones for every row, so that softmax_skip skips them.
Inputs skip_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed, int block_k,
                   DType dtype = DType::kBF16) {
  Inputs in = make_inputs(lengths, h_q, h_kv, d, seed, dtype, 3.0);
  scale_hot_keys(&in, block_k, 0.1);
  return in;
}

TEST_P(Conformance, SoftmaxSkipStableScaleFactors) {
  struct Case {
    SeqLen len;
    bool causal;
    int h_q, h_kv, d, block_k;
  };
  for (const Case& c : {Case{{300, 300}, true, 4, 1, 64, 64}, Case{{130, 700}, true, 2, 2, 64, 128},
                        Case{{256, 256}, false, 4, 4, 64, 64}, Case{{256, 640}, true, 2, 1, 64, 128},
                        Case{{200, 500}, false, 4, 2, 64, 128}, Case{{400, 320}, true, 2, 1, 64, 64}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal") +
                 " block_k " + std::to_string(c.block_k));
    TestProblem tp = make_problem(skip_inputs({c.len}, c.h_q, c.h_kv, c.d, 1000 + static_cast<std::uint64_t>(c.len.s_k), c.block_k),
                                  c.causal);
    const double a = stable_parameter(tp, scale_factors(c.len.s_k),
                                      [&](double x) -> Policy { return skip_params(x, kBlock, c.block_k); },
                                      some_skipped(visible({c.len}, c.h_q, c.causal, c.block_k)));
    ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
    check(&tp, skip_params(a, kBlock, c.block_k));
  }
}

TEST_P(Conformance, SoftmaxSkipOffWhenContextShorterThanA) {
  TestProblem tp = make_problem(make_inputs({{300, 300}}, 2, 1, 64, 1100, DType::kBF16, 3.0));
  const Policy policy = skip_params(301.0, kBlock, 128);
  const Oracle want = oracle_of(tp, policy);
  EXPECT_EQ(want.ref64.decisions.kept.selected_blocks(), visible({{300, 300}}, 2, true, 128));
  check(&tp, policy, want);
}

TEST_P(Conformance, SoftmaxSkipNaNValuesOfSkippedBlocksAreNeverRead) {
  const SeqLen len{100, 700};
  for (int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    const Inputs in = skip_inputs({len}, 2, 2, 64, 1150, block_k);
    TestProblem tp = make_problem(in);
    const double a = stable_parameter(tp, scale_factors(len.s_k),
                                      [&](double x) -> Policy { return skip_params(x, kBlock, block_k); },
                                      some_skipped(visible({len}, 2, true, block_k)));
    ASSERT_FALSE(std::isnan(a));
    bool refused = false;
    const TargetRun r = check(&tp, skip_params(a, kBlock, block_k), &refused);
    if (refused || !r.status.ok()) continue;
    EXPECT_GT(expect_skipped_values_never_read(target(), in, skip_params(a, kBlock, block_k), r.decisions, block_k), 0);
  }
}

// ------------------------------------------------------------------ estimate_select

EstimateSelectParams select_params(double alpha, bool correction, bool pack, int window = 2) {
  EstimateSelectParams p = small_estimate_select(alpha, kBlock, correction, pack);
  p.window = window;
  return p;
}

// Inputs whose hot key blocks' means stand out, so that the energy rule prunes.
Inputs select_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                     DType dtype = DType::kBF16) {
  Inputs in = make_inputs(lengths, h_q, h_kv, d, seed, dtype, 2.5);
  shift_hot_keys(&in, kBlock, 1.5);
  return in;
}

TEST_P(Conformance, EstimateSelectStableAlpha) {
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv, d;
    bool correction, pack;
    int window;
    DType dtype;
  };
  // Queries over a longer cached prefix (with 128-key blocks the forced sink, window and tail
  // leave a short one-shot prompt little to prune), window 0 (not even the diagonal forced),
  // GQA groups 1 to 4, varlen.
  for (const Case& c : {Case{{{256, 1024}}, 2, 1, 64, true, false, 1, DType::kBF16},
                        Case{{{200, 900}}, 4, 1, 64, true, true, 2, DType::kBF16},
                        Case{{{384, 896}}, 4, 2, 64, false, true, 2, DType::kFP16},
                        Case{{{500, 640}}, 2, 2, 64, true, false, 0, DType::kBF16},
                        Case{{{300, 700}, {256, 1024}}, 2, 1, 64, true, false, 2, DType::kFP16}}) {
    SCOPED_TRACE(std::to_string(c.lens.size()) + " sequence(s), first " + std::to_string(c.lens[0].s_q) + "x" +
                 std::to_string(c.lens[0].s_k) + " d " + std::to_string(c.d) + (c.correction ? " corrected" : "") +
                 (c.pack ? " pack_gqa" : "") + " window " + std::to_string(c.window));
    TestProblem tp = make_problem(select_inputs(c.lens, c.h_q, c.h_kv, c.d, 1000 + static_cast<std::uint64_t>(c.lens[0].s_k), c.dtype),
                                  true, c.lens.size() > 1 ? Layout::kVarlen : Layout::kBatched);
    const auto params = [&c](double alpha) { return select_params(alpha, c.correction, c.pack, c.window); };
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1, 0.05, 0.7}, [&](double x) -> Policy { return params(x); },
                                          some_skipped(visible(c.lens, c.pack ? c.h_kv : c.h_q, true, kBlock)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const Oracle want = oracle_of(tp, params(alpha));
    if (c.correction) EXPECT_GT(want.ref64.decisions.corrected.selected_blocks(), 0);
    check(&tp, params(alpha), want);
  }
}

TEST_P(Conformance, EstimateSelectMeanCorrectionOfConstantBlocksEqualsDense) {
  // When every key block holds n copies of one token, its pseudo-token (k̄, v̄, weight n) is
  // exactly that block: with mean correction, estimate_select equals dense attention whatever
  // it prunes. Flat attention (small inputs) puts much of the mass in the pruned blocks.
  for (std::int64_t s_k : {1300}) {  // the last block holds 20 keys: its weight is 20
    SCOPED_TRACE("s_k = " + std::to_string(s_k));
    Inputs in = make_inputs({{130, s_k}}, 2, 1, 64, 63, DType::kBF16, 0.7);
    SequenceData& sd = in.seqs[0];
    for (std::int64_t pos = 0; pos < s_k; ++pos) {
      const std::int64_t src = pos / kBlock * kBlock;
      for (int i = 0; i < in.h_kv * in.d; ++i) {
        set(&sd.k, pos * in.h_kv * in.d + i, get(sd.k, src * in.h_kv * in.d + i));
        set(&sd.v, pos * in.h_kv * in.d + i, get(sd.v, src * in.h_kv * in.d + i));
      }
    }
    TestProblem tp = make_problem(in);
    // Energies of 128-row tiles over constant blocks barely differ: alpha near 1 prunes.
    const double alpha = stable_parameter(tp, {0.99, 0.98, 0.995, 0.95}, [](double x) -> Policy {
      return select_params(x, true, false, 1);
    }, [](const Decisions& d) { return d.corrected.selected_blocks() > 4; });
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin corrects enough blocks";
    const Policy policy = select_params(alpha, true, false, 1);
    const Oracle want = oracle_of(tp, policy);
    const TargetRun r = check(&tp, policy, want);
    if (!r.status.ok()) continue;
    const Oracle dense = oracle_of(tp, DenseParams{});
    EXPECT_TRUE(close_calibrated(DType::kBF16, r.out, dense.ref64, dense.lowp));
  }
}

// ------------------------------------------------------------------ permute_stop

// A tau whose oracle decisions are stable (kMargin) and satisfy `useful` (default: some tile
// stops early, some visits two chunks or more).
double stable_tau(const TestProblem& tp, int segment, int block_k,
                  const std::function<bool(const Decisions&)>& useful = stops_early) {
  return stable_parameter(tp, {0.05, 0.1, 0.02, 0.2, 0.03, 0.01, 0.3},
                          [&](double x) -> Policy { return permute_params(x, segment, kBlock, block_k); }, useful);
}

TEST_P(Conformance, PermuteStopStableTau) {
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv, d;
    DType dtype;
    int segment, block_k;
  };
  // GQA groups 4, 8 and 1; odd lengths; s_q < s_k (a cached prefix no segment of the call owns)
  // and s_q > s_k (rows at negative positions); segments that are and are not multiples of the
  // 128-row tile; varlen with short and empty sequences.
  for (const Case& c : {Case{{{384, 640}}, 2, 1, 64, DType::kBF16, 256, 128},
                        Case{{{385, 385}}, 2, 1, 64, DType::kFP16, 320, 64},
                        Case{{{256, 700}}, 2, 2, 64, DType::kBF16, 384, 64},
                        Case{{{300, 800}}, 2, 1, 64, DType::kBF16, 200, 128},
                        Case{{{1, 1}, {15, 40}, {300, 17}, {400, 600}, {113, 113}, {5, 0}}, 2, 1, 64, DType::kBF16, 128, 64}}) {
    SCOPED_TRACE(std::to_string(c.lens.size()) + " sequence(s), first " + std::to_string(c.lens[0].s_q) + "x" +
                 std::to_string(c.lens[0].s_k) + " group " + std::to_string(c.h_q / c.h_kv) + " segment " +
                 std::to_string(c.segment) + " block_k " + std::to_string(c.block_k));
    TestProblem tp = make_problem(permute_inputs(c.lens, c.h_q, c.h_kv, c.d, 1700 + static_cast<std::uint64_t>(c.lens[0].s_k), c.dtype),
                                  true, c.lens.size() > 1 ? Layout::kVarlen : Layout::kBatched);
    const double tau = stable_tau(tp, c.segment, c.block_k);
    ASSERT_FALSE(std::isnan(tau)) << "no tau with a margin stops a tile early";
    check(&tp, permute_params(tau, c.segment, kBlock, c.block_k));
  }
}

TEST_P(Conformance, PermuteStopTauZeroVisitsEverythingAndEqualsDense) {
  TestProblem tp = make_problem(make_inputs({{400, 400}}, 4, 2, 64, 1900));
  const Policy policy = permute_params(0.0, 256, kBlock, 128);
  const Oracle want = oracle_of(tp, policy);
  for (const PermuteTile& t : want.ref64.decisions.tiles) EXPECT_EQ(t.chunks_visited, t.chunks_total);
  const TargetRun r = check(&tp, policy, want);
  if (!r.status.ok()) return;
  const Oracle dense = oracle_of(tp, DenseParams{});
  EXPECT_TRUE(close_calibrated(DType::kBF16, r.out, dense.ref64, dense.lowp));
}

// Keys of a cached prefix that no segment of the call owns are read only through pass 2: the
// ones that no tile of any query head of their KV group visits get NaN values (V does not
// move the decisions), and the output must not see them.
TEST_P(Conformance, PermuteStopNaNValuesOfUnvisitedChunksAreNeverRead) {
  const SeqLen len{200, 1500};
  const int segment = 256;
  for (const int block_k : {64, 128}) {
    SCOPED_TRACE("block_k " + std::to_string(block_k));
    Inputs in = permute_inputs({len}, 2, 1, 64, 2000);
    // Every tile stops before the end of its ranked prefix, so that keys stay unvisited.
    const double tau = stable_tau(make_problem(in), segment, block_k, [](const Decisions& d) {
      bool several = false;
      for (const PermuteTile& t : d.tiles) {
        if (t.chunks_visited == t.chunks_total) return false;
        several |= t.chunks_visited >= 2;
      }
      return several;
    });
    ASSERT_FALSE(std::isnan(tau));
    const PermuteStopParams params = permute_params(tau, segment, kBlock, block_k);
    const Decisions before = oracle_decisions(make_problem(in), params);
    // The ranked keys each tile visited: its rows' keys past their own segment.
    const std::int64_t own_begin = (len.s_k - len.s_q) / segment * segment;
    std::vector<std::vector<bool>> read(static_cast<std::size_t>(in.h_kv), std::vector<bool>(static_cast<std::size_t>(own_begin)));
    ProblemShape shape;
    const TestProblem clean = make_problem(in);
    ASSERT_TRUE(validate_problem(clean.problem(), nullptr, &shape).ok());
    ref::RowSets sets;
    const ref::Sequence seq = ref::gather_sequence(clean.problem(), shape, 0);
    sets.init(seq, shape, params, before);
    ref::RowAttention row;
    for (int h = 0; h < in.h_q; ++h) {
      for (std::int64_t r = 0; r < len.s_q; ++r) {
        sets.row(h, r, &row);
        for (const std::int64_t key : row.keys) {
          if (key < own_begin) read[static_cast<std::size_t>(h / (in.h_q / in.h_kv))][static_cast<std::size_t>(key)] = true;
        }
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
    TestProblem dirty = make_problem(in);
    const Oracle want = oracle_of(dirty, params);
    EXPECT_TRUE(same_decisions(before, want.ref64.decisions));
    check(&dirty, params, want);
  }
}

// ------------------------------------------------------------------ every policy, every layout

// One call of a policy kind: its inputs (with the structure its rule needs) and parameters
// stable on them that skip some work.
struct PolicyCase {
  std::string name;
  Inputs in;
  Policy policy;
};

// One case per policy kind over `lengths` (estimate_select twice: mean correction per query
// head, and pack_gqa), block_k 128, inputs from `seed` with the features `f` (head dims, window,
// softcap, sinks; parameters chosen on the call they make); `edit` changes the inputs before the
// parameters are chosen (on the varlen layout). Non-causal, estimate_select and permute_stop
// take any parameters: every backend refuses them. `tables` keeps exact_gate's thresholds.
std::vector<PolicyCase> policy_cases(const std::vector<SeqLen>& lengths, int h_q, int h_kv, const Features& f,
                                     std::uint64_t seed, Tables* tables,
                                     const std::function<void(Inputs*)>& edit = [](Inputs*) {}) {
  std::int64_t max_k = 0;
  for (const SeqLen& l : lengths) max_k = std::max(max_k, l.s_k);
  const bool causal = f.causal;
  const auto prepared = [&](Inputs in) {
    in = f.apply(std::move(in), seed + 17);
    edit(&in);
    return in;
  };
  const auto varlen = [&f](const Inputs& in) { return make_problem(in, f, Layout::kVarlen); };
  const auto skipping = [&](int units, int bk) -> std::function<bool(const Decisions&)> {
    if (!f.sparse) return [](const Decisions&) { return true; };
    return some_skipped(visible_blocks(lengths, units, causal, kBlock, bk, f.left, f.right, f.chunk));
  };
  std::vector<PolicyCase> out;
  out.push_back({"dense", prepared(make_inputs(lengths, h_q, h_kv, f.d, seed)), DenseParams{}});
  {
    const Inputs in = prepared(make_inputs(lengths, h_q, h_kv, f.d, seed + 1));
    ProblemShape shape;
    EXPECT_TRUE(validate_problem(varlen(in).problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams mask;
    mask.mask = random_mask(shape, kBlock, 128, true, seed, &dead);
    out.push_back({"block_sparse", in, mask});
  }
  {
    const Inputs in = prepared(make_inputs(lengths, h_q, h_kv, f.d, seed + 2, DType::kBF16, 2.0));
    const TestProblem tp = varlen(in);
    const int positions = static_cast<int>(geom::ceil_div(max_k, kBlock)) + 1;
    std::vector<double> candidates = gate_candidates(tp, kBlock, 128);
    if (!f.sparse) candidates.push_back(0.0);  // nothing may be gated at all
    const double t = stable_parameter(tp, candidates,
                                      [&](double c) -> Policy { return tables->constant(h_q, positions, c, 128); },
                                      skipping(h_q, 128));
    EXPECT_FALSE(std::isnan(t)) << "no threshold with a margin skips anything";
    out.push_back({"exact_gate", in, tables->constant(h_q, positions, t, 128)});
  }
  {
    const Inputs in = prepared(skip_inputs(lengths, h_q, h_kv, f.d, seed + 3, 128));
    const double a = stable_parameter(varlen(in), scale_factors(max_k),
                                      [&](double x) -> Policy { return skip_params(x, kBlock, 128); },
                                      skipping(h_q, 128));
    EXPECT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
    out.push_back({"softmax_skip", in, skip_params(a, kBlock, 128)});
  }
  for (const bool pack : {false, true}) {
    const Inputs in = prepared(select_inputs(lengths, h_q, h_kv, f.d, seed + 4));
    double alpha = 0.3;
    if (causal) {
      alpha = stable_parameter(varlen(in), {0.3, 0.2, 0.5, 0.1, 0.7},
                               [&](double x) -> Policy { return select_params(x, !pack, pack, 1); },
                               skipping(pack ? h_kv : h_q, kBlock));
      EXPECT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    }
    out.push_back({pack ? "estimate_select, pack_gqa" : "estimate_select, mean correction", in,
                   select_params(alpha, !pack, pack, 1)});
  }
  {
    const Inputs in = prepared(permute_inputs(lengths, h_q, h_kv, f.d, seed + 5));
    const double tau = !causal ? 0.05
                       : f.sparse ? stable_tau(varlen(in), 128, 128)
                                  : stable_tau(varlen(in), 128, 128, [](const Decisions&) { return true; });
    EXPECT_FALSE(std::isnan(tau)) << "no tau with a margin stops a tile early";
    out.push_back({"permute_stop", in, permute_params(tau, 128, kBlock, 128)});
  }
  return out;
}

const char* layout_name(Layout layout) {
  return layout == Layout::kBatched ? "batched" : layout == Layout::kVarlen ? "varlen" : "paged";
}

TEST_P(Conformance, EveryPolicyOnBatchedVarlenAndPagedKv) {
  // Three sequences of 130 queries (batched q needs equal s_q; two query blocks, the second of
  // two rows) over 520, 700 and 40 keys (the last: rows at negative positions), GQA group 2;
  // causal on batched, varlen and paged K/V, non-causal on varlen. The oracle's result does not
  // depend on the layout: one oracle run serves them.
  const std::vector<SeqLen> lengths = {{130, 520}, {130, 700}, {130, 40}};
  for (const bool causal : {true, false}) {
    Tables tables;
    for (const PolicyCase& c : policy_cases(lengths, 2, 1, Features::plain(causal), 2100, &tables)) {
      SCOPED_TRACE(c.name + (causal ? ", causal" : ", non-causal"));
      const TestProblem reference = make_problem(c.in, causal, Layout::kVarlen);
      const bool everywhere_refused = !refusal(Target::kReference, reference, c.policy).empty();
      const Oracle want = everywhere_refused ? Oracle{} : oracle_of(reference, c.policy);
      // Non-causal attention reads K/V as causal does (every row the whole sequence): varlen only.
      const std::vector<Layout> layouts =
          causal ? std::vector<Layout>{Layout::kBatched, Layout::kVarlen, Layout::kPaged} : std::vector<Layout>{Layout::kVarlen};
      for (const Layout layout : layouts) {
        SCOPED_TRACE(layout_name(layout));
        TestProblem tp = make_problem(c.in, causal, layout);
        check(&tp, c.policy, want);
      }
    }
  }
}

TEST_P(Conformance, EveryPolicyWithNaNInputs) {
  // A NaN key (position 300, KV head 0) and a NaN query element (row 40 of head 3): NaN reaches
  // exactly the rows that read them, every decision rule states what its comparison does with
  // NaN, and nothing crashes. Decisions exactly the oracle's, outputs NaN where the oracle's are.
  const std::vector<SeqLen> lengths = {{130, 700}};
  const auto add_nan = [](Inputs* in) {
    set(&in->seqs[0].k, (300 * in->h_kv + 0) * in->d + 5, kNaN);
    set(&in->seqs[0].q, (40 * in->h_q + 3) * in->d + 1, kNaN);
  };
  Tables tables;
  for (const PolicyCase& c : policy_cases(lengths, 4, 2, Features::plain(true), 2200, &tables, add_nan)) {
    SCOPED_TRACE(c.name);
    TestProblem tp = make_problem(c.in);
    const TargetRun r = check(&tp, c.policy);
    if (!r.status.ok()) continue;
    // Head 3 reads KV head 1: its rows other than 40 meet no NaN; row 40 is NaN.
    EXPECT_TRUE(std::isnan(r.out.lse[static_cast<std::size_t>(3 * 130 + 40)]));
    EXPECT_TRUE(std::isfinite(r.out.lse[static_cast<std::size_t>(3 * 130 + 41)]));
  }
}

// ------------------------------------------------------------------ model-family features

// The feature sets of the model families the library serves (docs/semantics.md §1), each on
// every policy: local layers (a causal window narrower than a block, and one over two blocks),
// a non-causal window, Gemma 2's softcap (3 here, so that it bites: these inputs' block maxima
// reach about 6), gpt-oss's sinks with its 128-token window, and the head dims of Phi-3 (96),
// Gemma 3 (256, alone and with a softcap), MLA prefill (q/k 192, v 128) and Llama 4's chunked
// local attention (alone, with a window, non-causal). The host targets match the oracle; CUDA runs what it has kernels for and refuses the rest by name.
// Sequences: a chunk of 200 queries over a cached prefix (900 keys under a window, so that it cuts
// the prefix; 640 otherwise, enough for estimate_select's first tile to have blocks beyond the
// forced ones) and 130 queries over 40 keys (rows at negative positions); the non-causal window
// also 300 over 300 (its right bound cuts the early rows).
std::vector<Features> model_features() {
  const std::vector<SeqLen> windowed = {{200, 900}, {130, 40}}, plain = {{200, 640}, {130, 40}};
  // name, sequences, causal, window (left, right), softcap, sinks, d, d_v, sparse, chunk
  return {
      {"causal window 96", windowed, true, 95, -1, 0.0, {}, 64, 0, false},
      {"causal window 300, right bound 5 (causal keeps it at 0)", windowed, true, 299, 5},
      {"non-causal window (300, 150)", {{200, 900}, {130, 40}, {300, 300}}, false, 300, 150},
      {"sinks and window 128 (gpt-oss)", windowed, true, 127, -1, 0.0, {0.5, 2.0}, 64, 0, false},
      {"softcap 3", plain, true, -1, -1, 3.0},
      {"head_dim 256 and softcap 4 (Gemma 3 global layers, Gemma 2's cap)", plain, true, -1, -1, 4.0, {}, 256},
      {"head_dim 256 (Gemma 3)", plain, true, -1, -1, 0.0, {}, 256},
      {"head_dim 96 (Phi-3)", plain, true, -1, -1, 0.0, {}, 96},
      {"q/k head_dim 192, v head_dim 128 (MLA prefill)", plain, true, -1, -1, 0.0, {}, 192, 128},
      // Chunks of 300 positions (Llama 4's local layers take 8192; as narrow a range as the windows
      // above, so not sparse): rows of a query block on both
      // sides of a chunk boundary, a chunk boundary inside a key block, a cached prefix; with
      // a window inside the chunk, and non-causal (the chunk's later keys too).
      {"chunks of 300 (Llama 4)", windowed, true, -1, -1, 0.0, {}, 64, 0, false, 300},
      {"chunks of 300 and window 100", windowed, true, 99, -1, 0.0, {}, 64, 0, false, 300},
      {"non-causal chunks of 200", {{200, 900}, {130, 40}, {300, 300}}, false, -1, -1, 0.0, {}, 64, 0, false, 200},
  };
}

TEST_P(Conformance, ModelFamilyFeaturesOnEveryPolicy) {
  // Each feature set on its sequences (model_features), GQA group 2, varlen K/V (and paged for
  // the first set).
  std::uint64_t seed = 3100;
  for (const Features& f : model_features()) {
    SCOPED_TRACE(f.name);
    Tables tables;
    for (const PolicyCase& c : policy_cases(f.lengths, 2, 1, f, seed, &tables)) {
      SCOPED_TRACE(c.name);
      const TestProblem reference = make_problem(c.in, f, Layout::kVarlen);
      const bool everywhere_refused = !refusal(Target::kReference, reference, c.policy).empty();
      const Oracle want = everywhere_refused ? Oracle{} : oracle_of(reference, c.policy);
      for (const Layout layout : seed == 3100 ? std::vector<Layout>{Layout::kVarlen, Layout::kPaged}
                                              : std::vector<Layout>{Layout::kVarlen}) {
        SCOPED_TRACE(layout_name(layout));
        TestProblem tp = make_problem(c.in, f, layout);
        check(&tp, c.policy, want);
      }
    }
    seed += 100;
  }
}

TEST_P(Conformance, NaNAndInfiniteSinksMakeTheirHeadNaNAlone) {
  // Sinks NaN, +inf and 1.0 over three query heads: the first two heads are NaN in every row
  // (O and LSE), the third matches the oracle; dense and estimate_select (sinks move no decision).
  const std::vector<SeqLen> lengths = {{130, 300}};
  Inputs in = select_inputs(lengths, 3, 1, 64, 3300);
  in.sinks = {kNaN, kInf, 1.0};
  TestProblem tp = make_problem(in);
  for (const Policy& policy : {Policy{DenseParams{}}, Policy{select_params(0.3, true, false)}}) {
    SCOPED_TRACE(policy_name(policy));
    const TargetRun r = check(&tp, policy);
    if (!r.status.ok()) continue;
    for (std::int64_t row = 0; row < 130; ++row) {
      for (int h = 0; h < 3; ++h) {
        EXPECT_EQ(std::isnan(r.out.lse[static_cast<std::size_t>(h * 130 + row)]), h < 2) << "head " << h << " row " << row;
        EXPECT_EQ(std::isnan(r.out.o[static_cast<std::size_t>((row * 3 + h) * 64)]), h < 2) << "head " << h << " row " << row;
      }
    }
  }
}

// ------------------------------------------------------------------ chunked prefill

// One chunk call on the target for chunks_decide_as_one_shot, its path checked.
ChunkCall chunk_call(Target t) {
  return [t](TestProblem* tp, const Policy& policy, ref::Result* out) {
    TargetRun r = run_on(t, tp, policy);
    if (r.status.ok()) EXPECT_EQ(r.stats.execution.path, target_path(t));
    out->o = std::move(r.out.o);
    out->lse = std::move(r.out.lse);
    out->decisions = std::move(r.decisions);
    return r.status;
  };
}

// Whether the target refuses the chunks of `full` under `layout` (checked on the first chunk,
// whose refusal is then expected); the chunked checks stop there.
bool chunks_refused(Target t, const Inputs& full, std::int64_t chunk, const LayoutOptions& layout, const Policy& policy) {
  TestProblem first = build_problem(chunk_of(full, 0, chunk), layout);
  const std::string why = refusal(t, first, policy);
  if (why.empty()) return false;
  const TargetRun r = run_on(t, &first, policy);
  EXPECT_EQ(r.status.code(), StatusCode::kUnsupported) << r.status.to_string();
  EXPECT_NE(r.status.message().find(why), std::string::npos) << r.status.message();
  return true;
}

// Prefills `full` in chunks over the prefix so far plus themselves on the target: 256 queries
// on paged K/V (pages of 16 keys) and 384 on contiguous (varlen) K/V. Every chunk's decisions
// equal the one-shot oracle's rows (chunks_decide_as_one_shot), and the chunks' outputs put
// together are within the calibrated tolerance of the one-shot oracle. policy_for(c1) is the
// policy of the chunk ending at key c1.
void expect_chunks_equal_one_shot(Target t, const Inputs& full, const Policy& one_shot_policy,
                                  const std::function<Policy(std::int64_t)>& policy_for) {
  const Oracle want = oracle_of(make_problem(full), one_shot_policy);
  for (const std::int64_t chunk : {256, 384}) {
    LayoutOptions layout;
    layout.layout = chunk == 256 ? Layout::kPaged : Layout::kVarlen;
    SCOPED_TRACE("chunks of " + std::to_string(chunk) + (chunk == 256 ? ", paged" : ", contiguous"));
    if (chunks_refused(t, full, chunk, layout, policy_for(chunk))) continue;
    ref::Result joined;
    EXPECT_TRUE(chunks_decide_as_one_shot(full, chunk, kBlock, layout,
                                          [&](std::int64_t, std::int64_t c1) { return policy_for(c1); }, chunk_call(t),
                                          want.ref64.decisions, &joined));
    EXPECT_TRUE(close_calibrated(full.dtype, joined, want.ref64, want.lowp));
  }
}

TEST_P(Conformance, ChunkedPrefillDecidesAsOneShot) {
  // A prompt of 640 tokens (5 blocks), GQA group 2, for each policy on inputs with the
  // structure its rule needs: dense; exact_gate, its thresholds at absolute positions;
  // softmax_skip, whose λ = a / s_k uses the call's s_k: a chunk ending at key c1 decides as the
  // one-shot call with a · c1 / n; estimate_select with tail = 0 (without prompt_len the tail
  // counts each call's tiles), with mean correction or without; permute_stop with segments of
  // 128 (the chunks hold whole segments).
  constexpr std::int64_t n = 640;
  const std::vector<SeqLen> lengths = {{n, n}};
  Tables tables;
  std::vector<PolicyCase> cases;
  for (PolicyCase& c : policy_cases(lengths, 2, 1, Features::plain(true), 2300, &tables)) {
    if (std::holds_alternative<BlockSparseParams>(c.policy)) continue;  // the mask is the caller's: nothing to decide
    if (auto* es = std::get_if<EstimateSelectParams>(&c.policy)) {
      es->tail = 0;
      const TestProblem tp = make_problem(c.in);
      const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1}, [&](double x) -> Policy {
        EstimateSelectParams p = *es;
        p.alpha = x;
        return p;
      }, some_skipped(visible(lengths, es->pack_gqa ? 1 : 2, true, kBlock)));
      ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
      es->alpha = alpha;
    }
    if (auto* eg = std::get_if<ExactGateParams>(&c.policy)) {
      // Per (head, absolute query block) thresholds, each read by the chunk that holds its rows.
      *eg = tables.keep(midpoint_thresholds(c.in, true, kBlock, 128, 0.4), 128);
    }
    cases.push_back(std::move(c));
  }
  for (const PolicyCase& c : cases) {
    SCOPED_TRACE(c.name);
    expect_chunks_equal_one_shot(target(), c.in, c.policy, [&](std::int64_t c1) -> Policy {
      if (const auto* s = std::get_if<SoftmaxSkipParams>(&c.policy)) {
        return skip_params(s->a * static_cast<double>(c1) / static_cast<double>(n), kBlock, 128);
      }
      return c.policy;
    });
  }
}

TEST_P(Conformance, WindowedChunkedPrefillDecidesAsOneShot) {
  // A local window is relative to absolute positions, so chunks of a prompt decide (and attend)
  // as the one-shot call, as without a window (§1): a 640-token prompt with a window of 200
  // keys, dense, exact_gate (thresholds per absolute query block) and estimate_select with
  // tail = 0.
  constexpr std::int64_t n = 640;
  Features f;
  f.left = 199;
  const Inputs gate_in = make_inputs({{n, n}}, 2, 1, 64, 3400, DType::kBF16, 2.0);
  const Inputs select_in = select_inputs({{n, n}}, 2, 1, 64, 3401);
  Tables tables;
  LayoutOptions gate_opt = f.layout();
  const Policy gate = tables.keep(midpoint_thresholds(gate_in, gate_opt, kBlock, 128, 0.4), 128);
  EstimateSelectParams es = select_params(0.3, true, false);
  es.tail = 0;
  const double alpha = stable_parameter(make_problem(select_in, f), {0.3, 0.2, 0.5, 0.1}, [&](double x) -> Policy {
    EstimateSelectParams p = es;
    p.alpha = x;
    return p;
  }, some_skipped(visible_blocks({{n, n}}, 2, true, kBlock, kBlock, f.left)));
  ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
  es.alpha = alpha;
  struct Case {
    const char* name;
    const Inputs* in;
    Policy policy;
  };
  for (const Case& c : {Case{"dense", &gate_in, DenseParams{}}, Case{"exact_gate", &gate_in, gate},
                        Case{"estimate_select", &select_in, es}}) {
    SCOPED_TRACE(c.name);
    const Oracle want = oracle_of(make_problem(*c.in, f), c.policy);
    LayoutOptions layout = f.layout(Layout::kVarlen);
    if (chunks_refused(target(), *c.in, 256, layout, c.policy)) continue;
    ref::Result joined;
    EXPECT_TRUE(chunks_decide_as_one_shot(*c.in, 256, kBlock, layout, [&](std::int64_t, std::int64_t) { return c.policy; },
                                          chunk_call(target()), want.ref64.decisions, &joined));
    EXPECT_TRUE(close_calibrated(c.in->dtype, joined, want.ref64, want.lowp));
  }
}

TEST_P(Conformance, EstimateSelectChunksWithCachedMeansAndPromptTailDecideAsOneShot) {
  // estimate_select given prompt_len (the tail, 1 tile, counted over the prompt) and the cache
  // of block means kept across the chunks: every chunk decides as the one-shot oracle's rows,
  // the chunks' outputs together match the one-shot call, and the cache holds the recomputed
  // means (NaN past them: never written); contiguous (varlen) and paged K/V, with mean
  // correction and pack_gqa or without.
  const Inputs in = select_inputs({{768, 768}}, 2, 1, 64, 2300);
  const std::int64_t n = in.s_k(0);
  const TestProblem one_shot = make_problem(in);
  for (const bool corrected : {false, true}) {
    SCOPED_TRACE(corrected ? "mean correction, pack_gqa" : "per query head");
    const auto make = [corrected](double alpha) -> Policy { return select_params(alpha, corrected, corrected); };
    const double alpha = stable_parameter(one_shot, {0.3, 0.2, 0.5, 0.1}, make,
                                          some_skipped(visible({{n, n}}, corrected ? 1 : 2, true, kBlock)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const EstimateSelectParams p = select_params(alpha, corrected, corrected);
    const Oracle want = oracle_of(one_shot, p);
    for (const int page : {0, 16}) {
      LayoutOptions layout;
      layout.layout = page == 0 ? Layout::kVarlen : Layout::kPaged;
      layout.page_size = page == 0 ? 16 : page;
      const std::int64_t chunk = page == 0 ? 256 : 384;
      SCOPED_TRACE((page == 0 ? std::string("contiguous") : "paged " + std::to_string(page)) + ", chunks of " +
                   std::to_string(chunk));
      MeansCache cache(in, kBlock, n / kBlock);
      const auto policy_for = [&](std::int64_t c0, std::int64_t) -> Policy {
        cache.advance(c0);
        return cache.attach(p);
      };
      ref::Result joined;
      EXPECT_TRUE(
          chunks_decide_as_one_shot(in, chunk, kBlock, layout, policy_for, chunk_call(target()), want.ref64.decisions, &joined));
      EXPECT_TRUE(close_calibrated(in.dtype, joined, want.ref64, want.lowp));
      expect_cache_holds_recomputed_means(in, cache, p);
    }
  }
}

// Two chunks of different prompts in one varlen call (6 and 4 complete blocks) with 4 and 2
// leading blocks cached and NaN in every cache entry past them, prompts of 1280 and 900: the
// cached entries are read, the NaN ones never, contiguous and paged; the call writes back the
// blocks it completes, and only those.
TEST_P(Conformance, EstimateSelectCachedMeansVarlenAndPaged) {
  const std::vector<SeqLen> lengths = {{256, 768}, {200, 600}};
  const Inputs in = select_inputs(lengths, 2, 1, 64, 2400);
  constexpr std::int64_t kMaxBlocks = 8;
  const std::int32_t kValid[2] = {4, 2};
  for (const bool corrected : {false, true}) {
    for (const int page : {0, 16}) {
      SCOPED_TRACE(std::string(corrected ? "mean correction, pack_gqa, " : "per query head, ") +
                   (page == 0 ? "contiguous" : "paged " + std::to_string(page)));
      MeansCache cache(in, kBlock, kMaxBlocks);
      cache.prompt_len.as<std::int32_t>()[0] = 1280;
      cache.prompt_len.as<std::int32_t>()[1] = 900;
      LayoutOptions layout;
      layout.layout = page == 0 ? Layout::kVarlen : Layout::kPaged;
      layout.page_size = page == 0 ? 16 : page;
      TestProblem tp = build_problem(in, layout);
      // The cache's complete blocks filled through the oracle (valid 0), then 4 and 2 kept and
      // everything past them set to NaN.
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
      // The trials write the blocks each call completes back into the cache (never read).
      const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                            [&](double x) -> Policy { return cache.attach(select_params(x, corrected, corrected)); },
                                            some_skipped(visible(lengths, corrected ? 1 : 2, true, kBlock)));
      ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
      const EstimateSelectParams p = select_params(alpha, corrected, corrected);
      poison_past_valid();
      MeansCache oracle_cache = cache;
      const Oracle want = oracle_of(tp, oracle_cache.attach(p));
      MeansCache target_cache = cache;  // NaN past the valid blocks
      check(&tp, target_cache.attach(p), want);
      expect_cache_holds_recomputed_means(in, target_cache, p);
    }
  }
}

TEST_P(Conformance, EstimateSelectNaNInACachedMeanIsReadWhereUsed) {
  // The chunk [384, 768) of a prompt with 3 valid cached blocks: a NaN in cached k̄ of block 1
  // (KV head 0) makes the energies of every tile of that KV head's queries NaN, leaving their
  // forced blocks only; the heads of KV head 1 decide as with a clean cache. The target decides
  // exactly as the oracle.
  const Inputs full = select_inputs({{768, 768}}, 4, 2, 64, 2500);
  MeansCache clean(full, kBlock, 6);
  {
    TestProblem first = make_problem(chunk_of(full, 0, 384));
    oracle(first, clean.attach(select_params(0.2, false, false, 1)));  // fills blocks 0 .. 2
    clean.advance(384);
  }
  MeansCache dirty = clean;
  for (int i = 0; i < full.d; ++i) set(&dirty.k, (0 * full.h_kv * 6 + 1) * full.d + i, kNaN);
  TestProblem tp = make_problem(chunk_of(full, 384, 768));
  // The calls write blocks 3 .. 5 into the caches; the NaN entry (block 1 < valid) stays.
  MeansCache clean_copy = clean, oracle_cache = dirty, target_cache = dirty;
  const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                        [&](double x) -> Policy { return clean_copy.attach(select_params(x, false, false, 1)); },
                                        some_skipped(visible({{384, 768}}, 4, true, kBlock)));
  ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
  const EstimateSelectParams p = select_params(alpha, false, false, 1);
  const Decisions without = oracle_decisions(tp, clean_copy.attach(p));
  const Oracle want = oracle_of(tp, oracle_cache.attach(p));
  for (int h = 0; h < 4; ++h) {
    for (int qb = 0; qb < 2; ++qb) {  // absolute blocks 3 and 4; block 5 is the prompt's tail tile
      const std::vector<int> got = kept_blocks(want.ref64.decisions.kept, 0, h, qb);
      if (h < 2) {
        EXPECT_EQ(got, (std::vector<int>{0, 3 + qb})) << "head " << h << ": the sink and the diagonal only";
      } else {
        EXPECT_EQ(got, kept_blocks(without.kept, 0, h, qb)) << "head " << h << " reads the clean KV head 1";
      }
    }
  }
  EXPECT_FALSE(same_decisions(without, want.ref64.decisions));
  check(&tp, target_cache.attach(p), want);
}

TEST_P(Conformance, SelectRecomputesTheMeansFromTheValidCount) {
  // select() writes what run() writes: the means of blocks valid .. s_k / B - 1 and nothing
  // else (the blocks below valid keep what the caller put there: NaN here); one query row per
  // sequence is enough.
  const Inputs full = select_inputs({{768, 768}, {768, 768}}, 4, 2, 64, 2600);
  const TestProblem whole = make_problem(full);
  const EstimateSelectParams p = select_params(0.2, true, false);
  MeansCache cache(full, kBlock, 6);
  cache.valid.as<std::int32_t>()[0] = 0;
  cache.valid.as<std::int32_t>()[1] = 4;  // blocks 0 .. 3 stay as given
  TestProblem one_row = make_problem(chunk_of(full, 767, 768));
  Decisions d;
  const Status st = select_on(target(), &one_row, cache.attach(p), &d, nullptr);
  ASSERT_TRUE(st.ok()) << st.to_string();
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(whole.problem(), nullptr, &shape).ok());
  for (int b = 0; b < 2; ++b) {
    const ref::BlockMeans want = ref::block_means(ref::gather_sequence(whole.problem(), shape, b), p, 0);
    for (int hk = 0; hk < full.h_kv; ++hk) {
      for (int j = 0; j < 6; ++j) {
        for (int i = 0; i < full.d; ++i) {
          const std::int64_t at = ((b * full.h_kv + hk) * 6 + j) * full.d + i;
          if (b == 1 && j < 4) {
            ASSERT_TRUE(std::isnan(get(cache.k, at))) << "block " << j << " below the valid count was written";
          } else {
            ASSERT_EQ(get(cache.k, at), want.k_mean(j, hk)[i]) << "b " << b << " block " << j;
            ASSERT_EQ(get(cache.v, at), want.v_mean(j, hk)[i]) << "b " << b << " block " << j;
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------ select() and plans

TEST_P(Conformance, SelectEqualsTheOraclesDecisions) {
  // select() returns the decisions run() makes: exactly the oracle's, with the statistics
  // run() reports; per query head and with pack_gqa, with mean correction.
  const std::vector<SeqLen> lengths = {{640, 640}, {300, 500}};
  TestProblem tp = make_problem(select_inputs(lengths, 4, 1, 128, 2700), true, Layout::kVarlen);
  for (const bool pack : {false, true}) {
    SCOPED_TRACE(pack ? "pack_gqa" : "per query head");
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1},
                                          [&](double x) -> Policy { return select_params(x, true, pack); },
                                          some_skipped(visible(lengths, pack ? 1 : 4, true, kBlock)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    const Policy policy = select_params(alpha, true, pack);
    const Decisions want = oracle_decisions(tp, policy);
    Decisions selected;
    RunStats select_stats;
    const Status st = select_on(target(), &tp, policy, &selected, &select_stats);
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(same_decisions(want, selected));
    EXPECT_GT(selected.corrected.selected_blocks(), 0);
    const TargetRun r = run_on(target(), &tp, policy);
    ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(select_stats.density(), r.stats.density());
    EXPECT_LT(select_stats.density(), 1.0);
  }
}

TEST_P(Conformance, PlanRunsAsRunOnEveryPolicyAndLayout) {
  // A plan made once runs calls of its shape as run() does, bit for bit (O, LSE, decisions,
  // statistics), on new inputs too (it holds no data), and says which path it runs; batched and
  // paged (the latter with varlen q).
  const std::vector<SeqLen> lengths = {{130, 400}, {130, 200}};
  Tables tables;
  for (const PolicyCase& c : policy_cases(lengths, 2, 1, Features::plain(true), 2800, &tables)) {
    Inputs second = make_inputs(lengths, 2, 1, 64, 2900, DType::kBF16, 2.5);
    for (const Layout layout : {Layout::kBatched, Layout::kPaged}) {
      SCOPED_TRACE(c.name + ", " + layout_name(layout));
      TestProblem a = make_problem(c.in, true, layout), b = make_problem(second, true, layout);
      const auto placed = place(target(), &a, c.policy);  // the plan's policy tensors live as long as the plan
      Plan plan;
      const Status made = make_plan(placed->problem(), placed->policy(), target_options(target()), &plan);
      const std::string why = refusal(target(), a, c.policy);
      if (!why.empty()) {
        EXPECT_EQ(made.code(), StatusCode::kUnsupported) << made.to_string();
        EXPECT_NE(made.message().find(why), std::string::npos) << made.message();
        continue;
      }
      ASSERT_TRUE(made.ok()) << made.to_string();
      EXPECT_EQ(plan.execution().path, target_path(target()));
      for (TestProblem* in : {&a, &b}) {
        TestProblem direct = *in, planned = *in;
        const TargetRun d = run_on(target(), &direct, c.policy);
        const TargetRun p = run_plan_on(target(), plan, &planned);
        ASSERT_TRUE(d.status.ok() && p.status.ok()) << d.status.to_string() << " / " << p.status.to_string();
        EXPECT_TRUE(fully_written(p.out, d.out));
        EXPECT_TRUE(same_result(p.out, d.out, 0.0));
        EXPECT_TRUE(same_decisions(d.decisions, p.decisions));
        EXPECT_EQ(p.stats.density(), d.stats.density());
        EXPECT_EQ(p.stats.execution.path, target_path(target()));
      }
    }
  }
}

// ------------------------------------------------------------------ fp8

// Descales [batch, h_kv] that are not powers of two and differ per (batch, KV head); q's are
// q_gain times 0.3 + 0.05 i (the scores' temperature scales with q_gain).
void set_fp8_descales(TestProblem* tp, int batch, int h_kv, double q_gain = 1.0) {
  tp->q_descale = HostTensor(DType::kFP32, {batch, h_kv});
  tp->k_descale = HostTensor(DType::kFP32, {batch, h_kv});
  tp->v_descale = HostTensor(DType::kFP32, {batch, h_kv});
  for (int i = 0; i < batch * h_kv; ++i) {
    set(&tp->q_descale, i, q_gain * (0.3 + 0.05 * i));
    set(&tp->k_descale, i, 0.7 - 0.03 * i);
    set(&tp->v_descale, i, 1.3 + 0.11 * (i % 5));
  }
}

// FP8 (e4m3) inputs with per-(batch, KV head) descales that are not powers of two, bf16 output:
// dense and 128 x 128 block masks against the oracle on the dequantized values, within the
// calibrated tolerance (its low-precision reference rounds P to e4m3 as the kernels do);
// batched and causal, varlen and non-causal, GQA groups 2, key counts that are not multiples of
// 128 and a sequence without keys; a causal local window over a chunk; chunked attention (chunks
// of 300 across query and key blocks, rows at negative positions). A descale of the wrong
// head fails it. Head dims 128 and 256 (batched causal, varlen non-causal), the Hopper kernel's
// fp8 instances; the portable kernels refuse fp8.
TEST_P(Conformance, Fp8DenseAndBlockSparse) {
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv;
    bool causal;
    Layout layout;
    int left = -1;
    int chunk = 0;
    int d = 128;
  };
  for (const Case& c : {Case{{{300, 300}}, 2, 1, true, Layout::kBatched},
                        Case{{{200, 450}, {129, 40}, {5, 0}}, 4, 2, false, Layout::kVarlen},
                        Case{{{200, 700}}, 2, 1, true, Layout::kVarlen, 150},
                        Case{{{200, 700}, {130, 40}}, 4, 2, true, Layout::kVarlen, -1, 300},
                        Case{{{300, 300}}, 2, 1, true, Layout::kBatched, -1, 0, 256},
                        Case{{{200, 450}, {129, 40}, {5, 0}}, 4, 2, false, Layout::kVarlen, -1, 0, 256}}) {
    SCOPED_TRACE(std::to_string(c.lens.size()) + " sequence(s), h_q " + std::to_string(c.h_q) + ", h_kv " +
                 std::to_string(c.h_kv) + (c.causal ? ", causal" : ", non-causal") + ", window_left " +
                 std::to_string(c.left) + ", chunk " + std::to_string(c.chunk) + ", d " + std::to_string(c.d));
    const Inputs in = random_inputs(c.lens, c.h_q, c.h_kv, c.d, DType::kFP8E4M3,
                                    900 + c.h_q + std::max(c.left, 0) + c.chunk + c.d, 3.0);
    Features f = Features::plain(c.causal);
    f.left = c.left;
    f.chunk = c.chunk;
    TestProblem tp = make_problem(in, f, c.layout);
    set_fp8_descales(&tp, static_cast<int>(c.lens.size()), c.h_kv);
    ProblemShape shape;
    ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
    std::vector<std::vector<int>> dead;
    BlockSparseParams mask;
    mask.mask = random_mask(shape, kBlock, 128, false, 31, &dead);
    for (const Policy& policy : {Policy{DenseParams{}}, Policy{mask}}) {
      SCOPED_TRACE(policy_name(policy));
      check(&tp, policy);
    }
  }
}

// FP8 exact_gate and softmax_skip (on CUDA in one pass, the gates in the fp8 instance's loop)
// against the oracle on the dequantized values: decisions exactly (thresholds at midpoints of the
// dequantized block maxima, no maximum within 0.01 of one; a skip factor with a margin), O within
// the fp8 tolerance; causal and not, GQA, head dims 128 and 256, descales per KV head that are not
// powers of two (a gate comparing raw e4m3 scores, or a running max off by the kernel's 2^7
// offset, decides otherwise).
TEST_P(Conformance, Fp8ExactGateAndSoftmaxSkip) {
  struct Case {
    SeqLen len;
    bool causal;
    int h_q, h_kv, d;
  };
  for (const Case& c : {Case{{300, 700}, true, 4, 2, 128}, Case{{256, 520}, false, 2, 1, 128},
                        Case{{200, 600}, true, 2, 1, 256}}) {
    SCOPED_TRACE(std::to_string(c.len.s_q) + "x" + std::to_string(c.len.s_k) + (c.causal ? " causal" : " non-causal") +
                 ", d " + std::to_string(c.d));
    TestProblem tp = make_problem(
        random_inputs({c.len}, c.h_q, c.h_kv, c.d, DType::kFP8E4M3, 1400 + static_cast<std::uint64_t>(c.d + c.len.s_k), 3.0),
        c.causal);
    set_fp8_descales(&tp, 1, c.h_kv);
    LayoutOptions opt;
    opt.causal = c.causal;
    const HostTensor thr = midpoint_thresholds(tp, opt, kBlock, 128, 0.4);
    const Policy gate = gate_params(thr, kBlock, 128);
    const Oracle want = oracle_of(tp, gate);
    EXPECT_LT(want.ref64.decisions.kept.selected_blocks(), visible({c.len}, c.h_q, c.causal, 128))
        << "the thresholds should skip some blocks";
    check(&tp, gate, want);

    TestProblem sk = make_problem(
        skip_inputs({c.len}, c.h_q, c.h_kv, c.d, 1500 + static_cast<std::uint64_t>(c.d), 128, DType::kFP8E4M3), c.causal);
    set_fp8_descales(&sk, 1, c.h_kv, 4.0);  // at q · k descales near 0.2 no cold block falls far enough below
    const double a = stable_parameter(sk, scale_factors(c.len.s_k),
                                      [&](double x) -> Policy { return skip_params(x, kBlock, 128); },
                                      some_skipped(visible({c.len}, c.h_q, c.causal, 128)));
    ASSERT_FALSE(std::isnan(a)) << "no scale factor with a margin skips anything";
    check(&sk, skip_params(a, kBlock, 128));
  }
}

// FP8 estimate_select against the oracle on the dequantized values (bf16 means of k · k_descale
// and v · v_descale, scores of q · q_descale): decisions exactly at an alpha with a margin, O
// within the fp8 tolerance; per head and pack_gqa, GQA groups 2, varlen, a chunk over a cached
// prefix (s_k > s_q), a last block of 4 keys; mean correction (on CUDA the Hopper kernel's mean
// tiles over the means requantized to e4m3, which the low-precision reference models), varlen
// with pack_gqa and a sequence whose last block is short among its corrected ones; head dim 256
// with and without it (the fp8 d 256 selector and forward instance). The descales
// differ per (batch, KV head): one read for the wrong pair moves the scores' temperature or O
// (q's 4x those of the dense cases: at q · k descales near 0.2 every block's energy is within
// alpha of the peak and nothing prunes), and a mean requantized with the wrong one moves O.
TEST_P(Conformance, Fp8EstimateSelect) {
  struct Case {
    std::vector<SeqLen> lens;
    int h_q, h_kv;
    bool pack, correction;
    int window;
    Layout layout;
    int d = 128;
  };
  for (const Case& c : {Case{{{256, 1024}}, 2, 1, false, false, 1, Layout::kBatched},
                        Case{{{384, 900}, {200, 1028}}, 4, 2, true, false, 2, Layout::kVarlen},
                        Case{{{300, 896}}, 4, 2, false, true, 1, Layout::kBatched},
                        Case{{{384, 900}, {200, 1028}}, 4, 2, true, true, 1, Layout::kVarlen},
                        Case{{{256, 1024}}, 2, 1, false, false, 1, Layout::kBatched, 256},
                        Case{{{300, 896}}, 4, 2, false, true, 1, Layout::kBatched, 256}}) {
    SCOPED_TRACE(std::to_string(c.lens.size()) + " sequence(s), first " + std::to_string(c.lens[0].s_q) + "x" +
                 std::to_string(c.lens[0].s_k) + (c.pack ? " pack_gqa" : "") + (c.correction ? " corrected" : "") +
                 ", d " + std::to_string(c.d));
    TestProblem tp = make_problem(select_inputs(c.lens, c.h_q, c.h_kv, c.d,
                                                1300 + static_cast<std::uint64_t>(c.h_q + (c.d == 128 ? 0 : c.d)), DType::kFP8E4M3),
                                  true, c.layout);
    set_fp8_descales(&tp, static_cast<int>(c.lens.size()), c.h_kv, 4.0);
    const auto params = [&c](double alpha) { return select_params(alpha, c.correction, c.pack, c.window); };
    const double alpha = stable_parameter(tp, {0.3, 0.2, 0.5, 0.1, 0.05, 0.7}, [&](double x) -> Policy { return params(x); },
                                          some_skipped(visible(c.lens, c.pack ? c.h_kv : c.h_q, true, kBlock)));
    ASSERT_FALSE(std::isnan(alpha)) << "no alpha with a margin prunes anything";
    check(&tp, params(alpha), oracle_of(tp, params(alpha)));
  }
}

INSTANTIATE_TEST_SUITE_P(Host, Conformance, ::testing::Values(Target::kReference, Target::kCpu), target_param_name);
INSTANTIATE_TEST_SUITE_P(Cuda, Conformance, ::testing::Values(Target::kCudaPortable, Target::kCudaHopper),
                         target_param_name);

}  // namespace
}  // namespace sparseprefill::test
