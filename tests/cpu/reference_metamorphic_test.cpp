// SPDX-License-Identifier: Apache-2.0
// Metamorphic and hostile-input properties of the fp64 oracle on seeded random inputs:
// all-kept policies equal dense, a policy equals dense attention under its expanded element
// mask, varlen equals per-sequence calls, paged equals contiguous, GQA equals repeated K/V, a
// chunk equals the tail of the full call, skipped K/V are never read, odd lengths, s_q != s_k,
// and NaN propagation.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/cases.h"
#include "common/decisions.h"
#include "common/inputs.h"
#include "common/naive.h"
#include "common/results.h"
#include "reference/reference.h"
#include "reference/row_sets.h"
#include "sparseprefill/attention.h"

namespace sparseprefill {
namespace {

using test::Inputs;
using test::same_decisions;
using test::same_result;

constexpr double kTight = 1e-12;  // two fp64 evaluations of the same sum in different orders

ref::Result run_ok(const test::TestProblem& tp, const Policy& policy) {
  ref::Result r;
  const Status st = ref::run_reference(tp.problem(), policy, &r);
  EXPECT_TRUE(st.ok()) << policy_name(policy) << ": " << st.to_string();
  return r;
}

ProblemShape shape_of(const test::TestProblem& tp) {
  ProblemShape s;
  EXPECT_TRUE(validate_problem(tp.problem(), nullptr, &s).ok());
  return s;
}

test::LayoutOptions varlen() {
  test::LayoutOptions o;
  o.layout = test::Layout::kVarlen;
  return o;
}

// Threshold table fp32 [h_q, positions] with seeded values in [lo, hi).
HostTensor random_table(int h_q, int positions, double lo, double hi, std::uint64_t seed) {
  HostTensor t(DType::kFP32, {h_q, positions});
  test::Random rng(seed);
  for (std::int64_t i = 0; i < t.numel(); ++i) test::set(&t, i, lo + (hi - lo) * (rng.uniform() + 1) / 2);
  return t;
}

ExactGateParams gate(const HostTensor& table, int bq = 8, int bk = 8) { return test::gate_params(table, bq, bk); }

SoftmaxSkipParams skip(double a, int bq = 8, int bk = 8) { return test::skip_params(a, bq, bk); }

EstimateSelectParams estimate(double alpha, int block = 8, bool correct = false, bool pack = false) {
  return sparseprefill::test::small_estimate_select(alpha, block, correct, pack);
}

PermuteStopParams permute(double tau, int segment = 16, int bq = 4, int bk = 8) {
  return test::permute_params(tau, segment, bq, bk);
}

// The element mask a block mask implies: causal, and the key's block selected for the row's
// query block (per KV head masks for every query head of the group).
test::ElementMask mask_of(const BlockMask& m, const Inputs& in, bool causal) {
  return [&m, &in, causal](int b, int h, std::int64_t r, std::int64_t t) {
    if (causal && !test::causally_visible(in.s_q(b), in.s_k(b), r, t)) return false;
    const int mh = m.per_kv_head ? h / (in.h_q / in.h_kv) : h;
    return m.contains(b, mh, static_cast<int>(r / m.block_q), static_cast<int>(t / m.block_k));
  };
}

// Density of a kept mask relative to all visible blocks; the tests below want it strictly
// between 0 and 1 so that the property they check is not vacuous.
double density(const BlockMask& kept, const ProblemShape& s) {
  const BlockMask all = BlockMask::all_visible(s, kept.block_q, kept.block_k, kept.per_kv_head);
  return static_cast<double>(kept.selected_blocks()) / static_cast<double>(all.selected_blocks());
}

// Random normal inputs with structure, so that block policies have something to choose:
// every query gets a shared direction c (norm ~2 sqrt(d)) and the keys of each 8-key block a
// shared offset b_j (norm ~1.5 sqrt(d)), so blocks differ in importance consistently across
// rows and heads (c·b_j / sqrt(d) has a standard deviation of about 3).
Inputs structured(const std::vector<test::SeqLen>& lengths, int h_q, int h_kv, int d, DType dtype,
                  std::uint64_t seed) {
  Inputs in = test::random_inputs(lengths, h_q, h_kv, d, dtype, seed, 1.0, test::Distribution::kNormal);
  test::Random rng(seed + 1000);
  std::vector<double> c(static_cast<std::size_t>(d));
  for (double& x : c) x = 2 * rng.normal();
  for (test::SequenceData& s : in.seqs) {
    const std::int64_t s_q = s.q.shape()[0], s_k = s.k.shape()[0];
    for (std::int64_t i = 0; i < s_q * h_q * d; ++i) test::set(&s.q, i, test::get(s.q, i) + c[static_cast<std::size_t>(i % d)]);
    for (int hk = 0; hk < h_kv; ++hk) {
      for (std::int64_t j = 0; j * 8 < s_k; ++j) {
        std::vector<double> b(static_cast<std::size_t>(d));
        for (double& x : b) x = 1.5 * rng.normal();
        for (std::int64_t t = j * 8; t < std::min<std::int64_t>(j * 8 + 8, s_k); ++t) {
          for (int i = 0; i < d; ++i) {
            const std::int64_t at = (t * h_kv + hk) * d + i;
            test::set(&s.k, at, test::get(s.k, at) + b[static_cast<std::size_t>(i)]);
          }
        }
      }
    }
  }
  return in;
}

// exact_gate thresholds fp32 [h_q, positions]: per head, the midpoint between the two middle
// maxima of the full bq x bk blocks of `in` (so about half of them are skipped, none by a tie).
HostTensor median_table(const Inputs& in, int positions, int bq, int bk) {
  HostTensor t(DType::kFP32, {in.h_q, positions});
  const double scale = 1.0 / std::sqrt(static_cast<double>(in.d));
  for (int h = 0; h < in.h_q; ++h) {
    std::vector<double> maxima;
    for (int b = 0; b < static_cast<int>(in.seqs.size()); ++b) {
      const test::SequenceData& s = in.seqs[static_cast<std::size_t>(b)];
      const std::int64_t s_q = in.s_q(b), s_k = in.s_k(b), off = s_k - s_q;
      for (std::int64_t r0 = 0; r0 < s_q; r0 += bq) {
        for (std::int64_t k0 = 0; k0 + bk - 1 <= r0 + off && k0 < s_k; k0 += bk) {
          double m = -std::numeric_limits<double>::infinity();
          for (std::int64_t r = r0; r < std::min<std::int64_t>(r0 + bq, s_q); ++r) {
            for (std::int64_t k = k0; k < std::min<std::int64_t>(k0 + bk, s_k); ++k) {
              double dot = 0;
              const int hk = h / (in.h_q / in.h_kv);
              for (int i = 0; i < in.d; ++i) dot += test::get(s.q, (r * in.h_q + h) * in.d + i) * test::get(s.k, (k * in.h_kv + hk) * in.d + i);
              m = std::max(m, scale * dot);
            }
          }
          maxima.push_back(m);
        }
      }
    }
    std::sort(maxima.begin(), maxima.end());
    const std::size_t n = maxima.size();
    const double mid = n < 2 ? 0.0 : (maxima[n / 2 - 1] + maxima[n / 2]) / 2;
    for (int p = 0; p < positions; ++p) test::set(&t, h * positions + p, mid);
  }
  return t;
}

// Two sequences: a square one and a chunk over a cached prefix.
Inputs two_sequences(DType dtype, int h_q, int h_kv, int d, std::uint64_t seed) {
  return test::random_inputs({{37, 37}, {20, 45}}, h_q, h_kv, d, dtype, seed, 1.0, test::Distribution::kNormal);
}

// ---------------------------------------------------------------- all kept equals dense

TEST(ReferenceMetamorphic, AllKeptPoliciesEqualDense) {
  const Inputs in = two_sequences(DType::kBF16, 4, 2, 8, 11);
  const test::TestProblem tp = test::build_problem(in, varlen());
  const ProblemShape shape = shape_of(tp);
  const ref::Result dense = run_ok(tp, DenseParams{});
  HostTensor minus_inf(DType::kFP32, {4, 1});
  for (std::int64_t i = 0; i < 4; ++i) test::set(&minus_inf, i, -std::numeric_limits<double>::infinity());
  struct Case {
    std::string name;
    Policy policy;
  };
  const std::vector<Case> cases = {
      {"exact_gate T=-inf", gate(minus_inf)},
      {"softmax_skip tiny a", skip(1e-300)},
      {"softmax_skip a > s_k", skip(1e6)},
      {"estimate_select alpha=0", estimate(0.0)},
      {"estimate_select alpha=0 pack_gqa", estimate(0.0, 8, true, true)},
      {"permute_stop tau=0", permute(0.0)},
  };
  for (const Case& c : cases) {
    const ref::Result r = run_ok(tp, c.policy);
    EXPECT_TRUE(same_result(r, dense, kTight)) << c.name;
    if (std::holds_alternative<PermuteStopParams>(c.policy)) {
      for (const PermuteTile& t : r.decisions.tiles) EXPECT_EQ(t.chunks_visited, t.chunks_total) << c.name;
    } else {
      const BlockMask& k = r.decisions.kept;
      const BlockMask all = BlockMask::all_visible(shape, k.block_q, k.block_k, k.per_kv_head);
      EXPECT_EQ(k.to_dense(), all.to_dense()) << c.name;
      EXPECT_EQ(r.decisions.corrected.selected_blocks(), 0) << c.name;
    }
  }
}

// ---------------------------------------------------------------- block masks

TEST(ReferenceMetamorphic, BlockSparseEqualsDenseUnderTheExpandedMask) {
  for (const bool causal : {true, false}) {
    for (const bool per_kv : {false, true}) {
      Inputs in = test::random_inputs({{37, 37}, {20, 45}, {13, 6}}, 4, 2, 8, DType::kFP16, 5);
      test::LayoutOptions opt = varlen();
      opt.causal = causal;
      const test::TestProblem tp = test::build_problem(in, opt);
      const ProblemShape shape = shape_of(tp);
      const BlockMask all = BlockMask::all_visible(shape, 8, 4, per_kv);
      // Patterns: empty, all, diagonal (the last visible block only), sink (block 0), random.
      std::vector<std::uint8_t> all_map = all.to_dense(), diag(all_map.size(), 0), sink(all_map.size(), 0),
                                random(all_map.size(), 0);
      test::Random rng(17);
      const auto k_blocks = static_cast<std::size_t>(all.num_k_blocks);
      for (std::size_t row = 0; row < all_map.size() / k_blocks; ++row) {
        std::size_t last = k_blocks;
        for (std::size_t kb = 0; kb < k_blocks; ++kb) {
          if (!all_map[row * k_blocks + kb]) continue;
          last = kb;
          random[row * k_blocks + kb] = rng.below(2) == 1;
        }
        if (last == k_blocks) continue;
        diag[row * k_blocks + last] = 1;
        sink[row * k_blocks] = 1;
      }
      for (const auto* map : {&all_map, &diag, &sink, &random}) {
        BlockSparseParams p;
        ASSERT_TRUE(BlockMask::from_dense(shape, 8, 4, per_kv, *map, &p.mask).ok());
        EXPECT_TRUE(same_result(run_ok(tp, p), test::masked_softmax(in, 0.0, mask_of(p.mask, in, causal)), kTight))
            << "causal " << causal << " per_kv_head " << per_kv;
      }
      BlockSparseParams none;
      none.mask = BlockMask::empty(shape, 8, 4, per_kv);
      const ref::Result r = run_ok(tp, none);
      for (double x : r.o) EXPECT_EQ(x, 0.0);
      for (double x : r.lse) EXPECT_EQ(x, -std::numeric_limits<double>::infinity());
    }
  }
}

TEST(ReferenceMetamorphic, BlockPoliciesEqualDenseUnderTheirKeptMask) {
  const Inputs in = structured({{37, 37}, {20, 45}}, 4, 2, 8, DType::kBF16, 23);
  const test::TestProblem tp = test::build_problem(in, varlen());
  const ProblemShape shape = shape_of(tp);
  const HostTensor table = median_table(in, 8, 8, 8);
  const std::vector<Policy> policies = {gate(table), skip(2.0), estimate(0.3), estimate(0.3, 8, false, true),
                                        estimate(0.3, 4)};
  for (const Policy& p : policies) {
    const ref::Result r = run_ok(tp, p);
    const double dens = density(r.decisions.kept, shape);
    EXPECT_GT(dens, 0.0) << describe(p);
    EXPECT_LT(dens, 1.0) << describe(p);
    EXPECT_TRUE(same_result(r, test::masked_softmax(in, 0.0, mask_of(r.decisions.kept, in, true)), kTight))
        << describe(p);
    // Replaying the decisions as a block_sparse policy gives the same output.
    BlockSparseParams bs;
    bs.mask = r.decisions.kept;
    EXPECT_TRUE(same_result(run_ok(tp, bs), r, kTight)) << describe(p);
  }
}

TEST(ReferenceMetamorphic, ExactGateDecisionsMatchAnIndependentBlockMax) {
  const Inputs in = two_sequences(DType::kBF16, 2, 1, 8, 29);
  const test::TestProblem tp = test::build_problem(in, varlen());
  const HostTensor table = random_table(2, 3, 1.5, 3.5, 31);
  const ref::Result r = run_ok(tp, gate(table));
  const double scale = 1.0 / std::sqrt(8.0);
  int checked = 0;
  for (int b = 0; b < 2; ++b) {
    const std::int64_t s_q = in.s_q(b), s_k = in.s_k(b), off = s_k - s_q;
    for (int h = 0; h < 2; ++h) {
      for (int qb = 0; qb * 8 < s_q; ++qb) {
        const std::int64_t r0 = qb * 8, r1 = std::min<std::int64_t>(r0 + 8, s_q);
        const int pos = static_cast<int>(std::min<std::int64_t>((r0 + off) / 8, 2));
        const double t = test::get(table, h * 3 + pos);
        for (int kb = 0; kb * 8 < s_k; ++kb) {
          // Full iff the first row sees the block's last key.
          const std::int64_t k0 = kb * 8, k1 = std::min<std::int64_t>(k0 + 8, s_k);
          if (k1 - 1 > r0 + off) continue;
          double m = -std::numeric_limits<double>::infinity();
          for (std::int64_t row = r0; row < r1; ++row) {
            for (std::int64_t key = k0; key < k1; ++key) {
              double dot = 0;
              for (int i = 0; i < 8; ++i) {
                dot += test::get(in.seqs[static_cast<std::size_t>(b)].q, (row * 2 + h) * 8 + i) *
                       test::get(in.seqs[static_cast<std::size_t>(b)].k, key * 8 + i);
              }
              m = std::max(m, scale * dot);
            }
          }
          EXPECT_EQ(r.decisions.kept.contains(b, h, qb, kb), m >= t) << b << " " << h << " " << qb << " " << kb;
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 20);
}

TEST(ReferenceMetamorphic, PermuteStopVisitsFewerChunksAsTauGrows) {
  const Inputs in = test::random_inputs({{64, 80}}, 2, 1, 8, DType::kBF16, 41, 1.0, test::Distribution::kNormal);
  const test::TestProblem tp = test::build_problem(in, varlen());
  std::vector<int> before;
  int stopped_early = 0;
  for (const double tau : {0.0, 0.01, 0.05, 0.2, 0.5}) {
    const ref::Result r = run_ok(tp, permute(tau));
    std::vector<int> now;
    for (const PermuteTile& t : r.decisions.tiles) {
      now.push_back(t.chunks_visited);
      if (t.chunks_total > 0) EXPECT_GE(t.chunks_visited, 1);  // the first chunk is always visited
      stopped_early += t.chunks_visited < t.chunks_total;
    }
    if (!before.empty()) {
      ASSERT_EQ(now.size(), before.size());
      for (std::size_t i = 0; i < now.size(); ++i) EXPECT_LE(now[i], before[i]) << tau << " tile " << i;
    }
    before = now;
  }
  EXPECT_GT(stopped_early, 0);
}

// ---------------------------------------------------------------- layouts

// Policies with small blocks that exercise every decision path on short sequences.
std::vector<Policy> layout_policies(const HostTensor& table) {
  return {DenseParams{}, gate(table, 4, 8), skip(2.0, 8, 4), estimate(0.3, 4, true), estimate(0.3, 4, true, true),
          permute(0.05, 8, 4, 4)};
}

TEST(ReferenceMetamorphic, VarlenEqualsPerSequenceCalls) {
  // Includes s_q > s_k (rows that see nothing), a single query and an empty sequence.
  const std::vector<test::SeqLen> lengths = {{17, 17}, {5, 23}, {9, 4}, {1, 13}, {0, 7}};
  const Inputs in = test::random_inputs(lengths, 4, 2, 8, DType::kBF16, 3, 1.0, test::Distribution::kNormal);
  const HostTensor table = random_table(4, 4, 1.0, 2.5, 9);
  const test::TestProblem all = test::build_problem(in, varlen());
  for (const Policy& p : layout_policies(table)) {
    const ref::Result whole = run_ok(all, p);
    std::int64_t row0 = 0;
    std::size_t tile = 0;
    for (int b = 0; b < static_cast<int>(lengths.size()); ++b) {
      Inputs one = in;
      one.seqs = {in.seqs[static_cast<std::size_t>(b)]};
      const ref::Result single = run_ok(test::build_problem(one), p);
      const std::int64_t rows = in.s_q(b), total = whole.lse.size() / 4;
      for (std::int64_t i = 0; i < rows * 4 * 8; ++i) {
        EXPECT_EQ(whole.o[static_cast<std::size_t>(row0 * 32 + i)], single.o[static_cast<std::size_t>(i)]) << describe(p);
      }
      for (int h = 0; h < 4; ++h) {
        for (std::int64_t r = 0; r < rows; ++r) {
          EXPECT_EQ(whole.lse[static_cast<std::size_t>(h * total + row0 + r)], single.lse[static_cast<std::size_t>(h * rows + r)]);
        }
      }
      // The sequence's decisions are the call's decisions for batch b.
      const BlockMask& wk = whole.decisions.kept;
      const BlockMask& sk = single.decisions.kept;
      for (int h = 0; h < sk.heads; ++h) {
        for (int qb = 0; qb < sk.num_q_blocks; ++qb) {
          EXPECT_EQ(test::kept_blocks(wk, b, h, qb), test::kept_blocks(sk, 0, h, qb)) << describe(p);
        }
      }
      for (const PermuteTile& t : single.decisions.tiles) {
        ASSERT_LT(tile, whole.decisions.tiles.size());
        PermuteTile w = whole.decisions.tiles[tile++];
        EXPECT_EQ(w.batch, b);
        w.batch = 0;
        EXPECT_TRUE(w.head == t.head && w.segment == t.segment && w.tile == t.tile &&
                    w.chunks_visited == t.chunks_visited && w.chunks_total == t.chunks_total);
      }
      row0 += rows;
    }
    EXPECT_EQ(tile, whole.decisions.tiles.size());
  }
}

TEST(ReferenceMetamorphic, PagedEqualsContiguous) {
  const std::vector<test::SeqLen> lengths = {{17, 17}, {5, 23}, {9, 4}};
  const Inputs in = test::random_inputs(lengths, 4, 2, 8, DType::kBF16, 4, 1.0, test::Distribution::kNormal);
  const HostTensor table = random_table(4, 4, 1.0, 2.5, 10);
  const test::TestProblem contiguous = test::build_problem(in, varlen());
  for (const int page : {1, 3, 16}) {
    test::LayoutOptions opt;
    opt.layout = test::Layout::kPaged;
    opt.page_size = page;
    const test::TestProblem paged = test::build_problem(in, opt);
    for (const Policy& p : layout_policies(table)) {
      const ref::Result a = run_ok(contiguous, p), b = run_ok(paged, p);
      EXPECT_TRUE(same_result(b, a, 0.0)) << "page " << page << " " << describe(p);
      EXPECT_TRUE(same_decisions(a.decisions, b.decisions)) << "page " << page << " " << describe(p);
    }
  }
  // Batched K/V with seqused_k (unequal lengths) is the same call too.
  Inputs equal_q = test::random_inputs({{9, 17}, {9, 23}}, 4, 2, 8, DType::kBF16, 5);
  const ref::Result batched = run_ok(test::build_problem(equal_q), DenseParams{});
  EXPECT_TRUE(same_result(batched, run_ok(test::build_problem(equal_q, varlen()), DenseParams{}), 0.0));
}

TEST(ReferenceMetamorphic, GqaEqualsRepeatedKv) {
  for (const int group : {1, 4, 8}) {
    const Inputs in = test::random_inputs({{19, 27}}, 8, 8 / group, 8, DType::kBF16, 6, 1.0, test::Distribution::kNormal);
    const Inputs repeated = test::repeat_kv(in);
    const HostTensor table = random_table(8, 4, 1.0, 2.5, 12);
    const std::vector<Policy> policies = {DenseParams{}, gate(table, 4, 8), skip(2.0, 8, 4), estimate(0.3, 4, true),
                                          permute(0.05, 8, 4, 4)};
    for (const Policy& p : policies) {
      const ref::Result a = run_ok(test::build_problem(in), p);
      const ref::Result b = run_ok(test::build_problem(repeated), p);
      EXPECT_TRUE(same_result(a, b, 0.0)) << "group " << group << " " << describe(p);
      EXPECT_TRUE(same_decisions(a.decisions, b.decisions)) << "group " << group << " " << describe(p);
    }
  }
}

TEST(ReferenceMetamorphic, ChunkEqualsTheTailOfTheFullCall) {
  // N = 48 keys; the chunk holds the last 16 queries. 32 is a multiple of block_q (8) and of
  // the segment (16), so the chunk's query blocks and segments are the full call's last ones.
  const Inputs full = test::random_inputs({{48, 48}}, 2, 1, 8, DType::kBF16, 8, 1.0, test::Distribution::kNormal);
  Inputs chunk = test::empty_inputs({{16, 48}}, 2, 1, 8, DType::kBF16);
  chunk.seqs[0].k = full.seqs[0].k;
  chunk.seqs[0].v = full.seqs[0].v;
  for (std::int64_t i = 0; i < chunk.seqs[0].q.numel(); ++i) test::set(&chunk.seqs[0].q, i, test::get(full.seqs[0].q, 32 * 16 + i));
  const HostTensor table = random_table(2, 6, 1.0, 2.5, 13);
  const std::vector<Policy> policies = {DenseParams{}, gate(table), skip(2.0), permute(0.05, 16, 4, 8)};
  for (const Policy& p : policies) {
    const ref::Result a = run_ok(test::build_problem(full), p);
    const ref::Result c = run_ok(test::build_problem(chunk), p);
    for (std::int64_t i = 0; i < 16 * 2 * 8; ++i) {
      EXPECT_EQ(c.o[static_cast<std::size_t>(i)], a.o[static_cast<std::size_t>(32 * 16 + i)]) << describe(p);
    }
    for (int h = 0; h < 2; ++h) {
      for (int r = 0; r < 16; ++r) EXPECT_EQ(c.lse[static_cast<std::size_t>(h * 16 + r)], a.lse[static_cast<std::size_t>(h * 48 + 32 + r)]);
    }
    if (!std::holds_alternative<ExactGateParams>(p) && !std::holds_alternative<SoftmaxSkipParams>(p)) continue;
    for (int h = 0; h < 2; ++h) {
      for (int qb = 0; qb < 2; ++qb) {
        EXPECT_EQ(test::kept_blocks(c.decisions.kept, 0, h, qb), test::kept_blocks(a.decisions.kept, 0, h, qb + 4))
            << describe(p);
      }
    }
  }
}

// ---------------------------------------------------------------- hostile inputs

// NaN into rows [t0, t1) of kv head hk of a [s_k, h_kv, d] tensor.
void poison_keys(HostTensor* t, int h_kv, int d, int hk, std::int64_t t0, std::int64_t t1) {
  for (std::int64_t k = t0; k < t1; ++k) {
    for (int i = 0; i < d; ++i) test::set(t, (k * h_kv + hk) * d + i, std::nan(""));
  }
}

// Key blocks that no (query head of kv head hk, query block) lists in `mask`.
std::vector<int> unused_blocks(const BlockMask& mask, int hk, int group) {
  std::vector<int> out;
  for (int kb = 0; kb < mask.num_k_blocks; ++kb) {
    bool used = false;
    for (int qb = 0; qb < mask.num_q_blocks; ++qb) {
      for (int g = 0; g < (mask.per_kv_head ? 1 : group); ++g) {
        const int h = mask.per_kv_head ? hk : hk * group + g;
        used = used || mask.contains(0, h, qb, kb);
      }
    }
    if (!used) out.push_back(kb);
  }
  return out;
}

TEST(ReferenceHostile, SkippedBlocksAreNeverRead) {
  // One query block of 8 rows over 64 keys (8 key blocks), two query heads on one KV head.
  const Inputs clean = structured({{8, 64}}, 2, 1, 8, DType::kBF16, 14);
  const test::TestProblem tp = test::build_problem(clean);
  const HostTensor table = median_table(clean, 8, 8, 8);
  // exact_gate and softmax_skip read K of every visible block (the gate), so only V of the
  // skipped blocks is poisoned, and the whole run is repeated on the poisoned inputs.
  for (const Policy& p : std::vector<Policy>{gate(table), skip(6.0)}) {
    const ref::Result r = run_ok(tp, p);
    Inputs bad = clean;
    const std::vector<int> unused = unused_blocks(r.decisions.kept, 0, 2);
    EXPECT_FALSE(unused.empty()) << describe(p);
    for (int kb : unused) poison_keys(&bad.seqs[0].v, 1, 8, 0, kb * 8, kb * 8 + 8);
    const ref::Result again = run_ok(test::build_problem(bad), p);
    EXPECT_TRUE(same_result(again, r, 0.0)) << describe(p);
    EXPECT_TRUE(same_decisions(r.decisions, again.decisions)) << describe(p);
    for (double x : again.o) ASSERT_TRUE(std::isfinite(x)) << describe(p);
  }
  // estimate_select scores every block from its mean key, so its selection reads all K; the
  // compute stage must read neither K nor V of the pruned blocks. (With mean correction every
  // pruned block of this chunk is wholly visible and corrected: only its means are read.)
  EstimateSelectParams p = estimate(0.3, 8);
  p.tail = 0;
  const ref::Result r = run_ok(tp, p);
  Inputs bad = clean;
  const std::vector<int> unused = unused_blocks(r.decisions.kept, 0, 2);
  EXPECT_FALSE(unused.empty()) << describe(p);
  for (int kb : unused) {
    poison_keys(&bad.seqs[0].k, 1, 8, 0, kb * 8, kb * 8 + 8);
    poison_keys(&bad.seqs[0].v, 1, 8, 0, kb * 8, kb * 8 + 8);
  }
  ref::Result again;
  ASSERT_TRUE(ref::attend_decisions(test::build_problem(bad).problem(), p, r.decisions, &again).ok());
  EXPECT_TRUE(same_result(again, r, 0.0)) << describe(p);
  for (double x : again.o) ASSERT_TRUE(std::isfinite(x)) << describe(p);
}

TEST(ReferenceHostile, OddLengthsAndUnequalQueryKeyLengths) {
  const std::vector<test::SeqLen> lengths = {{1, 1},    {15, 15},  {17, 17}, {113, 113}, {1023, 1023},
                                             {1, 17},   {15, 113}, {17, 15}, {113, 17}};
  for (const test::SeqLen len : lengths) {
    const Inputs in = test::random_inputs({len}, 1, 1, 4, DType::kBF16, static_cast<std::uint64_t>(len.s_q * 7 + len.s_k));
    const test::TestProblem tp = test::build_problem(in);
    const std::string what = std::to_string(len.s_q) + "x" + std::to_string(len.s_k);
    const ref::Result dense = run_ok(tp, DenseParams{});
    EXPECT_TRUE(same_result(dense, test::masked_softmax(in, 0.0, [&](int, int, std::int64_t r, std::int64_t t) {
      return test::causally_visible(len.s_q, len.s_k, r, t);
    }), kTight)) << what;
    // Rows at negative positions are empty; every other row is finite.
    for (std::int64_t r = 0; r < len.s_q; ++r) {
      const bool empty = r + len.s_k - len.s_q < 0;
      EXPECT_EQ(dense.lse[static_cast<std::size_t>(r)] == -std::numeric_limits<double>::infinity(), empty) << what;
    }
    const HostTensor table = random_table(1, 8, 0.4, 0.8, 16);
    for (const Policy& p : std::vector<Policy>{gate(table, 16, 16), skip(4.0, 16, 16), estimate(0.3, 16)}) {
      const ref::Result r = run_ok(tp, p);
      EXPECT_TRUE(same_result(r, test::masked_softmax(in, 0.0, mask_of(r.decisions.kept, in, true)), kTight))
          << what << " " << describe(p);
    }
    EXPECT_TRUE(same_result(run_ok(tp, permute(0.0, 64, 16, 16)), dense, kTight)) << what;
    const ref::Result stopped = run_ok(tp, permute(0.05, 64, 16, 16));
    for (std::int64_t r = 0; r < len.s_q; ++r) {
      EXPECT_EQ(std::isfinite(stopped.lse[static_cast<std::size_t>(r)]), std::isfinite(dense.lse[static_cast<std::size_t>(r)]));
    }
  }
}

TEST(ReferenceHostile, NaNInOneQueryRowStaysInThatRow) {
  Inputs in = test::random_inputs({{40, 40}}, 2, 1, 8, DType::kBF16, 18, 1.0, test::Distribution::kNormal);
  const std::int64_t bad_row = 21;
  test::set(&in.seqs[0].q, (bad_row * 2 + 0) * 8 + 3, std::nan(""));
  const test::TestProblem tp = test::build_problem(in);
  const HostTensor table = random_table(2, 8, 1.5, 2.5, 19);
  const std::vector<Policy> policies = {DenseParams{}, gate(table), skip(2.0), estimate(0.3, 8, true),
                                        estimate(0.3, 8, false, true), permute(0.05, 16, 4, 8)};
  for (const Policy& p : policies) {
    const ref::Result r = run_ok(tp, p);
    for (std::int64_t row = 0; row < 40; ++row) {
      for (int h = 0; h < 2; ++h) {
        const bool nan_row = row == bad_row && h == 0;
        EXPECT_EQ(std::isnan(r.lse[static_cast<std::size_t>(h * 40 + row)]), nan_row) << describe(p) << " row " << row;
        EXPECT_EQ(std::isnan(r.o[static_cast<std::size_t>((row * 2 + h) * 8)]), nan_row) << describe(p) << " row " << row;
      }
    }
  }
}

}  // namespace
}  // namespace sparseprefill
