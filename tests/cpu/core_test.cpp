// SPDX-License-Identifier: Apache-2.0
// Core host pieces: dtype rounding, block geometry, problem validation (every bad-input path
// names its argument), BlockMask invariants and conversions, policy parsing, stats.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/geometry.h"
#include "core/rules/exact_gate.h"
#include "core/stats.h"
#include "sparseprefill/sparseprefill.h"

namespace sp = sparseprefill;
using sp::geom::BlockGeometry;

namespace {

TEST(Rounding, Bf16KnownValues) {
  EXPECT_EQ(sp::float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(sp::float_to_bf16(-2.0f), 0xC000);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even -> 1.
  EXPECT_EQ(sp::float_to_bf16(1.00390625f), 0x3F80);
  // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even -> 1 + 2^-6.
  EXPECT_EQ(sp::float_to_bf16(1.01171875f), 0x3F82);
  EXPECT_TRUE(std::isnan(sp::bf16_to_float(sp::float_to_bf16(std::nanf("")))));
  EXPECT_EQ(sp::bf16_to_float(sp::float_to_bf16(-std::numeric_limits<float>::infinity())),
            -std::numeric_limits<float>::infinity());
}

TEST(Rounding, Fp16KnownValues) {
  EXPECT_EQ(sp::float_to_fp16(1.0f), 0x3C00);
  EXPECT_EQ(sp::float_to_fp16(65504.0f), 0x7BFF);
  EXPECT_EQ(sp::float_to_fp16(65520.0f), 0x7C00);         // rounds to +inf
  EXPECT_EQ(sp::float_to_fp16(5.9604644775390625e-8f), 0x0001);  // 2^-24, smallest subnormal
  EXPECT_EQ(sp::float_to_fp16(2.98023223876953125e-8f), 0x0000); // 2^-25 ties to even -> 0
  EXPECT_EQ(sp::float_to_fp16(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(sp::fp16_to_float(sp::float_to_fp16(std::nanf("")))));
}

TEST(Rounding, EveryFiniteBitPatternRoundTrips) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    const auto h = static_cast<std::uint16_t>(bits);
    const float f16 = sp::fp16_to_float(h);
    if (!std::isnan(f16)) ASSERT_EQ(sp::float_to_fp16(f16), h) << std::hex << bits;
    const float b16 = sp::bf16_to_float(h);
    if (!std::isnan(b16)) ASSERT_EQ(sp::float_to_bf16(b16), h) << std::hex << bits;
  }
}

BlockGeometry geo(std::int64_t s_q, std::int64_t s_k, bool causal, int bq, int bk) {
  BlockGeometry g;
  g.seq = {s_q, s_k, causal};
  g.block_q = bq;
  g.block_k = bk;
  return g;
}

TEST(Geometry, SquareCausal) {
  const BlockGeometry g = geo(10, 10, true, 4, 4);
  ASSERT_EQ(g.num_q_blocks(), 3);
  ASSERT_EQ(g.num_k_blocks(), 3);
  // qb 0: rows 0..3 see keys 0..3 at most; row 0 sees key 0 only: block 0 partial.
  EXPECT_EQ(g.visible_end(0), 1);
  EXPECT_EQ(g.full_end(0), 0);
  // qb 1: rows 4..7; row 4 sees keys 0..4: block 0 full, block 1 partial.
  EXPECT_EQ(g.visible_end(1), 2);
  EXPECT_EQ(g.full_end(1), 1);
  // qb 2: rows 8, 9; row 8 sees 0..8: blocks 0, 1 full; block 2 (keys 8, 9) partial.
  EXPECT_EQ(g.visible_end(2), 3);
  EXPECT_EQ(g.full_end(2), 2);
  EXPECT_TRUE(g.is_partial(2, 2));
  EXPECT_EQ(g.visible_pairs(2, 2), 1 + 2);
  EXPECT_EQ(g.threshold_position(2, 100), 2);
  EXPECT_EQ(g.threshold_position(2, 2), 1);  // clamped to the table's last row
}

TEST(Geometry, ChunkedPrefillUsesAbsolutePositions) {
  // 3 new queries after 7 cached keys: rows 0..2 at positions 7..9.
  const BlockGeometry g = geo(3, 10, true, 4, 4);
  EXPECT_EQ(g.visible_end(0), 3);
  EXPECT_EQ(g.full_end(0), 2);  // row 0 sees keys 0..7: blocks 0 and 1 whole
  EXPECT_EQ(g.threshold_position(0, 100), 1);  // floor(7 / 4)
}

TEST(Geometry, MoreQueriesThanKeysLeavesEmptyRows) {
  const BlockGeometry g = geo(6, 2, true, 4, 4);
  EXPECT_EQ(g.seq.last_key(3), -1);  // position -1: sees nothing
  EXPECT_EQ(g.visible_end(0), 0);
  EXPECT_EQ(g.visible_end(1), 1);  // rows 4, 5 see keys 0 and 0..1
  EXPECT_EQ(g.full_end(1), 0);
}

TEST(Geometry, NonCausalEverythingFull) {
  const BlockGeometry g = geo(5, 9, false, 4, 4);
  for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
    EXPECT_EQ(g.visible_end(qb), 3);
    EXPECT_EQ(g.full_end(qb), 3);
  }
  EXPECT_EQ(g.visible_pairs(1, 2), 1);  // one row (4) × one key (8)
}

// exact_gate's gated blocks as every backend counts them (BlockGeometry::gated_end) against
// the definition (docs/semantics.md §3.3: causal, the full blocks; non-causal, every
// block but the last), and the room the decision kernels leave for the others (ungated_room),
// over square, chunked-prefill, empty-row and unaligned shapes.
TEST(Geometry, GatedBlocksMatchTheDefinition) {
  for (bool causal : {true, false}) {
    for (int bk : {64, 128}) {
      for (const auto& [s_q, s_k] : std::vector<std::pair<std::int64_t, std::int64_t>>{
               {1000, 1000}, {300, 1300}, {5, 1000}, {1, 129}, {700, 200}, {129, 0}, {4096, 4096}, {257, 64}}) {
        const BlockGeometry g = geo(s_q, s_k, causal, 128, bk);
        for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
          int gated = 0;
          for (int kb = 0; kb < g.visible_end(qb); ++kb) {
            const bool forced = causal ? !g.is_full(qb, kb) : kb == g.num_k_blocks() - 1;
            if (!forced) {
              EXPECT_LT(kb, g.gated_end(qb)) << s_q << "x" << s_k << " qb " << qb << " kb " << kb;
              ++gated;
            }
          }
          EXPECT_EQ(g.gated_end(qb), gated) << s_q << "x" << s_k << (causal ? " causal" : "") << " bk " << bk << " qb " << qb;
          EXPECT_LE(g.visible_end(qb) - g.gated_end(qb), g.ungated_room()) << s_q << "x" << s_k << " qb " << qb;
        }
      }
    }
  }
}

// Under a local window (FlashAttention's window_size, causal or not) and chunks (its
// attention_chunk, with and without a window) every block range of the
// geometry against the element mask, counted row by row and key by key: visible (some row sees
// some key), full (every row every key; the CUDA kernels' full_below_end below full_end), the
// kernels' element mask (first_key_at .. position + reach, or last_key_at under chunks), the ranges visible_begin/end and
// full_begin/end, visible pairs, exact_gate's gated blocks (the full ones) within ungated_room,
// and the ranked keys of permute_stop's segments (the preceding keys a segment's first row sees).
TEST(Geometry, WindowRangesMatchTheElementMask) {
  for (const bool causal : {true, false}) {
    for (const auto& [left, right] : std::vector<std::pair<int, int>>{{-1, -1}, {0, 0}, {3, -1}, {5, 0}, {9, 2},
                                                                       {-1, 4}, {17, 17}, {40, -1}, {1, 6}}) {
      for (const auto& [s_q, s_k] : std::vector<std::pair<std::int64_t, std::int64_t>>{
               {20, 20}, {7, 30}, {30, 9}, {1, 13}, {13, 1}, {25, 0}}) {
        for (const auto& [bq, bk] : std::vector<std::pair<int, int>>{{4, 4}, {5, 3}, {2, 8}}) {
         for (const int chunk : {0, 1, 4, 7, 13}) {
          BlockGeometry g = geo(s_q, s_k, causal, bq, bk);
          g.seq.window_left = left;
          g.seq.window_right = right;
          g.seq.chunk = chunk;
          const std::string what = std::to_string(s_q) + "x" + std::to_string(s_k) + (causal ? " causal" : "") +
                                   " window (" + std::to_string(left) + ", " + std::to_string(right) + ") chunk " +
                                   std::to_string(chunk) + " blocks " + std::to_string(bq) + "x" + std::to_string(bk);
          // FlashAttention's definition (hopper/test_util.py's construct_local_mask and
          // construct_chunk_mask): a's chunk starts at a - (a mod C), the remainder non-negative.
          const auto sees = [&](std::int64_t r, std::int64_t t) {
            const std::int64_t a = r + s_k - s_q;
            const std::int64_t c0 = chunk > 0 ? a - ((a % chunk) + chunk) % chunk : 0;
            return t >= 0 && t < s_k && (!causal || t <= a) && (left < 0 || t >= a - left) && (right < 0 || t <= a + right) &&
                   (chunk == 0 || (t >= c0 && t < c0 + chunk));
          };
          for (std::int64_t r = 0; r < s_q; ++r) {
            // The kernels' element mask: a row sees t iff first_key_at(a) <= t <= a + reach()
            // (no bound for reach -1) and t < s_k, with no empty-range rule of its own; under
            // chunks the kernels' 32-bit form of a's chunk and first key from an earlier row's
            // phase (every row of the call after row 0).
            const std::int64_t a = g.seq.position(r);
            if (chunk > 0) {
              const std::int64_t a0 = g.seq.position(0);
              const int phase = g.seq.chunk_phase(a0), i = static_cast<int>(r);
              ASSERT_EQ(a0 + g.seq.chunk_begin_after(phase, i), g.seq.chunk_begin(a)) << what << " row " << r;
              ASSERT_EQ(g.seq.first_key_after(a0, phase, i), g.seq.first_key_at(a)) << what << " row " << r;
            }
            for (std::int64_t t = 0; t < s_k; ++t) {
              ASSERT_EQ(g.seq.sees(r, t), sees(r, t)) << what << " row " << r << " key " << t;
              const bool masked_in = t >= g.seq.first_key_at(a) && (chunk > 0 ? t <= g.seq.last_key_at(a)
                                                                               : g.seq.reach() < 0 || t <= a + g.seq.reach());
              ASSERT_EQ(masked_in, sees(r, t)) << what << " row " << r << " key " << t;
            }
          }
          for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
            int first_visible = -1, last_visible = -1, first_full = -1, last_full = -1;
            for (int kb = 0; kb < g.num_k_blocks(); ++kb) {
              bool any = false, all = true;
              std::int64_t pairs = 0;
              for (std::int64_t r = g.row_begin(qb); r < g.row_end(qb); ++r) {
                for (std::int64_t t = g.key_begin(kb); t < g.key_end(kb); ++t) {
                  any |= sees(r, t);
                  all &= sees(r, t);
                  pairs += sees(r, t);
                }
              }
              ASSERT_EQ(g.is_visible(qb, kb), any) << what << " qb " << qb << " kb " << kb;
              ASSERT_EQ(g.is_full(qb, kb), all) << what << " qb " << qb << " kb " << kb;
              const int phase = chunk > 0 ? g.seq.chunk_phase(g.seq.position(g.row_begin(qb))) : 0;
              if (kb < g.full_end(qb)) ASSERT_EQ(g.full_below_end(qb, kb, phase), all) << what << " qb " << qb << " kb " << kb;
              ASSERT_EQ(g.visible_pairs(qb, kb), pairs) << what << " qb " << qb << " kb " << kb;
              if (any && first_visible < 0) first_visible = kb;
              if (any) last_visible = kb;
              if (all && first_full < 0) first_full = kb;
              if (all) last_full = kb;
            }
            // Gated iff full; without causal, when every visible block is full, but the last.
            bool all_full = first_visible >= 0;
            for (int kb = std::max(first_visible, 0); kb <= last_visible; ++kb) all_full &= g.is_full(qb, kb);
            for (int kb = 0; kb < g.num_k_blocks(); ++kb) {
              const bool gated = g.is_full(qb, kb) && !(!causal && all_full && kb == last_visible);
              ASSERT_EQ(sp::rules::gate_gated(g, qb, kb), gated) << what << " qb " << qb << " kb " << kb;
            }
            // The visible and full blocks are ranges; nothing visible leaves both empty.
            if (first_visible >= 0) {
              ASSERT_EQ(g.visible_begin(qb), first_visible) << what << " qb " << qb;
              ASSERT_EQ(g.visible_end(qb), last_visible + 1) << what << " qb " << qb;
            } else {
              ASSERT_EQ(g.visible_end(qb) - g.visible_begin(qb), 0) << what << " qb " << qb;
            }
            if (first_full >= 0) {
              ASSERT_EQ(g.full_begin(qb), first_full) << what << " qb " << qb;
              ASSERT_EQ(g.full_end(qb), last_full + 1) << what << " qb " << qb;
            }
            ASSERT_LE(g.visible_begin(qb), g.full_begin(qb)) << what << " qb " << qb;
            ASSERT_LE(g.full_begin(qb), g.full_end(qb)) << what << " qb " << qb;
            ASSERT_LE(g.full_end(qb), g.visible_end(qb)) << what << " qb " << qb;
            ASSERT_LE(g.visible_end(qb) - g.visible_begin(qb) - (g.gated_end(qb) - g.gated_begin(qb)), g.ungated_room())
                << what << " qb " << qb;
          }
          if (!causal) continue;
          const sp::geom::SegmentGeometry sg{g.seq, 6};
          for (std::int64_t seg = sg.first(); seg < sg.first() + sg.count(); ++seg) {
            std::int64_t first = sg.prefix(seg);
            for (std::int64_t t = sg.prefix(seg) - 1; t >= 0 && sees(sg.row_begin(seg), t); --t) first = t;
            ASSERT_EQ(sg.ranked_begin(seg), first) << what << " segment " << seg;
          }
         }
        }
      }
    }
  }
}

// permute_stop's segments (geom::SegmentGeometry, which the oracle, the CPU backend and the
// CUDA kernels read) against the definition (docs/semantics.md §3.6): segment s holds the call
// rows at absolute positions [s·len, (s+1)·len), rows at negative positions none; counted here
// row by row over square, chunked-prefill (s_q < s_k), empty-row (s_q > s_k) and empty shapes.
TEST(Geometry, SegmentsHoldTheRowsOfTheirPositions) {
  for (std::int64_t s_q : {0, 1, 15, 17, 100, 300}) {
    for (std::int64_t s_k : {0, 1, 16, 50, 300, 513}) {
      for (int len : {1, 7, 16, 128, 1000}) {
        const sp::geom::SeqGeometry seq{s_q, s_k, true};
        const sp::geom::SegmentGeometry sg{seq, len};
        const std::string what = std::to_string(s_q) + "x" + std::to_string(s_k) + " len " + std::to_string(len);
        std::int64_t unsegmented = 0, first = -1, last = -1;
        for (std::int64_t r = 0; r < s_q; ++r) {
          const std::int64_t a = r + s_k - s_q;
          if (a < 0) {
            ++unsegmented;
            continue;
          }
          const std::int64_t s = a / len;
          if (first < 0) first = s;
          last = s;
          EXPECT_GE(r, sg.row_begin(s)) << what << " row " << r;
          EXPECT_LT(r, sg.row_end(s)) << what << " row " << r;
        }
        EXPECT_EQ(sg.first_row(), unsegmented) << what;
        ASSERT_EQ(sg.count(), first < 0 ? 0 : last - first + 1) << what;
        if (sg.count() == 0) continue;
        EXPECT_EQ(sg.first(), first) << what;
        EXPECT_EQ(sg.last(), last) << what;
        for (std::int64_t s = first; s <= last; ++s) {
          EXPECT_LT(sg.row_begin(s), sg.row_end(s)) << what << " segment " << s;  // every segment holds rows
          if (s > first) EXPECT_EQ(sg.row_begin(s), sg.row_end(s - 1)) << what << " segment " << s;
          EXPECT_EQ(sg.prefix(s), s * len) << what << " segment " << s;  // its rows see every earlier key
          EXPECT_EQ(sg.key_end(s), std::min<std::int64_t>((s + 1) * len, s_k)) << what << " segment " << s;
        }
        EXPECT_EQ(sg.row_begin(first), sg.first_row()) << what;
        EXPECT_EQ(sg.row_end(last), s_q) << what;
      }
    }
  }
}

// The forward grid's two orders: each visits every (unit, sequence, row tile) exactly once, and
// both start with the last row tiles. Query heads fastest: the first units · batch CTAs are
// row tile 0 of every unit. KV-major: the first units_per_kv · batch · tiles CTAs are KV head
// 0's, their row tiles never decreasing; packed tiles (units_per_kv 1) go by unit alone.
TEST(Geometry, GridTileOrdersCoverEveryTileOnce) {
  struct Grid {
    int units, per_kv, batch, tiles;
  };
  for (const Grid gr : {Grid{8, 4, 3, 5}, Grid{9, 3, 1, 64}, Grid{2, 1, 2, 7}, Grid{1, 1, 1, 1}}) {
    for (const bool kv_major : {false, true}) {
      const int n = gr.units * gr.batch * gr.tiles;
      std::vector<int> seen(static_cast<std::size_t>(n), 0);
      for (int i = 0; i < n; ++i) {
        const sp::geom::GridTile t = sp::geom::grid_tile(i, gr.units, gr.per_kv, gr.batch, gr.tiles, kv_major);
        const std::string what = "kv_major " + std::to_string(kv_major) + " units " + std::to_string(gr.units) +
                                 " index " + std::to_string(i);
        ASSERT_TRUE(t.unit >= 0 && t.unit < gr.units && t.b >= 0 && t.b < gr.batch && t.tile_rev >= 0 &&
                    t.tile_rev < gr.tiles)
            << what;
        ++seen[static_cast<std::size_t>((t.tile_rev * gr.batch + t.b) * gr.units + t.unit)];
        if (!kv_major && i < gr.units * gr.batch) EXPECT_EQ(t.tile_rev, 0) << what;
        if (kv_major) {
          EXPECT_EQ(t.unit / gr.per_kv, i / (gr.per_kv * gr.batch * gr.tiles)) << what;
          EXPECT_EQ(t.tile_rev, i / (gr.per_kv * gr.batch) % gr.tiles) << what;
        }
      }
      EXPECT_EQ(std::count(seen.begin(), seen.end(), 1), n) << "kv_major " << kv_major;
    }
  }
}

// A tiny batched problem over owned host storage.
struct Tiny {
  std::vector<float> q, k, v, o, lse;
  sp::AttentionProblem p;
  sp::AttentionOutput out;
  Tiny(int b, int s_q, int s_k, int h_q, int h_kv, int d) {
    q.assign(static_cast<std::size_t>(b * s_q * h_q * d), 0.25f);
    k.assign(static_cast<std::size_t>(b * s_k * h_kv * d), 0.5f);
    v.assign(k.size(), -0.75f);
    o.assign(q.size(), 0.0f);
    lse.assign(static_cast<std::size_t>(b * h_q * s_q), 0.0f);
    p.q = sp::TensorView::contiguous(q.data(), sp::DType::kFP32, {b, s_q, h_q, d});
    p.k = sp::TensorView::contiguous(k.data(), sp::DType::kFP32, {b, s_k, h_kv, d});
    p.v = sp::TensorView::contiguous(v.data(), sp::DType::kFP32, {b, s_k, h_kv, d});
    out.o = sp::TensorView::contiguous(o.data(), sp::DType::kFP32, {b, s_q, h_q, d});
    out.lse = sp::TensorView::contiguous(lse.data(), sp::DType::kFP32, {b, h_q, s_q});
  }
};

void expect_error(const sp::Status& st, const char* fragment) {
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find(fragment), std::string::npos) << "message: " << st.message();
}

TEST(Validate, AcceptsBatchedProblem) {
  Tiny t(2, 5, 7, 4, 2, 8);
  sp::ProblemShape s;
  ASSERT_TRUE(sp::validate_problem(t.p, &t.out, &s).ok());
  EXPECT_EQ(s.batch, 2);
  EXPECT_EQ(s.group(), 2);
  EXPECT_EQ(s.seq_k[1], 7);
  EXPECT_DOUBLE_EQ(s.scale, 1.0 / std::sqrt(8.0));
}

TEST(Validate, EveryBadInputNamesItsArgument) {
  sp::ProblemShape s;
  {
    Tiny t(1, 4, 4, 3, 2, 8);
    expect_error(sp::validate_problem(t.p, &t.out, &s), "h_kv (2) must divide h_q (3)");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.k.shape[3] = 4;
    t.p.v.shape[3] = 4;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "k: expected head_dim 8");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.v.dtype = sp::DType::kBF16;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "k, v: expected q's dtype");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.q.stride[3] = 2;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "q: the last dimension");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.scale = std::nan("");
    expect_error(sp::validate_problem(t.p, &t.out, &s), "scale");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.out.lse.shape[2] = 3;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "lse: expected fp32 [b, h_q, s_q]");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.out.o.dtype = sp::DType::kFP16;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "o: expected q's dtype");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.k.device = {sp::DeviceKind::kCUDA, 0};
    expect_error(sp::validate_problem(t.p, &t.out, &s), "expected one device");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.q.rank = 2;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "q: expected");
  }
}

// The local window, sinks, softcap and v's own head dim: accepted in range, and every bad
// value refused with its argument named.
TEST(Validate, WindowSinksSoftcapAndValueHeadDim) {
  sp::ProblemShape s;
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.window_left = 3;
    t.p.window_right = 0;
    t.p.softcap = 30.0;
    std::vector<float> sinks = {0.5f, -1.0f, 2.0f, std::numeric_limits<float>::quiet_NaN()};  // NaN is a value, not an error
    t.p.sinks = sp::TensorView::contiguous(sinks.data(), sp::DType::kFP32, {4});
    ASSERT_TRUE(sp::validate_problem(t.p, &t.out, &s).ok());
    EXPECT_EQ(s.window_left, 3);
    EXPECT_EQ(s.window_right, 0);
    EXPECT_TRUE(s.local());
    EXPECT_TRUE(s.sinks);
    EXPECT_EQ(s.softcap, 30.0);
    EXPECT_EQ(s.d_v, 8);
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.window_right = 0;  // causal already ends each row there: not local
    ASSERT_TRUE(sp::validate_problem(t.p, &t.out, &s).ok());
    EXPECT_FALSE(s.local());
    t.p.causal = false;
    ASSERT_TRUE(sp::validate_problem(t.p, &t.out, &s).ok());
    EXPECT_TRUE(s.local());
  }
  for (const int w : {-2, -100}) {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.window_left = w;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "window_left: expected -1 (no bound) or a number of keys >= 0");
    t.p.window_left = -1;
    t.p.window_right = w;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "window_right: expected -1");
  }
  for (const double c : {-1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    Tiny t(1, 4, 4, 4, 2, 8);
    t.p.softcap = c;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "softcap: expected 0 (none) or a finite positive number");
  }
  {
    Tiny t(1, 4, 4, 4, 2, 8);
    std::vector<float> sinks(8, 0.0f);
    t.p.sinks = sp::TensorView::contiguous(sinks.data(), sp::DType::kFP32, {3});
    expect_error(sp::validate_problem(t.p, &t.out, &s), "sinks: expected fp32 [h_q] = [4]");
    t.p.sinks = sp::TensorView::contiguous(sinks.data(), sp::DType::kFP32, {2, 4});
    expect_error(sp::validate_problem(t.p, &t.out, &s), "sinks: expected fp32 [h_q] = [4]");
    t.p.sinks = sp::TensorView::contiguous(sinks.data(), sp::DType::kBF16, {4});
    expect_error(sp::validate_problem(t.p, &t.out, &s), "sinks: expected fp32 [h_q] = [4], got [4] bf16");
    t.p.sinks = sp::TensorView::contiguous(sinks.data(), sp::DType::kFP32, {4}, {sp::DeviceKind::kCUDA, 0});
    expect_error(sp::validate_problem(t.p, &t.out, &s), "sinks: expected q's device");
    t.p.sinks = sp::TensorView::contiguous(nullptr, sp::DType::kFP32, {4});
    expect_error(sp::validate_problem(t.p, &t.out, &s), "sinks: null data pointer");
  }
  {
    // v [1, 4, 2, 6] beside k [1, 4, 2, 8]: d_v = 6, and O must have it.
    Tiny t(1, 4, 4, 4, 2, 8);
    std::vector<float> v(4 * 2 * 6, 0.5f), o(4 * 4 * 6, 0.0f);
    t.p.v = sp::TensorView::contiguous(v.data(), sp::DType::kFP32, {1, 4, 2, 6});
    expect_error(sp::validate_problem(t.p, &t.out, &s), "o: expected q's shape with v's head_dim 6 last [1, 4, 4, 6]");
    t.out.o = sp::TensorView::contiguous(o.data(), sp::DType::kFP32, {1, 4, 4, 6});
    ASSERT_TRUE(sp::validate_problem(t.p, &t.out, &s).ok());
    EXPECT_EQ(s.d, 8);
    EXPECT_EQ(s.d_v, 6);
    EXPECT_DOUBLE_EQ(s.scale, 1.0 / std::sqrt(8.0));  // the default scale is q's head dim's
    t.p.v.shape[2] = 1;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "v: expected the shape of k [1, 4, 2, 8] (any last dimension d_v)");
    t.p.v.shape[2] = 2;
    t.p.v.shape[3] = 0;
    expect_error(sp::validate_problem(t.p, &t.out, &s), "v: head_dim d_v must be positive");
  }
}

TEST(Validate, VarlenAndPagedIndexTensors) {
  // Varlen q [6, 2, 4] and k [9, 1, 4]: two sequences.
  std::vector<float> q(6 * 2 * 4, 0.5f), k(9 * 4, 0.25f), v(9 * 4, 0.75f);
  std::vector<std::int32_t> cu_q = {0, 2, 6}, cu_k = {0, 4, 9};
  sp::AttentionProblem p;
  p.q = sp::TensorView::contiguous(q.data(), sp::DType::kFP32, {6, 2, 4});
  p.k = sp::TensorView::contiguous(k.data(), sp::DType::kFP32, {9, 1, 4});
  p.v = sp::TensorView::contiguous(v.data(), sp::DType::kFP32, {9, 1, 4});
  p.cu_seqlens_q = sp::TensorView::contiguous(cu_q.data(), sp::DType::kInt32, {3});
  p.cu_seqlens_k = sp::TensorView::contiguous(cu_k.data(), sp::DType::kInt32, {3});
  sp::ProblemShape s;
  ASSERT_TRUE(sp::validate_problem(p, nullptr, &s).ok());
  EXPECT_EQ(s.seq_q[1], 4);
  EXPECT_EQ(s.k_start[1], 4);
  cu_q = {0, 4, 2};
  expect_error(sp::validate_problem(p, nullptr, &s), "cu_seqlens_q: must be non-decreasing");
  cu_q = {0, 2, 7};
  expect_error(sp::validate_problem(p, nullptr, &s), "exceeds the 6 rows");
  cu_q = {1, 2, 6};
  expect_error(sp::validate_problem(p, nullptr, &s), "must start at 0");
  cu_q = {0, 2, 6};
  p.cu_seqlens_k = {};
  expect_error(sp::validate_problem(p, nullptr, &s), "k: expected cu_seqlens_k");

  // Paged: 3 pages of 4 keys; sequence 0 uses 5 keys (2 pages), sequence 1 uses 3 (1 page).
  std::vector<float> kp(3 * 4 * 4, 0.5f), vp(kp.size(), 0.25f);
  std::vector<std::int32_t> table = {2, 0, 1, 7}, used = {5, 3};
  p.k = sp::TensorView::contiguous(kp.data(), sp::DType::kFP32, {3, 4, 1, 4});
  p.v = sp::TensorView::contiguous(vp.data(), sp::DType::kFP32, {3, 4, 1, 4});
  p.block_table = sp::TensorView::contiguous(table.data(), sp::DType::kInt32, {2, 2});
  expect_error(sp::validate_problem(p, nullptr, &s), "seqused_k: required");
  p.seqused_k = sp::TensorView::contiguous(used.data(), sp::DType::kInt32, {2});
  ASSERT_TRUE(sp::validate_problem(p, nullptr, &s).ok()) << sp::validate_problem(p, nullptr, &s).message();
  EXPECT_EQ(s.kv_layout, sp::KvLayout::kPaged);
  used = {5, 5};  // sequence 1 now needs its second page, 7, which does not exist
  expect_error(sp::validate_problem(p, nullptr, &s), "block_table[1][1]: page 7 out of range");
  used = {9, 3};
  expect_error(sp::validate_problem(p, nullptr, &s), "seqused_k[0]: expected 0..8");
}

sp::ProblemShape shape_of(int b, std::int64_t s_q, std::int64_t s_k, int h_q, int h_kv, bool causal) {
  sp::ProblemShape s;
  s.batch = b;
  s.h_q = h_q;
  s.h_kv = h_kv;
  s.d = 8;
  s.causal = causal;
  s.seq_q.assign(static_cast<std::size_t>(b), s_q);
  s.seq_k.assign(static_cast<std::size_t>(b), s_k);
  return s;
}

TEST(BlockMaskTest, AllVisibleMatchesGeometryAndValidates) {
  const sp::ProblemShape s = shape_of(2, 10, 10, 2, 1, true);
  const sp::BlockMask m = sp::BlockMask::all_visible(s, 4, 4, false);
  ASSERT_TRUE(m.validate_for(s).ok()) << m.validate_for(s).message();
  EXPECT_EQ(m.full_count[static_cast<std::size_t>(m.row(1, 1, 2))], 2);
  EXPECT_EQ(m.partial_count[static_cast<std::size_t>(m.row(1, 1, 2))], 1);
  EXPECT_EQ(m.selected_blocks(), 2 * 2 * (1 + 2 + 3));
}

TEST(BlockMaskTest, DenseAndCsrRoundTrip) {
  const sp::ProblemShape s = shape_of(1, 13, 21, 4, 2, true);
  sp::BlockMask m = sp::BlockMask::empty(s, 4, 4, true);
  ASSERT_TRUE(m.add(s, 0, 1, 3, 2).ok());
  ASSERT_TRUE(m.add(s, 0, 1, 3, 5).ok());  // full: query block 3 is row 12 alone, seeing every key
  ASSERT_TRUE(m.add(s, 0, 0, 0, 0).ok());
  ASSERT_TRUE(m.add(s, 0, 0, 0, 0).ok());  // idempotent
  EXPECT_FALSE(m.add(s, 0, 0, 0, 5).ok()); // query block 0 (positions 8..11) cannot see keys 20+
  ASSERT_TRUE(m.validate_for(s).ok());
  sp::BlockMask from_dense;
  ASSERT_TRUE(sp::BlockMask::from_dense(s, 4, 4, true, m.to_dense(), &from_dense).ok());
  EXPECT_EQ(from_dense.to_dense(), m.to_dense());
  EXPECT_EQ(from_dense.full_index, m.full_index);
  std::vector<std::int32_t> indptr, indices;
  m.to_csr(&indptr, &indices);
  EXPECT_EQ(indices.size(), 3u);
  sp::BlockMask from_csr;
  ASSERT_TRUE(sp::BlockMask::from_csr(s, 4, 4, true, indptr, indices, &from_csr).ok());
  EXPECT_EQ(from_csr.partial_index, m.partial_index);
  EXPECT_TRUE(from_csr.contains(0, 1, 3, 5));
  EXPECT_FALSE(from_csr.contains(0, 1, 3, 4));
}

TEST(BlockMaskTest, ValidateRejectsBrokenMasks) {
  const sp::ProblemShape s = shape_of(1, 8, 8, 1, 1, true);
  sp::BlockMask m = sp::BlockMask::all_visible(s, 4, 4, false);
  sp::BlockMask bad = m;
  const auto r1 = static_cast<std::size_t>(bad.row(0, 0, 1));
  bad.full_index[r1 * 2] = 1;  // block 1 of query block 1 listed as full, but the mask cuts it
  bad.partial_index[r1 * 2] = -1;
  bad.partial_count[r1] = 0;
  expect_error(bad.validate_for(s), "is partial");
  bad = m;
  bad.partial_index[static_cast<std::size_t>(bad.row(0, 0, 1) * bad.num_k_blocks)] = 0;  // overlaps full
  expect_error(bad.validate(), "both full and partial");
  bad = m;
  bad.partial_count[0] = 5;
  expect_error(bad.validate(), "outside [0, 2]");
  bad = m;
  bad.full_count.pop_back();
  expect_error(bad.validate(), "counts must have");
  std::vector<std::uint8_t> map(4, 1);  // selects block (0, 1): invisible
  sp::BlockMask out;
  expect_error(sp::BlockMask::from_dense(s, 4, 4, false, map, &out), "not visible");
  // indptr that jumps past the index list before coming back must fail before any read.
  expect_error(sp::BlockMask::from_csr(s, 4, 4, false, {0, 100, 2}, {0, 1}, &out), "non-decreasing");
}

TEST(PolicyParse, ValidAndInvalidSettings) {
  sp::Policy p;
  ASSERT_TRUE(sp::parse_policy("estimate_select", {{"alpha", "0.25"}, {"mean_correction", "true"}, {"tail", "0"}}, &p).ok());
  const auto& e = std::get<sp::EstimateSelectParams>(p);
  EXPECT_DOUBLE_EQ(e.alpha, 0.25);
  EXPECT_TRUE(e.mean_correction);
  EXPECT_EQ(e.tail, 0);
  EXPECT_NE(sp::describe(p).find("alpha=0.25"), std::string::npos);
  expect_error(sp::parse_policy("nope", {}, &p), "unknown name 'nope'");
  expect_error(sp::parse_policy("softmax_skip", {{"b", "1"}}, &p), "unknown parameter 'b'");
  expect_error(sp::parse_policy("softmax_skip", {{"a", "nan"}}, &p), "a: expected a finite number");
  expect_error(sp::parse_policy("softmax_skip", {{"a", "inf"}}, &p), "a: expected a finite number");
  expect_error(sp::parse_policy("softmax_skip", {{"a", "-1"}}, &p), "a: expected a finite positive");
  expect_error(sp::parse_policy("permute_stop", {{"segment", "12x"}}, &p), "segment: expected an integer");
  expect_error(sp::parse_policy("exact_gate", {{"block_q", "0"}}, &p), "block_q: expected a positive block size");
  expect_error(sp::parse_policy("estimate_select", {{"pack_gqa", "maybe"}}, &p), "pack_gqa: expected true/false");
  ASSERT_TRUE(sp::parse_policy("exact_gate", {}, &p).ok());
  expect_error(sp::validate_policy(p), "thresholds: required");
}

TEST(Stats, DenseCausalCountsEveryVisiblePair) {
  const sp::ProblemShape s = shape_of(1, 10, 10, 2, 1, true);
  sp::Decisions d;
  d.kept = sp::BlockMask::all_visible(s, 4, 4, false);
  const sp::RunStats st = sp::detail::stats_from_decisions(s, sp::DenseParams{}, d);
  ASSERT_EQ(st.heads.size(), 2u);
  EXPECT_EQ(st.heads[0].visible_pairs, 55);  // 1 + 2 + ... + 10
  EXPECT_EQ(st.heads[0].computed_pairs, 55);
  EXPECT_EQ(st.heads[0].visible_blocks, 6);
  EXPECT_DOUBLE_EQ(st.density(), 1.0);
  // Dropping block (qb 2, kb 0), full: 2 rows × 4 keys.
  sp::Decisions half;
  half.kept = sp::BlockMask::empty(s, 4, 4, false);
  for (int h = 0; h < 2; ++h) {
    for (int qb = 0; qb < 3; ++qb) {
      for (int kb = 0; kb <= qb; ++kb) {
        if (!(qb == 2 && kb == 0)) ASSERT_TRUE(half.kept.add(s, 0, h, qb, kb).ok());
      }
    }
  }
  const sp::RunStats st2 = sp::detail::stats_from_decisions(s, sp::DenseParams{}, half);
  EXPECT_EQ(st2.heads[1].computed_pairs, 55 - 8);
  EXPECT_DOUBLE_EQ(st2.density(), 5.0 / 6.0);
}

}  // namespace
