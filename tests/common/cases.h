// SPDX-License-Identifier: Apache-2.0
// Helpers the backend test suites (CPU backend, CUDA) share for building cases and choosing
// policy parameters away from ties. Header-only; nvcc and g++ both compile it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "common/decisions.h"
#include "common/inputs.h"
#include "core/geometry.h"
#include "reference/reference.h"
#include "sparseprefill/attention.h"

namespace sparseprefill::test {

// A parameter is used only if the oracle's decisions do not move when it is scaled by
// 1 ± kMargin: no observed ratio, gain or maximum lies within that band of the threshold, far
// beyond the fp32-vs-fp64 differences of the backends' scores (~1e-6 relative).
constexpr double kMargin = 1e-3;

inline ref::Result oracle(const TestProblem& tp, const Policy& policy) {
  ref::Result r;
  const Status st = ref::run_reference(tp.problem(), policy, &r);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return r;
}

inline TestProblem make_problem(const Inputs& in, bool causal = true, Layout layout = Layout::kBatched) {
  LayoutOptions opt;
  opt.layout = layout;
  opt.causal = causal;
  return build_problem(in, opt);
}

inline geom::BlockGeometry geometry(std::int64_t s_q, std::int64_t s_k, bool causal, int bq, int bk) {
  geom::BlockGeometry g;
  g.seq = {s_q, s_k, causal};
  g.block_q = bq;
  g.block_k = bk;
  return g;
}

// Causally visible (query block, key block) pairs of every sequence, times `heads`.
inline std::int64_t visible_blocks(const std::vector<SeqLen>& lengths, int heads, bool causal, int bq, int bk) {
  std::int64_t n = 0;
  for (const SeqLen& l : lengths) {
    const geom::BlockGeometry g = geometry(l.s_q, l.s_k, causal, bq, bk);
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) n += g.visible_end(qb);
  }
  return n * heads;
}

// Decisions that keep some blocks and skip some of `visible`.
inline std::function<bool(const Decisions&)> some_skipped(std::int64_t visible) {
  return [visible](const Decisions& d) {
    const std::int64_t kept = d.kept.selected_blocks();
    return kept > 0 && kept < visible;
  };
}

// estimate_select with one-block sink, window and tail: small forced sets, so that small test
// problems still leave blocks for the energy rule to decide.
inline EstimateSelectParams small_estimate_select(double alpha, int block, bool correction = false,
                                                  bool pack = false) {
  EstimateSelectParams p;
  p.block = block;
  p.alpha = alpha;
  p.sink = 1;
  p.window = 1;
  p.tail = 1;
  p.mean_correction = correction;
  p.pack_gqa = pack;
  return p;
}

// The first candidate whose oracle decisions are unchanged at candidate·(1 ± kMargin) and
// satisfy `useful`; NaN when none does (the test then fails).
inline double stable_parameter(const TestProblem& tp, const std::vector<double>& candidates,
                               const std::function<Policy(double)>& make,
                               const std::function<bool(const Decisions&)>& useful) {
  for (double c : candidates) {
    const ref::Result mid = oracle(tp, make(c));
    if (!useful(mid.decisions)) continue;
    if (!same_decisions(mid.decisions, oracle(tp, make(c * (1 - kMargin))).decisions)) continue;
    if (!same_decisions(mid.decisions, oracle(tp, make(c * (1 + kMargin))).decisions)) continue;
    return c;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

}  // namespace sparseprefill::test
