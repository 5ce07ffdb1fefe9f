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
#include <utility>
#include <vector>

#include "common/decisions.h"
#include "common/inputs.h"
#include "core/geometry.h"
#include "core/rules/exact_gate.h"
#include "core/rules/nan_max.h"
#include "reference/reference.h"
#include "reference/sequence.h"
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

// The oracle's decisions alone (no outputs: a fraction of run_reference's time).
inline Decisions oracle_decisions(const TestProblem& tp, const Policy& policy) {
  Decisions d;
  const Status st = ref::decide_reference(tp.problem(), policy, &d);
  EXPECT_TRUE(st.ok()) << st.to_string();
  return d;
}

inline TestProblem make_problem(const Inputs& in, bool causal = true, Layout layout = Layout::kBatched) {
  LayoutOptions opt;
  opt.layout = layout;
  opt.causal = causal;
  return build_problem(in, opt);
}

// The block geometry of one sequence, under the local window (left, right) (-1: no bound).
inline geom::BlockGeometry geometry(std::int64_t s_q, std::int64_t s_k, bool causal, int bq, int bk, int left = -1,
                                    int right = -1, int chunk = 0) {
  geom::BlockGeometry g;
  g.seq = {s_q, s_k, causal, left, right, chunk};
  g.block_q = bq;
  g.block_k = bk;
  return g;
}

// Visible (query block, key block) pairs of every sequence (causal mask, window and chunks),
// times `heads`.
inline std::int64_t visible_blocks(const std::vector<SeqLen>& lengths, int heads, bool causal, int bq, int bk,
                                   int left = -1, int right = -1, int chunk = 0) {
  std::int64_t n = 0;
  for (const SeqLen& l : lengths) {
    const geom::BlockGeometry g = geometry(l.s_q, l.s_k, causal, bq, bk, left, right, chunk);
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) n += g.visible_end(qb) - g.visible_begin(qb);
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
    const Decisions mid = oracle_decisions(tp, make(c));
    if (!useful(mid)) continue;
    if (!same_decisions(mid, oracle_decisions(tp, make(c * (1 - kMargin))))) continue;
    if (!same_decisions(mid, oracle_decisions(tp, make(c * (1 + kMargin))))) continue;
    return c;
  }
  return std::numeric_limits<double>::quiet_NaN();
}

// The fp64 maxima of the oracle's scores over every gated block (rules::gate_gated) of `tp`,
// with the query head and query block they belong to: per sequence, query head, query block and
// key block, in that order, for block sizes bq x bk. NaN maxima (NaN inputs) are left out.
struct GatedMax {
  int h, qb;
  double max;
};
inline std::vector<GatedMax> gated_block_maxima(const TestProblem& tp, int bq, int bk) {
  ProblemShape shape;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  std::vector<GatedMax> out;
  for (int b = 0; b < shape.batch; ++b) {
    const ref::Sequence seq = ref::gather_sequence(tp.problem(), shape, b);
    const geom::BlockGeometry g{seq.geo, bq, bk};
    for (int h = 0; h < shape.h_q; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        for (int kb = g.visible_begin(qb); kb < g.visible_end(qb); ++kb) {
          if (!rules::gate_gated(g, qb, kb)) continue;
          double m = -std::numeric_limits<double>::infinity();
          for (std::int64_t r = g.row_begin(qb); r < g.row_end(qb); ++r) {
            for (std::int64_t t = g.key_begin(kb); t < g.key_end(kb); ++t) m = rules::nan_max(m, seq.score(r, h, t));
          }
          if (!std::isnan(m)) out.push_back({h, qb, m});
        }
      }
    }
  }
  return out;
}

// The midpoint of two consecutive values of `maxima` (sorted descending) with a gap of at least
// `gap`, nearest to index `want` (searching outwards); -inf when there is none.
inline double midpoint_near(const std::vector<double>& maxima, int want, double gap) {
  const int n = static_cast<int>(maxima.size());
  for (int delta = 0; delta < n; ++delta) {
    for (int k : {want - delta, want + delta}) {
      if (k >= 0 && k + 1 < n && maxima[static_cast<std::size_t>(k)] - maxima[static_cast<std::size_t>(k + 1)] >= gap) {
        return 0.5 * (maxima[static_cast<std::size_t>(k)] + maxima[static_cast<std::size_t>(k + 1)]);
      }
    }
  }
  return -std::numeric_limits<double>::infinity();
}

// An exact_gate threshold table [h_q, positions] for batch-1 inputs: for each (h, qb) the
// midpoint of two consecutive observed maxima of its gated blocks with a gap of at least 0.02,
// near the `keep_fraction` quantile, so no maximum lies within 0.01 of the threshold (decisions
// away from ties); -inf (everything kept) when nothing is gated. `opt` gives the call's causal
// mask, window and softcap (the gated blocks and the scores they compare).
// `batched`: the batch-1 problem in the batched layout whose scores the gate compares (its fp8
// descales applied: the dequantized scores).
inline HostTensor midpoint_thresholds(const TestProblem& batched, const LayoutOptions& opt, int bq, int bk,
                                      double keep_fraction) {
  ProblemShape shape;
  EXPECT_TRUE(validate_problem(batched.problem(), nullptr, &shape).ok());
  const std::int64_t s_q = shape.seq_q[0], s_k = shape.seq_k[0];
  const geom::BlockGeometry g = geometry(s_q, s_k, opt.causal, bq, bk, opt.window_left, opt.window_right, opt.attention_chunk);
  const int positions = static_cast<int>(geom::ceil_div(s_k, bq)) + 1;
  HostTensor thr(DType::kFP32, {shape.h_q, positions});
  for (int i = 0; i < shape.h_q * positions; ++i) thr.as<float>()[i] = -std::numeric_limits<float>::infinity();
  const std::vector<GatedMax> all = gated_block_maxima(batched, bq, bk);
  for (int h = 0; h < shape.h_q; ++h) {
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
      std::vector<double> maxima;
      for (const GatedMax& m : all) {
        if (m.h == h && m.qb == qb) maxima.push_back(m.max);
      }
      std::sort(maxima.begin(), maxima.end(), std::greater<double>());
      const int n = static_cast<int>(maxima.size());
      const int want = std::clamp(static_cast<int>(keep_fraction * n), 0, std::max(n - 1, 0));
      thr.as<float>()[h * positions + g.threshold_position(qb, positions)] = static_cast<float>(midpoint_near(maxima, want, 0.02));
    }
  }
  return thr;
}
inline HostTensor midpoint_thresholds(const Inputs& in, const LayoutOptions& opt, int bq, int bk, double keep_fraction) {
  LayoutOptions batched = opt;
  batched.layout = Layout::kBatched;
  return midpoint_thresholds(build_problem(in, batched), opt, bq, bk, keep_fraction);
}
inline HostTensor midpoint_thresholds(const Inputs& in, bool causal, int bq, int bk, double keep_fraction) {
  LayoutOptions opt;
  opt.causal = causal;
  return midpoint_thresholds(in, opt, bq, bk, keep_fraction);
}

// Candidates for one exact_gate threshold c over the whole table: midpoints between consecutive
// gated-block maxima of `tp` in the middle half of their distribution, the widest gaps first
// (for stable_parameter, which checks that no maximum lies near c).
inline std::vector<double> gate_candidates(const TestProblem& tp, int bq, int bk) {
  std::vector<double> maxima;
  for (const GatedMax& m : gated_block_maxima(tp, bq, bk)) maxima.push_back(m.max);
  std::sort(maxima.begin(), maxima.end());
  std::vector<std::pair<double, double>> gaps;  // (gap, midpoint)
  const std::size_t n = maxima.size();
  for (std::size_t k = n / 4; k + 1 < n && k < 3 * n / 4; ++k) {
    gaps.emplace_back(maxima[k + 1] - maxima[k], 0.5 * (maxima[k] + maxima[k + 1]));
  }
  std::sort(gaps.begin(), gaps.end(), std::greater<>());
  std::vector<double> out;
  for (std::size_t i = 0; i < gaps.size() && i < 5; ++i) out.push_back(gaps[i].second);
  return out;
}

// Sets K (value = false) or V of key positions [k0, k1) of KV head g in sequence b to NaN.
inline void poison_keys(Inputs* in, int b, bool value, int g, std::int64_t k0, std::int64_t k1) {
  SequenceData& s = in->seqs[static_cast<std::size_t>(b)];
  HostTensor* t = value ? &s.v : &s.k;
  const int dim = value ? in->d_v : in->d;
  for (std::int64_t pos = k0; pos < k1; ++pos) {
    for (int c = 0; c < dim; ++c) set(t, (pos * in->h_kv + g) * dim + c, std::numeric_limits<double>::quiet_NaN());
  }
}

// Attention structure for the selectors (iid random keys have none: every block looks alike):
// key chunks c of `chunk` positions with c % 3 == 0 are "hot". scale_hot_keys multiplies the
// other keys by `cold` (lower scores: softmax_skip skips them); shift_hot_keys adds `shift` to
// every element of the hot keys (their mean keys stand out: estimate_select prunes the rest).
inline void scale_hot_keys(Inputs* in, int chunk, double cold) {
  for (SequenceData& s : in->seqs) {
    for (std::int64_t t = 0; t < s.k.shape()[0]; ++t) {
      if ((t / chunk) % 3 == 0) continue;
      for (std::int64_t i = t * in->h_kv * in->d; i < (t + 1) * in->h_kv * in->d; ++i) set(&s.k, i, get(s.k, i) * cold);
    }
  }
}
inline void shift_hot_keys(Inputs* in, int chunk, double shift) {
  for (SequenceData& s : in->seqs) {
    for (std::int64_t t = 0; t < s.k.shape()[0]; ++t) {
      if ((t / chunk) % 3 != 0) continue;
      for (std::int64_t i = t * in->h_kv * in->d; i < (t + 1) * in->h_kv * in->d; ++i) set(&s.k, i, get(s.k, i) + shift);
    }
  }
}

// Structure for permute_stop's ranking and stop rule: every query element shifted by 0.5 and
// the hot keys' (shift_hot_keys, chunks of 64) by 1.0, so that the hot keys hold most of a
// row's mass, rank first, and the chunks after them add little (iid keys give every chunk
// about the same gain).
inline Inputs permute_inputs(const std::vector<SeqLen>& lengths, int h_q, int h_kv, int d, std::uint64_t seed,
                             DType dtype = DType::kBF16) {
  Inputs in = random_inputs(lengths, h_q, h_kv, d, dtype, seed, 2.5);
  shift_hot_keys(&in, 64, 1.0);
  for (SequenceData& s : in.seqs) {
    for (std::int64_t i = 0; i < s.q.numel(); ++i) set(&s.q, i, get(s.q, i) + 0.5);
  }
  return in;
}

// A random block mask over `shape` that never selects the "dead" key blocks (every third block
// of every row, per mask head: (kb + h) % 3 == 1), so that their K and V can be NaN; the other
// visible blocks (causal mask and window) are selected with probability 3/4.
inline BlockMask random_mask(const ProblemShape& shape, int block_q, int block_k, bool per_kv, std::uint64_t seed,
                             std::vector<std::vector<int>>* dead_by_head) {
  BlockMask m = BlockMask::empty(shape, block_q, block_k, per_kv);
  Random rng(seed);
  dead_by_head->assign(static_cast<std::size_t>(m.heads), {});
  for (int h = 0; h < m.heads; ++h) {
    for (int kb = 0; kb < m.num_k_blocks; ++kb) {
      if ((kb + h) % 3 == 1) (*dead_by_head)[static_cast<std::size_t>(h)].push_back(kb);
    }
  }
  for (int b = 0; b < m.batch; ++b) {
    const geom::BlockGeometry g = geometry(shape.seq_q[static_cast<std::size_t>(b)], shape.seq_k[static_cast<std::size_t>(b)],
                                           shape.causal, block_q, block_k, shape.window_left, shape.window_right,
                                           shape.attention_chunk);
    for (int h = 0; h < m.heads; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        for (int kb = g.visible_begin(qb); kb < g.visible_end(qb); ++kb) {
          if ((kb + h) % 3 == 1 || rng.below(4) == 0) continue;
          EXPECT_TRUE(m.add(shape, b, h, qb, kb).ok());
        }
      }
    }
  }
  return m;
}

// NaN K and V of sequence b's key blocks (geometry g) that no mask row of a KV head selects
// (random_mask's `dead` lists; per query head masks: dead for every query head of the group).
// Returns how many blocks were poisoned.
inline int poison_dead_blocks(Inputs* in, int b, const geom::BlockGeometry& g, bool per_kv,
                              const std::vector<std::vector<int>>& dead) {
  const int group = in->h_q / in->h_kv;
  int poisoned = 0;
  for (int kvh = 0; kvh < in->h_kv; ++kvh) {
    for (int kb = 0; kb < g.num_k_blocks(); ++kb) {
      bool all_dead = true;
      for (int h = 0; h < (per_kv ? 1 : group); ++h) {
        const auto& list = dead[static_cast<std::size_t>(per_kv ? kvh : kvh * group + h)];
        all_dead &= std::find(list.begin(), list.end(), kb) != list.end();
      }
      if (!all_dead) continue;
      poison_keys(in, b, false, kvh, g.key_begin(kb), g.key_end(kb));
      poison_keys(in, b, true, kvh, g.key_begin(kb), g.key_end(kb));
      ++poisoned;
    }
  }
  return poisoned;
}

inline ExactGateParams gate_params(const HostTensor& thr, int bq, int bk) {
  ExactGateParams p;
  p.block_q = bq;
  p.block_k = bk;
  p.thresholds = thr.view();
  return p;
}

inline SoftmaxSkipParams skip_params(double a, int bq, int bk) {
  SoftmaxSkipParams p;
  p.a = a;
  p.block_q = bq;
  p.block_k = bk;
  return p;
}

// Candidate scale factors a for a context of s_k keys: λ = a / s_k from 0.3 down to 0.001.
inline std::vector<double> scale_factors(std::int64_t s_k) {
  std::vector<double> out;
  for (double lambda : {0.1, 0.03, 0.3, 0.01, 0.003, 0.001}) out.push_back(lambda * static_cast<double>(s_k));
  return out;
}

inline PermuteStopParams permute_params(double tau, int segment, int bq, int bk) {
  PermuteStopParams p;
  p.tau = tau;
  p.segment = segment;
  p.block_q = bq;
  p.block_k = bk;
  return p;
}

// Some tile stops before the end of its ranked prefix, and some visits at least two chunks.
inline bool stops_early(const Decisions& d) {
  bool early = false, several = false;
  for (const PermuteTile& t : d.tiles) {
    early |= t.chunks_visited < t.chunks_total;
    several |= t.chunks_visited >= 2;
  }
  return early && several;
}

}  // namespace sparseprefill::test
