// SPDX-License-Identifier: Apache-2.0
// estimate_select (FlashPrefill V2) decision rule of the oracle: key blocks scored from their
// mean keys by every row of a query tile, kept by relative energy, plus forced sink, window
// and tail blocks (all within the visible blocks); optionally the pruned, fully visible blocks
// are marked for mean correction.
#include <algorithm>
#include <limits>
#include <vector>

#include "core/estimate_chunks.h"
#include "core/rules/estimate_select.h"
#include "core/tensor_access.h"
#include "reference/decide.h"

namespace sparseprefill::ref {

BlockMeans block_means(const Sequence& seq, const EstimateSelectParams& p, std::int64_t cached) {
  const int block = p.block;
  const geom::BlockGeometry g{seq.geo, block, block};
  const int blocks = g.num_k_blocks();
  BlockMeans means;
  means.block = block;
  means.h_kv = seq.h_kv;
  means.d = seq.d;
  means.d_v = seq.d_v;
  const std::size_t n = static_cast<std::size_t>(blocks) * static_cast<std::size_t>(seq.h_kv);
  means.k.assign(n * static_cast<std::size_t>(seq.d), 0.0);
  means.v.assign(n * static_cast<std::size_t>(seq.d_v), 0.0);
  means.length.assign(static_cast<std::size_t>(blocks), 0);
  std::vector<double> sum(static_cast<std::size_t>(seq.d > seq.d_v ? seq.d : seq.d_v));
  std::vector<float> k_cached(static_cast<std::size_t>(seq.d)), v_cached(static_cast<std::size_t>(seq.d_v));
  const DType mean_dtype = detail::block_mean_dtype(seq.dtype);
  const auto round = [mean_dtype](float x) { return static_cast<double>(round_to(mean_dtype, x)); };
  for (int j = 0; j < blocks; ++j) {
    means.length[static_cast<std::size_t>(j)] = g.key_end(j) - g.key_begin(j);
    for (int hk = 0; hk < seq.h_kv; ++hk) {
      double* k_out = &means.k[(static_cast<std::size_t>(j) * seq.h_kv + hk) * seq.d];
      double* v_out = &means.v[(static_cast<std::size_t>(j) * seq.h_kv + hk) * seq.d_v];
      if (j < cached) {
        // A complete block of an earlier chunk: its mean as the cache holds it.
        detail::load_block_mean(p.k_block_means, seq.batch, hk, j, seq.d, k_cached.data());
        detail::load_block_mean(p.v_block_means, seq.batch, hk, j, seq.d_v, v_cached.data());
        std::copy(k_cached.begin(), k_cached.end(), k_out);
        std::copy(v_cached.begin(), v_cached.end(), v_out);
        continue;
      }
      rules::block_mean(g, j, seq.d, [&](std::int64_t t) { return seq.k_row(t, hk); }, round, sum.data(), k_out);
      rules::block_mean(g, j, seq.d_v, [&](std::int64_t t) { return seq.v_row(t, hk); }, round, sum.data(), v_out);
    }
  }
  return means;
}

void store_block_means(const Sequence& seq, const EstimateSelectParams& p, const BlockMeans& means,
                       std::int64_t begin, std::int64_t end) {
  std::vector<float> k(static_cast<std::size_t>(seq.d)), v(static_cast<std::size_t>(seq.d_v));
  for (std::int64_t j = begin; j < end; ++j) {
    for (int hk = 0; hk < seq.h_kv; ++hk) {
      // The means are already rounded to the input dtype (= the cache's): stored exactly.
      for (int i = 0; i < seq.d; ++i) k[static_cast<std::size_t>(i)] = static_cast<float>(means.k_mean(static_cast<int>(j), hk)[i]);
      for (int i = 0; i < seq.d_v; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(means.v_mean(static_cast<int>(j), hk)[i]);
      detail::store_block_mean(p.k_block_means, seq.batch, hk, j, seq.d, k.data());
      detail::store_block_mean(p.v_block_means, seq.batch, hk, j, seq.d_v, v.data());
    }
  }
}

Status decide_estimate_select(const Sequence& seq, const ProblemShape& shape,
                              const EstimateSelectParams& p, Decisions* decisions) {
  const int bs = p.block;
  const geom::BlockGeometry g{seq.geo, bs, bs};
  detail::EstimateChunks chunks;
  SP_RETURN_IF_ERROR(detail::read_estimate_chunks(p, shape, &chunks));
  const auto b = static_cast<std::size_t>(seq.batch);
  const BlockMeans means = block_means(seq, p, chunks.valid[b]);
  // The blocks this call completes go to the cache: each block's mean is computed once.
  if (chunks.cached) store_block_means(seq, p, means, chunks.valid[b], chunks.complete[b]);
  const std::int64_t prompt_len = chunks.prompt_len[b];
  const int tiles = g.num_q_blocks();
  // A selection unit is one query head, or with pack_gqa one KV head and its group's heads.
  const int units = p.pack_gqa ? seq.h_kv : seq.h_q;
  const int heads_per_unit = p.pack_gqa ? seq.group() : 1;

  for (int unit = 0; unit < units; ++unit) {
    const int h0 = unit * heads_per_unit;
    const int hk = seq.kv_head(h0);
    for (int i = 0; i < tiles; ++i) {
      const rules::EstimateTile tile = rules::estimate_tile(g, i, p.tail, prompt_len);
      if (tile.empty()) continue;  // no row of the tile sees a key (s_q > s_k)

      // x[r, j] = capped(q_r · k̄_j) over the contributing pairs (row, then head) of the scored
      // blocks first <= j < A; the others stay -inf.
      const std::size_t pairs_per_block =
          static_cast<std::size_t>(g.row_end(i) - g.row_begin(i)) * static_cast<std::size_t>(heads_per_unit);
      std::vector<double> x(static_cast<std::size_t>(tile.scored) * pairs_per_block,
                            -std::numeric_limits<double>::infinity());
      for (int j = tile.first; j < tile.scored; ++j) {
        std::size_t n = static_cast<std::size_t>(j) * pairs_per_block;
        for (std::int64_t r = g.row_begin(i); r < g.row_end(i); ++r) {
          for (int h = h0; h < h0 + heads_per_unit; ++h, ++n) {
            if (rules::estimate_contributes(g, seq.geo.position(r), j)) {
              x[n] = seq.capped(dot(seq.q_row(r, h), means.k_mean(j, hk), seq.d));
            }
          }
        }
      }
      std::vector<double> energy(static_cast<std::size_t>(tile.scored));
      const double peak = rules::estimate_energies(
          tile.first, tile.scored, static_cast<std::int64_t>(pairs_per_block),
          [&](int j, std::int64_t n) { return x[static_cast<std::size_t>(j) * pairs_per_block + static_cast<std::size_t>(n)]; },
          energy.data());

      // The mask's head is the unit: the query head, or with pack_gqa the KV head.
      for (int kb = tile.first; kb <= tile.lqb; ++kb) {
        const double e = kb < tile.scored ? energy[static_cast<std::size_t>(kb)] : 0.0;
        if (rules::estimate_keeps(tile, kb, e, peak, p.alpha, p.sink, p.window)) {
          SP_RETURN_IF_ERROR(decisions->kept.add(shape, seq.batch, unit, i, kb));
        } else if (p.mean_correction && rules::estimate_correctable(g, tile.a_first, kb)) {
          SP_RETURN_IF_ERROR(decisions->corrected.add(shape, seq.batch, unit, i, kb));
        }
      }
    }
  }
  return {};
}

}  // namespace sparseprefill::ref
