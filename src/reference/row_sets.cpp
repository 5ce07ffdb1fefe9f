// SPDX-License-Identifier: Apache-2.0
// Decision checking and expansion into per-row key sets (see row_sets.h).
#include "reference/row_sets.h"

#include <string>
#include <type_traits>
#include <variant>

#include "core/estimate_chunks.h"
#include "core/rules/estimate_select.h"
#include "core/rules/permute_stop.h"
#include "core/shape_geometry.h"

namespace sparseprefill::ref {
namespace {

Status check_mask(const char* name, const BlockMask& m, const ProblemShape& shape, int block_q,
                  int block_k, bool per_kv_head) {
  if (m.block_q != block_q || m.block_k != block_k || m.per_kv_head != per_kv_head) {
    return invalid_argument(std::string(name) + ": expected " + std::to_string(block_q) + "x" +
                            std::to_string(block_k) + " blocks per " + (per_kv_head ? "KV" : "query") +
                            " head, got " + std::to_string(m.block_q) + "x" + std::to_string(m.block_k) +
                            " per " + (m.per_kv_head ? "KV" : "query") + " head");
  }
  const Status s = m.validate_for(shape);
  if (!s.ok()) return {s.code(), std::string(name) + ": " + s.message()};
  return {};
}

// estimate_select: corrected blocks are pruned (not kept) and wholly seen by the tile's first row.
Status check_corrected(const ProblemShape& shape, const Decisions& d) {
  const BlockMask& c = d.corrected;
  for (int b = 0; b < c.batch; ++b) {
    const geom::BlockGeometry g{detail::sequence_geometry(shape, b), c.block_q, c.block_k};
    for (int h = 0; h < c.heads; ++h) {
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        const std::int64_t row = c.row(b, h, qb);
        const std::size_t base = static_cast<std::size_t>(row * c.num_k_blocks);
        for (std::int32_t i = 0; i < c.full_count[static_cast<std::size_t>(row)]; ++i) {
          const int kb = c.full_index[base + static_cast<std::size_t>(i)];
          if (d.kept.contains(b, h, qb, kb) ||
              !rules::estimate_correctable(g, g.seq.position(g.row_begin(qb)), kb)) {
            return invalid_argument("decisions.corrected: block " + std::to_string(kb) + " of row [" +
                                    std::to_string(b) + "][" + std::to_string(h) + "][" + std::to_string(qb) +
                                    "] is kept or not wholly visible to the tile's first row");
          }
        }
        if (c.partial_count[static_cast<std::size_t>(row)] != 0) {
          return invalid_argument("decisions.corrected: partial blocks cannot be corrected (row [" +
                                  std::to_string(b) + "][" + std::to_string(h) + "][" + std::to_string(qb) + "])");
        }
      }
    }
  }
  return {};
}

Status check_permute(const ProblemShape& shape, const PermuteStopParams& p, const Decisions& d) {
  const std::int64_t slots = shape.max_seq_q();
  if (static_cast<std::int64_t>(d.query_order.size()) != shape.batch * shape.h_q * slots) {
    return invalid_argument("decisions.query_order: expected [b, h_q, max s_q] = " +
                            std::to_string(shape.batch * shape.h_q * slots) + " entries, got " +
                            std::to_string(d.query_order.size()));
  }
  std::size_t next = 0;  // the tile record expected next
  for (int b = 0; b < shape.batch; ++b) {
    const geom::SeqGeometry geo = detail::sequence_geometry(shape, b);
    const geom::SegmentGeometry sg{geo, p.segment};
    for (int h = 0; h < shape.h_q; ++h) {
      const std::int32_t* order = d.query_order.data() + (b * shape.h_q + h) * slots;
      std::vector<char> seen(static_cast<std::size_t>(geo.s_q), 0);
      for (std::int64_t slot = 0; slot < slots; ++slot) {
        const std::int64_t r = order[slot];
        const bool ok = slot >= geo.s_q
            ? r == -1
            : r >= 0 && r < geo.s_q && !seen[static_cast<std::size_t>(r)] &&
                  rules::segment_of(sg, r) == rules::segment_of(sg, slot);
        if (!ok) {
          return invalid_argument("decisions.query_order: slot " + std::to_string(slot) + " of [" +
                                  std::to_string(b) + "][" + std::to_string(h) + "] holds " + std::to_string(r) +
                                  ", expected a row of the slot's segment not listed before (or -1 past the end)");
        }
        if (slot < geo.s_q) seen[static_cast<std::size_t>(r)] = 1;
      }
      for (std::int64_t s = sg.first(); s < sg.first() + sg.count(); ++s) {
        const std::int64_t chunks = rules::permute_chunks(sg, s, p.block_k);
        for (std::int64_t t = 0; t < rules::permute_tiles(sg, s, p.block_q); ++t, ++next) {
          const bool ok = next < d.tiles.size() && d.tiles[next].batch == b && d.tiles[next].head == h &&
                          d.tiles[next].segment == s && d.tiles[next].tile == t &&
                          d.tiles[next].chunks_total == chunks && d.tiles[next].chunks_visited >= 0 &&
                          d.tiles[next].chunks_visited <= chunks;
          if (!ok) {
            return invalid_argument("decisions.tiles: entry " + std::to_string(next) + " expected batch " +
                                    std::to_string(b) + " head " + std::to_string(h) + " segment " +
                                    std::to_string(s) + " tile " + std::to_string(t) + " with chunks_total " +
                                    std::to_string(chunks) + " and 0 <= chunks_visited <= chunks_total");
          }
        }
      }
    }
  }
  if (next != d.tiles.size()) {
    return invalid_argument("decisions.tiles: expected " + std::to_string(next) + " entries, got " +
                            std::to_string(d.tiles.size()));
  }
  return {};
}

}  // namespace

Status check_decisions(const ProblemShape& shape, const Policy& policy, const Decisions& d) {
  if (d.policy != policy_name(policy)) {
    return invalid_argument(std::string("decisions.policy: expected \"") + policy_name(policy) + "\", got \"" +
                            d.policy + "\"");
  }
  return std::visit([&](const auto& p) -> Status {
    using P = std::decay_t<decltype(p)>;
    if constexpr (std::is_same_v<P, DenseParams>) {
      return {};
    } else if constexpr (std::is_same_v<P, BlockSparseParams>) {
      return check_mask("decisions.kept", d.kept, shape, p.mask.block_q, p.mask.block_k, p.mask.per_kv_head);
    } else if constexpr (std::is_same_v<P, ExactGateParams> || std::is_same_v<P, SoftmaxSkipParams>) {
      return check_mask("decisions.kept", d.kept, shape, p.block_q, p.block_k, false);
    } else if constexpr (std::is_same_v<P, EstimateSelectParams>) {
      SP_RETURN_IF_ERROR(check_mask("decisions.kept", d.kept, shape, p.block, p.block, p.pack_gqa));
      if (!p.mean_correction) return {};
      SP_RETURN_IF_ERROR(check_mask("decisions.corrected", d.corrected, shape, p.block, p.block, p.pack_gqa));
      return check_corrected(shape, d);
    } else {
      return check_permute(shape, p, d);
    }
  }, policy);
}

void RowSets::init(const Sequence& seq, const ProblemShape& shape, const Policy& policy,
                   const Decisions& decisions) {
  seq_ = &seq;
  decisions_ = &decisions;
  has_means_ = false;
  if (std::holds_alternative<DenseParams>(policy)) {
    kind_ = Kind::kDense;
    return;
  }
  const auto* p = std::get_if<PermuteStopParams>(&policy);
  if (p == nullptr) {
    kind_ = Kind::kBlocks;
    const auto* es = std::get_if<EstimateSelectParams>(&policy);
    if (es != nullptr && es->mean_correction) {
      has_means_ = true;
      detail::EstimateChunks chunks;
      const Status st = detail::read_estimate_chunks(*es, shape, &chunks);
      // attend_decisions has validated the policy for the problem (check_policy_for).
      means_ = block_means(seq, *es, st.ok() ? chunks.valid[static_cast<std::size_t>(seq.batch)] : 0);
    }
    return;
  }
  kind_ = Kind::kPermute;
  segments_ = geom::SegmentGeometry{seq.geo, p->segment};
  const geom::SegmentGeometry& sg = segments_;
  ranked_.assign(static_cast<std::size_t>(seq.h_q * sg.count()), {});
  for (int h = 0; h < seq.h_q; ++h) {
    for (std::int64_t s = sg.first(); s < sg.first() + sg.count(); ++s) {
      ranked_[static_cast<std::size_t>(h * sg.count() + s - sg.first())] = order_segment(seq, h, s, *p).ranked;
    }
  }
  // Each tile's visited chunk count goes to the rows its slots hold.
  prefix_visited_.assign(static_cast<std::size_t>(seq.h_q * seq.geo.s_q), 0);
  const std::int64_t slots = shape.max_seq_q();
  for (const PermuteTile& t : decisions.tiles) {
    if (t.batch != seq.batch) continue;
    const std::int64_t row0 = sg.row_begin(t.segment), row1 = sg.row_end(t.segment);
    const std::int64_t visited = geom::min64(static_cast<std::int64_t>(t.chunks_visited) * p->block_k,
                                             sg.prefix(t.segment) - sg.ranked_begin(t.segment));
    const std::int32_t* order = decisions.query_order.data() + (seq.batch * seq.h_q + t.head) * slots;
    const std::int64_t e0 = row0 + static_cast<std::int64_t>(t.tile) * p->block_q;
    const std::int64_t e1 = geom::min64(e0 + p->block_q, row1);
    for (std::int64_t e = e0; e < e1; ++e) {
      prefix_visited_[static_cast<std::size_t>(t.head * seq.geo.s_q + order[e])] = visited;
    }
  }
}

void RowSets::row(int h, std::int64_t r, RowAttention* out) const {
  const Sequence& seq = *seq_;
  out->keys.clear();
  out->mean_blocks.clear();
  // The row sees keys [first, seen) (causal mask and window).
  const std::int64_t first = seq.geo.first_key(r), seen = seq.geo.keys_seen(r);
  switch (kind_) {
    case Kind::kDense:
      for (std::int64_t t = first; t < seen; ++t) out->keys.push_back(t);
      return;
    case Kind::kBlocks: {
      // Kept blocks' keys, clipped to the row's range (only partial blocks are clipped).
      const BlockMask& m = decisions_->kept;
      const int mh = m.per_kv_head ? seq.kv_head(h) : h;
      const int qb = static_cast<int>(r / m.block_q);
      const std::int64_t row = m.row(seq.batch, mh, qb);
      const auto add_blocks = [&](const std::vector<std::int32_t>& index, std::int32_t count) {
        const std::size_t base = static_cast<std::size_t>(row * m.num_k_blocks);
        for (std::int32_t i = 0; i < count; ++i) {
          const std::int64_t kb = index[base + static_cast<std::size_t>(i)];
          const std::int64_t end = geom::min64(geom::min64((kb + 1) * m.block_k, seq.geo.s_k), seen);
          for (std::int64_t t = geom::max64(kb * m.block_k, first); t < end; ++t) out->keys.push_back(t);
        }
      };
      add_blocks(m.full_index, m.full_count[static_cast<std::size_t>(row)]);
      add_blocks(m.partial_index, m.partial_count[static_cast<std::size_t>(row)]);
      if (has_means_) {
        const BlockMask& c = decisions_->corrected;
        const std::int64_t crow = c.row(seq.batch, c.per_kv_head ? seq.kv_head(h) : h, qb);
        const std::size_t base = static_cast<std::size_t>(crow * c.num_k_blocks);
        for (std::int32_t i = 0; i < c.full_count[static_cast<std::size_t>(crow)]; ++i) {
          out->mean_blocks.push_back(c.full_index[base + static_cast<std::size_t>(i)]);
        }
      }
      return;
    }
    case Kind::kPermute: {
      const std::int64_t s = rules::segment_of(segments_, r);
      if (s < 0) return;
      for (std::int64_t t = geom::max64(segments_.prefix(s), first); t < seen; ++t) out->keys.push_back(t);
      const auto& ranked = ranked_[static_cast<std::size_t>(h * segments_.count() + s - segments_.first())];
      const std::int64_t visited = prefix_visited_[static_cast<std::size_t>(h * seq.geo.s_q + r)];
      for (std::int64_t n = 0; n < visited; ++n) {
        const std::int64_t t = ranked[static_cast<std::size_t>(n)];
        if (t >= first) out->keys.push_back(t);  // a ranked key below the row's window is not read
      }
      return;
    }
  }
}

}  // namespace sparseprefill::ref
