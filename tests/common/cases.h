// SPDX-License-Identifier: Apache-2.0
// Helpers the backend test suites (CPU backend, CUDA) share for building cases and choosing
// policy parameters away from ties. Header-only; nvcc and g++ both compile it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
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

// fp64 max of scale·q·k over the valid rows of query block qb and the keys of key block kb of
// sequence 0 (query head h; scale = 1/sqrt(d)).
inline double block_max(const Inputs& in, int h, const geom::BlockGeometry& g, int qb, int kb) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(in.d));
  const int kvh = h / (in.h_q / in.h_kv);
  const SequenceData& s = in.seqs[0];
  double m = -std::numeric_limits<double>::infinity();
  for (std::int64_t r = g.row_begin(qb); r < g.row_end(qb); ++r) {
    for (std::int64_t t = g.key_begin(kb); t < g.key_end(kb); ++t) {
      double dot = 0.0;
      for (int c = 0; c < in.d; ++c) dot += get(s.q, (r * in.h_q + h) * in.d + c) * get(s.k, (t * in.h_kv + kvh) * in.d + c);
      m = std::max(m, scale * dot);
    }
  }
  return m;
}

// An exact_gate threshold table [h_q, positions] for batch-1 inputs: for each (h, qb) the
// midpoint of two consecutive observed maxima of its gated blocks with a gap of at least 0.02,
// near the `keep_fraction` quantile, so no maximum lies within 0.01 of the threshold (decisions
// away from ties); -inf (everything kept) when nothing is gated.
inline HostTensor midpoint_thresholds(const Inputs& in, bool causal, int bq, int bk, double keep_fraction) {
  const double inf = std::numeric_limits<double>::infinity();
  const geom::BlockGeometry g = geometry(in.s_q(0), in.s_k(0), causal, bq, bk);
  const int positions = static_cast<int>(geom::ceil_div(in.s_k(0), bq)) + 1;
  HostTensor thr(DType::kFP32, {in.h_q, positions});
  for (int i = 0; i < in.h_q * positions; ++i) thr.as<float>()[i] = -std::numeric_limits<float>::infinity();
  for (int h = 0; h < in.h_q; ++h) {
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
      std::vector<double> maxima;
      for (int kb = 0; kb < g.visible_end(qb); ++kb) {
        const bool gated = causal ? g.is_full(qb, kb) : kb != g.num_k_blocks() - 1;
        if (gated) maxima.push_back(block_max(in, h, g, qb, kb));
      }
      std::sort(maxima.begin(), maxima.end(), std::greater<double>());
      const int n = static_cast<int>(maxima.size());
      const int want = std::clamp(static_cast<int>(keep_fraction * n), 0, std::max(n - 1, 0));
      double t = -inf;
      for (int delta = 0; delta < n && t == -inf; ++delta) {
        for (int k : {want - delta, want + delta}) {
          if (k >= 0 && k + 1 < n && maxima[static_cast<std::size_t>(k)] - maxima[static_cast<std::size_t>(k + 1)] >= 0.02) {
            t = 0.5 * (maxima[static_cast<std::size_t>(k)] + maxima[static_cast<std::size_t>(k + 1)]);
            break;
          }
        }
      }
      thr.as<float>()[h * positions + g.threshold_position(qb, positions)] = static_cast<float>(t);
    }
  }
  return thr;
}

}  // namespace sparseprefill::test
