// SPDX-License-Identifier: Apache-2.0
// The policies' rules (src/core/rules/*.h), which the oracle, the CPU backend, the calibration
// and the kernels share, on hand-computed cases: exact_gate's gated blocks, threshold and keep
// test; softmax_skip's visit order, λ and row votes; estimate_select's block means, tiles,
// contributing pairs, energies, keep test, forced and correctable blocks; permute_stop's
// segments, tiles, chunks, ranking order and stop rule; block_sparse's entry rule; softcap.
// Each under a local window too (its visible blocks). NaN and tie behaviour as
// docs/semantics.md states it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "common/inputs.h"
#include "core/rules/block_sparse.h"
#include "core/rules/estimate_select.h"
#include "core/rules/exact_gate.h"
#include "core/rules/nan_max.h"
#include "core/rules/permute_stop.h"
#include "core/rules/sinks.h"
#include "core/rules/softcap.h"
#include "core/rules/softmax_skip.h"
#include "sparseprefill/types.h"

namespace sparseprefill {
namespace {

using test::kInf;
using test::kNaN;

geom::BlockGeometry blocks(std::int64_t s_q, std::int64_t s_k, bool causal, int bq, int bk) {
  return geom::BlockGeometry{{s_q, s_k, causal}, bq, bk};
}
// The same under FlashAttention's window_size (left, right).
geom::BlockGeometry windowed(std::int64_t s_q, std::int64_t s_k, bool causal, int bq, int bk, std::int64_t left,
                             std::int64_t right) {
  return geom::BlockGeometry{{s_q, s_k, causal, left, right}, bq, bk};
}

TEST(Rules, NanMaxPropagatesNaNFromEitherSide) {
  EXPECT_EQ(rules::nan_max(1.0, 2.0), 2.0);
  EXPECT_EQ(rules::nan_max(2.0f, 1.0f), 2.0f);
  EXPECT_EQ(rules::nan_max(-kInf, -3.0), -3.0);
  EXPECT_TRUE(std::isnan(rules::nan_max(kNaN, 1.0)));
  EXPECT_TRUE(std::isnan(rules::nan_max(1.0, kNaN)));
  EXPECT_TRUE(std::isnan(rules::nan_max(rules::nan_max(kNaN, 5.0), 7.0)));  // stays NaN once there
}

// ------------------------------------------------------------------ exact_gate

TEST(Rules, GateGatesFullBlocksCausalAndAllButTheLastNonCausal) {
  // Causal 12 x 12, blocks 4 x 4: query block 1 (rows 4..7) sees keys 0..7; block 0 is full,
  // block 1 partial (the diagonal), block 2 invisible.
  const geom::BlockGeometry causal = blocks(12, 12, true, 4, 4);
  EXPECT_TRUE(rules::gate_gated(causal, 1, 0));
  EXPECT_FALSE(rules::gate_gated(causal, 1, 1));
  EXPECT_FALSE(rules::gate_gated(causal, 0, 0));  // the first query block has no full block
  // A chunk (s_q 4 over s_k 12): rows at 8..11, blocks 0 and 1 full, 2 the diagonal.
  const geom::BlockGeometry chunk = blocks(4, 12, true, 4, 4);
  EXPECT_TRUE(rules::gate_gated(chunk, 0, 1));
  EXPECT_FALSE(rules::gate_gated(chunk, 0, 2));
  // Non-causal 5 x 10, blocks 4 x 4: key blocks 0, 1, 2 (the last holds keys 8, 9); 2 is forced.
  const geom::BlockGeometry full = blocks(5, 10, false, 4, 4);
  for (int qb = 0; qb < 2; ++qb) {
    EXPECT_TRUE(rules::gate_gated(full, qb, 0));
    EXPECT_TRUE(rules::gate_gated(full, qb, 1));
    EXPECT_FALSE(rules::gate_gated(full, qb, 2));
  }
}

TEST(Rules, GateThresholdReadsTheAbsolutePositionClampedToTheTable) {
  // Table [2, 5] as a strided view (row stride 11, position stride 2): T[h][p] = 10h + p.
  std::vector<float> table(2 * 11, -1.0f);
  for (int h = 0; h < 2; ++h) {
    for (int p = 0; p < 5; ++p) table[static_cast<std::size_t>(h * 11 + p * 2)] = static_cast<float>(10 * h + p);
  }
  // A chunk of 12 rows over 20 keys: query blocks 0, 1, 2 (rows at 8.., 12.., 16..) read the
  // absolute blocks 2, 3, 4; with 3 positions the last two clamp to position 2.
  const geom::BlockGeometry chunk = blocks(12, 20, true, 4, 4);
  EXPECT_EQ(rules::gate_threshold(table.data(), 11, 2, 5, chunk, 1, 0), 12.0f);
  EXPECT_EQ(rules::gate_threshold(table.data(), 11, 2, 5, chunk, 1, 1), 13.0f);
  EXPECT_EQ(rules::gate_threshold(table.data(), 11, 2, 5, chunk, 0, 2), 4.0f);
  EXPECT_EQ(rules::gate_threshold(table.data(), 11, 2, 3, chunk, 0, 2), 2.0f);
  EXPECT_EQ(rules::gate_threshold(table.data(), 11, 2, 3, chunk, 1, 1), 12.0f);
  // s_q > s_k: the first query block sits at a negative position, clamped to 0.
  const geom::BlockGeometry empty_rows = blocks(8, 2, true, 4, 4);
  EXPECT_EQ(rules::gate_threshold(table.data(), 11, 2, 5, empty_rows, 1, 0), 10.0f);
}

TEST(Rules, GateUnderAWindowGatesTheFullBlocksOnly) {
  // Causal 16 x 16, blocks 4 x 4, window left 5: query block 3 (rows 12..15) sees keys 7..12 (row
  // 12) to 10..15 (row 15): block 1 partial (only row 12 sees key 7), block 2 (8..11) partial
  // (row 15 misses 8, 9), block 3 the diagonal. No block is full: none is gated.
  const geom::BlockGeometry g = windowed(16, 16, true, 4, 4, 5, -1);
  for (int kb = 0; kb < 4; ++kb) EXPECT_FALSE(rules::gate_gated(g, 3, kb)) << kb;
  // Window left 9: rows 12..15 see from keys 3..6: block 2 full (every row sees 8..11), blocks 0
  // and 1 partial below it, block 3 the diagonal.
  const geom::BlockGeometry wide = windowed(16, 16, true, 4, 4, 9, -1);
  EXPECT_FALSE(rules::gate_gated(wide, 3, 0));
  EXPECT_FALSE(rules::gate_gated(wide, 3, 1));
  EXPECT_TRUE(rules::gate_gated(wide, 3, 2));
  EXPECT_FALSE(rules::gate_gated(wide, 3, 3));
  // Non-causal under a window that cuts blocks, the full blocks are gated and the last key
  // block is not forced. 8 x 16, rows at 8..15 (bottom-right), left 4, right 2: query block 0 (rows at 8..11) sees
  // keys 4..10 (row at 8) to 7..13 (row at 11); block 2 (8..11) is not full (the row at 8 misses
  // key 11): nothing is full, nothing gated.
  const geom::BlockGeometry nc = windowed(8, 16, false, 4, 4, 4, 2);
  for (int kb = 0; kb < 4; ++kb) EXPECT_FALSE(rules::gate_gated(nc, 0, kb)) << kb;
  // Left 8, right 8: the row at 8 sees keys 0..15, the row at 11 3..15: blocks 1..3 full and
  // gated (the last among them), block 0 partial.
  const geom::BlockGeometry nc_wide = windowed(8, 16, false, 4, 4, 8, 8);
  EXPECT_FALSE(rules::gate_gated(nc_wide, 0, 0));
  for (int kb = 1; kb < 4; ++kb) EXPECT_TRUE(rules::gate_gated(nc_wide, 0, kb)) << kb;
  // A window that hides nothing (left 16): every block full, the last one ungated, as without.
  const geom::BlockGeometry nc_all = windowed(8, 16, false, 4, 4, 16, -1);
  for (int kb = 0; kb < 3; ++kb) EXPECT_TRUE(rules::gate_gated(nc_all, 0, kb)) << kb;
  EXPECT_FALSE(rules::gate_gated(nc_all, 0, 3));
}

TEST(Rules, GateKeepsTiesMinusInfinityAndNaN) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(rules::gate_keeps(1.0f, 1.0f));
  EXPECT_TRUE(rules::gate_keeps(1.5f, 1.0f));
  EXPECT_FALSE(rules::gate_keeps(0.5f, 1.0f));
  EXPECT_TRUE(rules::gate_keeps(-1e30f, -inf));
  EXPECT_TRUE(rules::gate_keeps(std::numeric_limits<float>::quiet_NaN(), 1.0f));
  EXPECT_FALSE(rules::gate_keeps(std::nextafter(2.0, 0.0), 2.0));  // double: one ulp below skips
}

// ------------------------------------------------------------------ softmax_skip

TEST(Rules, BlasstVisitsPartialBlocksThenFullOnesDescending) {
  // A chunk of 6 rows over 22 keys (rows at 16..21), blocks 6 x 4: blocks 0..3 full (the first
  // row sees keys 0..16), 4 and 5 partial.
  const geom::BlockGeometry g = blocks(6, 22, true, 6, 4);
  EXPECT_EQ(rules::blasst_order(g, 0), (std::vector<int>{5, 4, 3, 2, 1, 0}));
  for (int v = 0; v < 6; ++v) EXPECT_EQ(rules::blasst_block(g, 0, v), 5 - v);
  // Non-causal: every block full, descending.
  EXPECT_EQ(rules::blasst_order(blocks(3, 9, false, 4, 4), 0), (std::vector<int>{2, 1, 0}));
  EXPECT_TRUE(rules::blasst_order(blocks(4, 0, true, 4, 4), 0).empty());
}

TEST(Rules, BlasstUnderAWindowVisitsTheDiagonalBandTheLowerBandThenTheFullBlocks) {
  // 24 x 24 causal, blocks 4 x 4, window left 9: query block 5 (rows 20..23) sees keys 11..23:
  // blocks 2 (row 20 sees 11) and 3 (row 23 sees from 14) partial below, 4 full, 5 the diagonal.
  const geom::BlockGeometry g = windowed(24, 24, true, 4, 4, 9, -1);
  EXPECT_EQ(g.visible_begin(5), 2);
  EXPECT_EQ(g.full_begin(5), 4);
  EXPECT_EQ(g.full_end(5), 5);
  EXPECT_EQ(rules::blasst_visits(g, 5), 4);
  EXPECT_EQ(rules::blasst_order(g, 5), (std::vector<int>{5, 3, 2, 4}));
  // Window left 12: rows see from keys 8..11: block 2 partial below, blocks 3 and 4 full.
  EXPECT_EQ(rules::blasst_order(windowed(24, 24, true, 4, 4, 12, -1), 5), (std::vector<int>{5, 2, 4, 3}));
  // A window wider than the prefix is no window: every visible block descending.
  EXPECT_EQ(rules::blasst_order(windowed(24, 24, true, 4, 4, 23, -1), 5), (std::vector<int>{5, 4, 3, 2, 1, 0}));
}

TEST(Rules, SkipRuleLambdaAndWhenSkippingIsOn) {
  const rules::SkipRule on = rules::skip_rule(100, 10.0);
  EXPECT_TRUE(on.on);
  EXPECT_DOUBLE_EQ(on.ln_lambda, std::log(0.1));
  EXPECT_FALSE(on.gates(0));  // the first visited block is never skipped
  EXPECT_TRUE(on.gates(1));
  EXPECT_TRUE(rules::skip_rule(10, 10.0).on);  // s_k = a: λ = 1
  const rules::SkipRule off = rules::skip_rule(9, 10.0);  // λ > 1
  EXPECT_FALSE(off.on);
  EXPECT_FALSE(off.gates(3));
}

TEST(Rules, SkipVotesAndMargins) {
  using rules::RowVote;
  using rules::skip_vote;
  const double ln_lambda = std::log(0.1);  // -2.30
  EXPECT_EQ(skip_vote(false, false, -kInf, -kInf, ln_lambda), RowVote::kIgnore);
  EXPECT_EQ(skip_vote(false, true, -kInf, 2.0, ln_lambda), RowVote::kSkip);   // nothing seen here
  EXPECT_EQ(skip_vote(true, false, -50.0, -kInf, ln_lambda), RowVote::kKeep);  // first keys
  EXPECT_EQ(skip_vote(true, true, 2.0 - 2.5, 2.0, ln_lambda), RowVote::kSkip);  // -2.5 < -2.30
  EXPECT_EQ(skip_vote(true, true, 2.0 - 2.0, 2.0, ln_lambda), RowVote::kKeep);  // -2.0
  EXPECT_EQ(skip_vote(true, true, 0.0, 0.0, 0.0), RowVote::kKeep);              // strict <
  EXPECT_EQ(skip_vote(true, true, kNaN, 0.0, ln_lambda), RowVote::kKeep);
  EXPECT_EQ(skip_vote(true, true, 1.0, kNaN, ln_lambda), RowVote::kKeep);
  EXPECT_EQ(skip_vote(true, true, -kInf, -kInf, ln_lambda), RowVote::kKeep);    // -inf - -inf
  // The calibration statistic reads the margins: +inf, -inf and the difference.
  EXPECT_EQ(rules::skip_margin(true, false, 3.0, -kInf), kInf);
  EXPECT_EQ(rules::skip_margin(false, true, -kInf, 3.0), -kInf);
  EXPECT_EQ(rules::skip_margin(true, true, 1.0, 3.5), -2.5);
}

// ------------------------------------------------------------------ estimate_select

TEST(Rules, BlockMeanSumsInDoubleThenRoundsToFp32AndTheDtype) {
  // Block 1 of 4 keys over 7 keys holds keys 4, 5, 6 (3 valid). Feature 0: 1 + 2 + 4 = 7,
  // 7 / 3 = 2.333... -> bf16 2.328125. Feature 1: 1e8 + 1 + 1 summed in double stays
  // exact (fp32 accumulation would lose both ones), then rounds to fp32.
  const geom::BlockGeometry g = blocks(7, 7, true, 4, 4);
  const double keys[7][2] = {{9, 9}, {9, 9}, {9, 9}, {9, 9}, {1, 1e8}, {2, 1}, {4, 1}};
  double sum[2];
  double bf16_mean[2];
  rules::block_mean(g, 1, 2, [&](std::int64_t t) { return keys[t]; },
                    [](float x) { return static_cast<double>(round_to(DType::kBF16, x)); }, sum, bf16_mean);
  EXPECT_EQ(bf16_mean[0], 2.328125);
  EXPECT_EQ(sum[1], 1e8 + 2);
  float fp32_mean[2];
  rules::block_mean(g, 1, 2, [&](std::int64_t t) { return keys[t]; }, [](float x) { return x; }, sum, fp32_mean);
  EXPECT_EQ(fp32_mean[0], static_cast<float>(7.0 / 3.0));
  EXPECT_EQ(fp32_mean[1], static_cast<float>((1e8 + 2) / 3.0));
}

TEST(Rules, EstimateTilePositionsScoredBlocksAndTail) {
  // Block 4, a chunk of 8 rows over 20 keys: rows at 12..19. Tile 0 (12..15): fqb = lqb = 3,
  // A = 4; tile 1 (16..19): fqb = lqb = 4, A = 5, the call's last tile.
  const geom::BlockGeometry g = blocks(8, 20, true, 4, 4);
  const rules::EstimateTile t0 = rules::estimate_tile(g, 0, 1, 0);
  EXPECT_EQ(t0.a_first, 12);
  EXPECT_EQ(t0.a_last, 15);
  EXPECT_EQ(t0.fqb, 3);
  EXPECT_EQ(t0.lqb, 3);
  EXPECT_EQ(t0.scored, 4);
  EXPECT_FALSE(t0.tail);
  EXPECT_TRUE(rules::estimate_tile(g, 1, 1, 0).tail);
  EXPECT_EQ(rules::estimate_scored_blocks(g, 1), 5);
  // With prompt_len 40 the prompt's last block is 9: no tile of this chunk is a tail tile.
  EXPECT_FALSE(rules::estimate_tile(g, 1, 1, 40).tail);
  // A short last tile: 6 rows at 0..5 (one-shot): tile 1 is rows 4, 5: A = 6 / 4 = 1.
  const rules::EstimateTile ragged = rules::estimate_tile(blocks(6, 6, true, 4, 4), 1, 0, 0);
  EXPECT_EQ(ragged.fqb, 1);
  EXPECT_EQ(ragged.scored, 1);
  // s_q > s_k: rows at -6..1; tile 0 (-6..-3) is empty, tile 1 (-2..1) scores nothing whole.
  const geom::BlockGeometry neg = blocks(8, 2, true, 4, 4);
  EXPECT_TRUE(rules::estimate_tile(neg, 0, 0, 0).empty());
  const rules::EstimateTile t1 = rules::estimate_tile(neg, 1, 0, 0);
  EXPECT_FALSE(t1.empty());
  EXPECT_EQ(t1.fqb, -1);
  EXPECT_EQ(t1.lqb, 0);
  EXPECT_EQ(t1.scored, 0);
  EXPECT_EQ(rules::estimate_scored_blocks(neg, 0), 0);
}

TEST(Rules, EstimateContributesWhenTheRowSeesSomeKeyOfTheBlock) {
  const geom::BlockGeometry g = blocks(20, 20, true, 4, 4);
  EXPECT_TRUE(rules::estimate_contributes(g, 8, 2));   // block 2 starts at key 8
  EXPECT_FALSE(rules::estimate_contributes(g, 7, 2));
  EXPECT_TRUE(rules::estimate_contributes(g, 0, 0));
  EXPECT_FALSE(rules::estimate_contributes(g, -1, 0));
  // Window left 5: the row at 13 sees keys 8..13: block 1 (4..7) behind it, block 2 in.
  const geom::BlockGeometry w = windowed(20, 20, true, 4, 4, 5, -1);
  EXPECT_FALSE(rules::estimate_contributes(w, 13, 1));
  EXPECT_TRUE(rules::estimate_contributes(w, 12, 1));  // sees 7..12
  EXPECT_TRUE(rules::estimate_contributes(w, 13, 2));
}

TEST(Rules, EstimateEnergiesAreRelativeToTheTilesMaximum) {
  // Two blocks, three pairs; x = -inf marks a pair that does not contribute. M = 2:
  // E_0 = e^0 + e^-1 + 0, E_1 = e^-2 + e^-2 + e^-3, peak = E_0.
  const double x[2][3] = {{2.0, 1.0, -kInf}, {0.0, 0.0, -1.0}};
  double energy[2];
  const double peak = rules::estimate_energies(0, 2, 3, [&](int j, std::int64_t n) { return x[j][n]; }, energy);
  EXPECT_DOUBLE_EQ(energy[0], 1.0 + std::exp(-1.0));
  EXPECT_DOUBLE_EQ(energy[1], 2 * std::exp(-2.0) + std::exp(-3.0));
  EXPECT_EQ(peak, energy[0]);
  // float accumulates in float; a NaN score makes the maximum, every energy and the peak NaN.
  const float y[1][2] = {{0.5f, std::numeric_limits<float>::quiet_NaN()}};
  float e1[1];
  EXPECT_TRUE(std::isnan(rules::estimate_energies(0, 1, 2, [&](int j, std::int64_t n) { return y[j][n]; }, e1)));
  EXPECT_TRUE(std::isnan(e1[0]));
  // Blocks below `first` (a window left them behind) are neither scored nor in the maximum:
  // block 0's 9 would otherwise be M. E_1 = e^0 + e^-1, and energy[0] is left as it was.
  const double z[2][2] = {{9.0, 9.0}, {2.0, 1.0}};
  double e2[2] = {-7.0, 0.0};
  EXPECT_DOUBLE_EQ(rules::estimate_energies(1, 2, 2, [&](int j, std::int64_t n) { return z[j][n]; }, e2),
                   1.0 + std::exp(-1.0));
  EXPECT_EQ(e2[0], -7.0);
  // Nothing scored: the peak is -inf.
  EXPECT_EQ(rules::estimate_energies(2, 2, 2, [&](int j, std::int64_t n) { return z[j][n]; }, e2), -kInf);
}

TEST(Rules, EstimateKeepRuleAndForcedBlocks) {
  // Rows at 16..19 with block 4: fqb = lqb = 4, A = 5; sink 1, window 2 (blocks 3 and 4).
  const geom::BlockGeometry g = blocks(20, 20, true, 4, 4);
  rules::EstimateTile t = rules::estimate_tile(g, 4, 0, 0);
  ASSERT_EQ(t.scored, 5);
  const auto keeps = [&](int j, double energy) { return rules::estimate_keeps(t, j, energy, 1.0, 0.5, 1, 2); };
  EXPECT_TRUE(keeps(0, 0.0));   // sink
  EXPECT_FALSE(keeps(1, 0.4));  // below alpha · peak
  EXPECT_TRUE(keeps(1, 0.5));   // tie keeps
  EXPECT_TRUE(keeps(3, 0.0));   // window fqb - 1 .. lqb
  EXPECT_TRUE(keeps(4, 0.0));
  EXPECT_FALSE(keeps(5, 1.0));  // j > lqb never
  EXPECT_FALSE(keeps(2, kNaN));
  EXPECT_FALSE(rules::estimate_keeps(t, 2, 0.9, kNaN, 0.5, 1, 2));  // NaN peak
  EXPECT_FALSE(rules::estimate_forced(t.tail, t.fqb, 2, 1, 2));
  EXPECT_TRUE(rules::estimate_forced(t.tail, t.fqb, 2, 1, 3));     // window 3 reaches block 2
  EXPECT_FALSE(rules::estimate_forced(t.tail, t.fqb, 4, 0, 0));    // window 0: not even the diagonal
  t.tail = true;  // a tail tile: every visible block
  EXPECT_TRUE(keeps(2, 0.0));
  EXPECT_FALSE(keeps(5, 0.0));
  // A tile whose last row sits before the first key selects nothing.
  const rules::EstimateTile none = rules::estimate_tile(blocks(8, 2, true, 4, 4), 0, 0, 0);
  EXPECT_FALSE(rules::estimate_keeps(none, 0, 1.0, 1.0, 0.0, 1, 1));
}

TEST(Rules, EstimateForcedBlocksOutsideTheWindowAreNotKept) {
  // Rows at 16..19, block 4, window left 6: the tile sees keys 10..19, blocks 2..4; sink block 0
  // and (policy window 4) block 1 are forced but hidden: not kept; a tail tile keeps 2..4 only.
  const geom::BlockGeometry g = windowed(20, 20, true, 4, 4, 6, -1);
  rules::EstimateTile t = rules::estimate_tile(g, 4, 0, 0);
  EXPECT_EQ(t.first, 2);
  EXPECT_EQ(t.scored, 5);
  const auto keeps = [&](int j) { return rules::estimate_keeps(t, j, 0.0, 1.0, 0.5, 1, 4); };
  EXPECT_TRUE(rules::estimate_forced(t.tail, t.fqb, 0, 1, 4));
  EXPECT_FALSE(keeps(0));
  EXPECT_FALSE(keeps(1));
  EXPECT_TRUE(keeps(2));
  EXPECT_TRUE(keeps(4));
  EXPECT_FALSE(rules::estimate_keeps(t, 1, 1.0, 1.0, 0.5, 0, 0));  // an energy does not bring it back
  t.tail = true;
  EXPECT_FALSE(keeps(1));
  EXPECT_TRUE(keeps(3));
}

TEST(Rules, EstimateCorrectableBlocksAreTheTilesFullOnes) {
  // Rows at 9..12 (a chunk of 4 over 13 keys), block 4: the first row sees keys 0..9, so
  // blocks 0 and 1 (keys ..7) are wholly visible to every row, block 2 (8..11) is not.
  const geom::BlockGeometry g = blocks(4, 13, true, 4, 4);
  const std::int64_t a_first = rules::estimate_tile(g, 0, 0, 0).a_first;
  EXPECT_EQ(a_first, 9);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(rules::estimate_correctable(g, a_first, j), g.is_full(0, j)) << j;
  EXPECT_TRUE(rules::estimate_correctable(g, a_first, 1));
  EXPECT_FALSE(rules::estimate_correctable(g, a_first, 2));
  // The sequence's short last block (keys 12..14 of 15) with the first row at 14: correctable.
  EXPECT_TRUE(rules::estimate_correctable(blocks(1, 15, true, 4, 4), 14, 3));
  EXPECT_FALSE(rules::estimate_correctable(blocks(1, 15, true, 4, 4), 13, 3));
  // Window left 10 over rows at 16..19: the last row sees from key 9, so block 2 (8..11) is
  // partial for the tile and block 3 (12..15) full: only block 3 is correctable.
  const geom::BlockGeometry w = windowed(20, 20, true, 4, 4, 10, -1);
  for (int j = 0; j < 5; ++j) EXPECT_EQ(rules::estimate_correctable(w, 16, j), w.is_full(4, j)) << j;
  EXPECT_FALSE(rules::estimate_correctable(w, 16, 2));
  EXPECT_TRUE(rules::estimate_correctable(w, 16, 3));
}

// ------------------------------------------------------------------ permute_stop

TEST(Rules, PermuteSegmentsTilesAndChunks) {
  // A chunk of 10 rows over 30 keys (rows at 20..29), segments of 8: rows 0..3 in segment 2
  // (positions 20..23), rows 4..9 in segment 3 (24..29).
  const geom::SegmentGeometry sg{{10, 30, true}, 8};
  EXPECT_EQ(rules::segment_of(sg, 0), 2);
  EXPECT_EQ(rules::segment_of(sg, 3), 2);
  EXPECT_EQ(rules::segment_of(sg, 4), 3);
  EXPECT_EQ(rules::permute_tiles(sg, 2, 3), 2);  // 4 rows in tiles of 3
  EXPECT_EQ(rules::permute_tiles(sg, 3, 3), 2);  // 6 rows
  EXPECT_EQ(rules::permute_chunks(sg, 2, 5), 4);  // prefix 16 keys in chunks of 5
  EXPECT_EQ(rules::permute_chunks(sg, 3, 8), 3);  // prefix 24
  EXPECT_EQ(rules::permute_guide_keys(24, 8), 8);
  EXPECT_EQ(rules::permute_guide_keys(5, 8), 5);
  EXPECT_EQ(rules::permute_guide_keys(0, 8), 0);
  // s_q > s_k: rows 0..5 at negative positions belong to no segment.
  const geom::SegmentGeometry neg{{8, 2, true}, 4};
  EXPECT_EQ(rules::segment_of(neg, 5), -1);
  EXPECT_EQ(rules::segment_of(neg, 6), 0);
  EXPECT_EQ(rules::permute_chunks(neg, 0, 4), 0);
  // Window left 10 over the chunk above: segment 3's first row (position 24) sees keys 14..24,
  // so its ranked keys are 14..23: 10 of them, 2 chunks of 5.
  const geom::SegmentGeometry local{{10, 30, true, 10, -1}, 8};
  EXPECT_EQ(local.ranked_begin(3), 14);
  EXPECT_EQ(rules::permute_chunks(local, 3, 5), 2);
  EXPECT_EQ(local.ranked_begin(2), 10);  // row 0 at 20 sees from 10: keys 10..15 of the prefix 16
}

TEST(Rules, RankingRoundsToFp32BreaksTiesByIndexAndPutsNaNLast) {
  const std::vector<double> dots = {1.0, 3.0, kNaN, 3.0, -kInf, 2.0, kNaN};
  EXPECT_EQ(rules::rank_descending(dots), (std::vector<std::int64_t>{1, 3, 5, 0, 4, 2, 6}));
  // 1 + 2^-30 and 1 differ in fp64 but not in fp32: they tie, and the lower index ranks first.
  EXPECT_EQ(rules::rank_descending({1.0, 1.0 + std::ldexp(1.0, -30)}), (std::vector<std::int64_t>{0, 1}));
  EXPECT_EQ(rules::rank_descending({1.0, 1.0 + std::ldexp(1.0, -20)}), (std::vector<std::int64_t>{1, 0}));
  EXPECT_EQ(rules::ranking_score(1e300), kInf);  // past fp32: infinite
  EXPECT_TRUE(rules::ranks_before(2.0, 5, 1.0, 0));
  EXPECT_TRUE(rules::ranks_before(-kInf, 9, kNaN, 0));
  EXPECT_FALSE(rules::ranks_before(kNaN, 0, kNaN, 0));  // strict: irreflexive
}

TEST(Rules, PermuteStopsBelowTauOnlyAndNeverOnNaN) {
  EXPECT_DOUBLE_EQ(rules::permute_gain(1.0, 4.0), 0.25);
  EXPECT_TRUE(rules::permute_stops(0.0099, 0.01));
  EXPECT_FALSE(rules::permute_stops(0.01, 0.01));  // gain = tau continues
  EXPECT_FALSE(rules::permute_stops(rules::nan_max(0.0, kNaN), 0.01));
  EXPECT_FALSE(rules::permute_stops(0.0, 0.0));    // tau 0 visits everything
}

// ------------------------------------------------------------------ block_sparse, softcap

TEST(Rules, MaskEntriesLieInTheVisibleRangeAscending) {
  // A query block that sees key blocks 2 .. 5 (a window's lower edge at block 2).
  EXPECT_EQ(rules::mask_entry_fault(2, -1, 6, 2), rules::kMaskOk);
  EXPECT_EQ(rules::mask_entry_fault(1, -1, 6, 2), rules::kMaskRange);  // below the window
  EXPECT_EQ(rules::mask_entry_fault(6, 3, 6, 2), rules::kMaskRange);   // past the diagonal
  EXPECT_EQ(rules::mask_entry_fault(3, 3, 6, 2), rules::kMaskOrder);
  EXPECT_EQ(rules::mask_entry_fault(-1, -1, 6), rules::kMaskRange);     // no window: from block 0
  EXPECT_EQ(rules::mask_entry_fault(0, -1, 6), rules::kMaskOk);
}

TEST(Rules, SoftcapIsTanhScaledMapsInfinitiesToTheCapAndKeepsNaN) {
  EXPECT_EQ(rules::capped_score(7.5, 0.0), 7.5);  // 0: none
  EXPECT_DOUBLE_EQ(rules::capped_score(3.0, 2.0), 2.0 * std::tanh(1.5));
  EXPECT_DOUBLE_EQ(rules::capped_score(-3.0, 2.0), -2.0 * std::tanh(1.5));
  EXPECT_EQ(rules::capped_score(kInf, 2.0), 2.0);
  EXPECT_EQ(rules::capped_score(-kInf, 2.0), -2.0);
  EXPECT_TRUE(std::isnan(rules::capped_score(kNaN, 2.0)));
  EXPECT_EQ(rules::capped_score(0.0f, 30.0f), 0.0f);
  // Monotone: capping keeps the order of scores (so block maxima are the capped maxima).
  EXPECT_LT(rules::capped_score(49.0, 50.0), rules::capped_score(50.0, 50.0));
}

// The kernels' finalisation with a sink (log2 domain) against docs/semantics.md's formula in
// natural logs: M = max(σ, scores), den = e^(σ-M) + Σ e^(s-M), O = Σ e^(s-M) v / den.
TEST(Rules, SinkFinalisationMatchesTheSemanticsAndItsEdgeCases) {
  const double log2e = 1.4426950408889634;
  const std::vector<double> scores = {0.3, -1.2, 2.5, 0.0};
  for (const double sink : {-3.0, 0.7, 2.5, 9.0}) {
    double top = sink;
    for (double s : scores) top = std::max(top, s);
    double key_sum = 0.0;
    for (double s : scores) key_sum += std::exp(s - top);
    const double den = std::exp(sink - top) + key_sum;
    // The kernel's row: m = the scores' max, l relative to it, both log2.
    const double m = 2.5 * log2e;
    double l = 0.0;
    for (double s : scores) l += std::exp2(s * log2e - m);
    double o_scale = 0.0, lse = 0.0;
    rules::finalize_with_sink(m, l, sink * log2e, &o_scale, &lse);
    // O = o_scale · Σ 2^(s log2e - m) v: the weight of each key is o_scale · 2^(s log2e - m).
    EXPECT_NEAR(o_scale * std::exp2(0.3 * log2e - m), std::exp(0.3 - top) / den, 1e-12) << sink;
    EXPECT_NEAR(lse, top + std::log(den), 1e-12) << sink;
  }
  // A row that saw no key: O = 0, LSE = σ (float, as the kernels run it).
  float o_scale = 1.f, lse = 0.f;
  rules::finalize_with_sink(-std::numeric_limits<float>::infinity(), 0.f, 1.5f * 1.44269504f, &o_scale, &lse);
  EXPECT_EQ(o_scale, 0.f);
  EXPECT_NEAR(lse, 1.5f, 1e-6f);
  // NaN or +inf sinks, and a NaN row, make the row NaN.
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    rules::finalize_with_sink(2.f, 3.f, bad, &o_scale, &lse);
    EXPECT_TRUE(std::isnan(o_scale) && std::isnan(lse)) << bad;
  }
  rules::finalize_with_sink(std::numeric_limits<float>::quiet_NaN(), 3.f, 0.f, &o_scale, &lse);
  EXPECT_TRUE(std::isnan(o_scale) && std::isnan(lse));
  // A sink far below the row's scores changes nothing measurable.
  rules::finalize_with_sink(4.f, 2.f, -200.f, &o_scale, &lse);
  EXPECT_FLOAT_EQ(o_scale, 0.5f);
  EXPECT_FLOAT_EQ(lse, (4.f + 1.f) * 0.69314718f);
}

}  // namespace
}  // namespace sparseprefill
