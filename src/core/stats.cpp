// SPDX-License-Identifier: Apache-2.0
// RunStats from decisions: visible/kept blocks and pairs per (batch, query head).
#include "core/stats.h"

#include <algorithm>
#include <string>
#include <type_traits>

#include "core/geometry.h"
#include "core/shape_geometry.h"

namespace sparseprefill {

namespace {
double ratio(std::int64_t num, std::int64_t den) { return den > 0 ? static_cast<double>(num) / static_cast<double>(den) : 1.0; }
}  // namespace

std::string ExecutionInfo::to_string() const {
  std::string s = path.empty() ? std::string(backend_name(backend)) : path;
  if (!instance.empty()) s += " " + instance;
  if (!decision_instance.empty()) s += " after " + decision_instance;
  if (passes != 1) s += ", " + std::to_string(passes) + " passes";
  if (q_pack != 1) s += ", " + std::to_string(q_pack) + " heads per tile";
  if (kv_staged) s += ", K/V staged";
  if (kv_major) s += ", KV-major grid";
  if (grid > 0) s += ", grid " + std::to_string(grid);
  if (scratch_bytes > 0) s += ", scratch " + std::to_string(scratch_bytes) + " B";
  return s;
}

double RunStats::density() const {
  std::int64_t kept = 0, visible = 0;
  for (const HeadStats& h : heads) { kept += h.kept_blocks; visible += h.visible_blocks; }
  return ratio(kept, visible);
}

double RunStats::pair_density() const {
  std::int64_t kept = 0, visible = 0;
  for (const HeadStats& h : heads) { kept += h.computed_pairs; visible += h.visible_pairs; }
  return ratio(kept, visible);
}

double RunStats::head_density(int b, int h) const {
  const HeadStats& s = heads[static_cast<std::size_t>(b) * h_q + h];
  return ratio(s.kept_blocks, s.visible_blocks);
}

namespace detail {
namespace {

// Pairs of (qb, kb) the causal mask and the window allow; closed form for full blocks.
std::int64_t block_pairs(const geom::BlockGeometry& g, int qb, int kb) {
  if (g.is_full(qb, kb)) return (g.row_end(qb) - g.row_begin(qb)) * (g.key_end(kb) - g.key_begin(kb));
  return g.visible_pairs(qb, kb);
}

std::int64_t row_pairs(const geom::SeqGeometry& seq) {
  std::int64_t n = 0;
  for (std::int64_t r = 0; r < seq.s_q; ++r) n += seq.keys_in(seq.position(r), 0, seq.s_k);
  return n;
}

// `kept` is the decisions' mask, or block_sparse's own mask when the backend recorded none.
void block_policy_stats(const ProblemShape& s, const BlockMask& kept, const BlockMask& corrected, RunStats* out) {
  const bool have_mask = kept.batch == s.batch && kept.num_q_blocks > 0;
  const int bq = have_mask ? kept.block_q : 128, bk = have_mask ? kept.block_k : 128;
  const bool have_corrected = corrected.batch == s.batch && corrected.num_q_blocks > 0;
  for (int b = 0; b < s.batch; ++b) {
    const geom::BlockGeometry g = detail::block_geometry(s, b, bq, bk);
    const std::int64_t pairs = row_pairs(g.seq);
    std::int64_t visible = 0;
    for (int qb = 0; qb < g.num_q_blocks(); ++qb) visible += g.visible_end(qb) - g.visible_begin(qb);
    for (int h = 0; h < s.h_q; ++h) {
      HeadStats& hs = out->heads[static_cast<std::size_t>(b) * s.h_q + h];
      hs.visible_blocks = visible;
      hs.visible_pairs = pairs;
      if (!have_mask) {  // dense without recorded decisions: everything visible was computed
        hs.kept_blocks = visible;
        hs.computed_pairs = pairs;
        continue;
      }
      const int mh = kept.per_kv_head ? h / s.group() : h;
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        const std::int64_t r = kept.row(b, mh, qb);
        const std::size_t base = static_cast<std::size_t>(r) * kept.num_k_blocks;
        const std::int32_t nf = kept.full_count[static_cast<std::size_t>(r)];
        const std::int32_t np = kept.partial_count[static_cast<std::size_t>(r)];
        hs.kept_blocks += nf + np;
        for (int i = 0; i < nf; ++i) hs.computed_pairs += block_pairs(g, qb, kept.full_index[base + i]);
        for (int i = 0; i < np; ++i) hs.computed_pairs += block_pairs(g, qb, kept.partial_index[base + i]);
        if (have_corrected) {
          const int ch = corrected.per_kv_head ? h / s.group() : h;
          const std::int64_t cr = corrected.row(b, ch, qb);
          hs.corrected_blocks += corrected.full_count[static_cast<std::size_t>(cr)] +
                                 corrected.partial_count[static_cast<std::size_t>(cr)];
        }
      }
    }
  }
}

// permute_stop: a "block" is one tile × one key chunk of block_k keys. Pass 1 counts the
// chunks covering the segment's keys; pass 2 the ranked chunks. Pass 2's pairs are each row's
// visited keys; under a left window bound, min(visited keys, the ranked keys the row sees): which
// ranked keys a chunk holds is not in the decisions, so this is an upper bound there (exact
// without a window, where every row sees every ranked key).
void permute_stop_stats(const ProblemShape& s, const PermuteStopParams& p, const Decisions& d, RunStats* out) {
  for (int b = 0; b < s.batch; ++b) {
    const std::int64_t pairs = row_pairs(detail::sequence_geometry(s, b));
    for (int h = 0; h < s.h_q; ++h) out->heads[static_cast<std::size_t>(b) * s.h_q + h].visible_pairs = pairs;
  }
  const std::int64_t slots = s.max_seq_q();
  for (const PermuteTile& t : d.tiles) {
    const geom::SegmentGeometry segs{detail::sequence_geometry(s, t.batch), p.segment};
    const std::int64_t row0 = segs.row_begin(t.segment), row1 = segs.row_end(t.segment);
    const std::int64_t e0 = row0 + static_cast<std::int64_t>(t.tile) * p.block_q;
    const std::int64_t e1 = std::min<std::int64_t>(e0 + p.block_q, row1);
    const std::int64_t prefix = segs.prefix(t.segment), ranked = prefix - segs.ranked_begin(t.segment);
    const std::int64_t visited = std::min<std::int64_t>(static_cast<std::int64_t>(t.chunks_visited) * p.block_k, ranked);
    const std::int64_t seg_keys = segs.key_end(t.segment) - prefix;
    const std::int64_t pass1_chunks = geom::ceil_div(seg_keys, p.block_k);
    HeadStats& hs = out->heads[static_cast<std::size_t>(t.batch) * s.h_q + t.head];
    hs.visible_blocks += t.chunks_total + pass1_chunks;
    hs.kept_blocks += t.chunks_visited + pass1_chunks;
    // The tile's rows are the rows its slots hold (query_order, which every backend records).
    const std::int32_t* order = d.query_order.data() + (static_cast<std::int64_t>(t.batch) * s.h_q + t.head) * slots;
    for (std::int64_t e = e0; e < e1; ++e) {
      const std::int64_t a = segs.seq.position(order[e]);
      hs.computed_pairs += std::min(visited, segs.seq.keys_in(a, 0, prefix));
    }
  }
  // Pass 1 pairs: every row attends causally to the keys of its segment it sees.
  for (int b = 0; b < s.batch; ++b) {
    const geom::SeqGeometry seq = detail::sequence_geometry(s, b);
    std::int64_t pass1 = 0;
    for (std::int64_t r = 0; r < seq.s_q; ++r) {
      const std::int64_t a = seq.position(r);
      if (a < 0) continue;
      pass1 += seq.keys_in(a, geom::floor_div(a, p.segment) * p.segment, seq.s_k);
    }
    for (int h = 0; h < s.h_q; ++h) out->heads[static_cast<std::size_t>(b) * s.h_q + h].computed_pairs += pass1;
  }
}

}  // namespace

RunStats stats_from_decisions(const ProblemShape& shape, const Policy& policy, const Decisions& decisions) {
  RunStats out;
  out.batch = shape.batch;
  out.h_q = shape.h_q;
  out.heads.assign(static_cast<std::size_t>(shape.batch) * shape.h_q, HeadStats{});
  if (const auto* p = std::get_if<PermuteStopParams>(&policy)) {
    permute_stop_stats(shape, *p, decisions, &out);
  } else {
    const auto* mask_policy = std::get_if<BlockSparseParams>(&policy);
    const bool recorded = decisions.kept.batch == shape.batch && decisions.kept.num_q_blocks > 0;
    block_policy_stats(shape, (mask_policy != nullptr && !recorded) ? mask_policy->mask : decisions.kept,
                       decisions.corrected, &out);
  }
  return out;
}

}  // namespace detail
}  // namespace sparseprefill
