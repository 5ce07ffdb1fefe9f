// SPDX-License-Identifier: Apache-2.0
// estimate_select (FlashPrefill V2) decision rule of the oracle: key blocks scored from their
// mean keys by every row of a query tile, kept by relative energy, plus forced sink, window
// and tail blocks; optionally the pruned, fully visible blocks are marked for mean correction.
#include <cmath>
#include <limits>
#include <vector>

#include "core/estimate_chunks.h"
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
  const std::size_t n = static_cast<std::size_t>(blocks) * static_cast<std::size_t>(seq.h_kv) *
                        static_cast<std::size_t>(seq.d);
  means.k.assign(n, 0.0);
  means.v.assign(n, 0.0);
  means.length.assign(static_cast<std::size_t>(blocks), 0);
  std::vector<double> k_sum(static_cast<std::size_t>(seq.d)), v_sum(static_cast<std::size_t>(seq.d));
  std::size_t out = 0;
  std::vector<float> k_cached(static_cast<std::size_t>(seq.d)), v_cached(static_cast<std::size_t>(seq.d));
  for (int j = 0; j < blocks; ++j) {
    const std::int64_t len = g.key_end(j) - g.key_begin(j);
    means.length[static_cast<std::size_t>(j)] = len;
    for (int hk = 0; hk < seq.h_kv; ++hk) {
      if (j < cached) {
        // A complete block of an earlier chunk: its mean as the cache holds it.
        detail::load_block_mean(p.k_block_means, seq.batch, hk, j, seq.d, k_cached.data());
        detail::load_block_mean(p.v_block_means, seq.batch, hk, j, seq.d, v_cached.data());
        for (std::size_t i = 0; i < k_cached.size(); ++i, ++out) {
          means.k[out] = k_cached[i];
          means.v[out] = v_cached[i];
        }
        continue;
      }
      k_sum.assign(k_sum.size(), 0.0);
      v_sum.assign(v_sum.size(), 0.0);
      for (std::int64_t t = g.key_begin(j); t < g.key_end(j); ++t) {
        for (int i = 0; i < seq.d; ++i) {
          k_sum[static_cast<std::size_t>(i)] += seq.k_row(t, hk)[i];
          v_sum[static_cast<std::size_t>(i)] += seq.v_row(t, hk)[i];
        }
      }
      // Rounded like a kernel's stored means: to fp32, then to the input dtype.
      for (std::size_t i = 0; i < k_sum.size(); ++i, ++out) {
        means.k[out] = round_to(seq.dtype, static_cast<float>(k_sum[i] / static_cast<double>(len)));
        means.v[out] = round_to(seq.dtype, static_cast<float>(v_sum[i] / static_cast<double>(len)));
      }
    }
  }
  return means;
}

void store_block_means(const Sequence& seq, const EstimateSelectParams& p, const BlockMeans& means,
                       std::int64_t begin, std::int64_t end) {
  std::vector<float> k(static_cast<std::size_t>(seq.d)), v(static_cast<std::size_t>(seq.d));
  for (std::int64_t j = begin; j < end; ++j) {
    for (int hk = 0; hk < seq.h_kv; ++hk) {
      // The means are already rounded to the input dtype (= the cache's): stored exactly.
      for (int i = 0; i < seq.d; ++i) {
        k[static_cast<std::size_t>(i)] = static_cast<float>(means.k_mean(static_cast<int>(j), hk)[i]);
        v[static_cast<std::size_t>(i)] = static_cast<float>(means.v_mean(static_cast<int>(j), hk)[i]);
      }
      detail::store_block_mean(p.k_block_means, seq.batch, hk, j, seq.d, k.data());
      detail::store_block_mean(p.v_block_means, seq.batch, hk, j, seq.d, v.data());
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
      const std::int64_t a_f = seq.geo.position(g.row_begin(i));
      const std::int64_t a_l = seq.geo.position(g.row_end(i) - 1);
      if (a_l < 0) continue;  // no row of the tile sees a key (s_q > s_k)
      const std::int64_t fqb = geom::floor_div(a_f, bs), lqb = a_l / bs;
      const int scored = static_cast<int>((a_l + 1) / bs);  // A: blocks the last row sees whole

      // x[r, j] = scale · q_r · k̄_j over the contributing pairs: row r sees block j's first key.
      const std::size_t pairs_per_block =
          static_cast<std::size_t>(g.row_end(i) - g.row_begin(i)) * static_cast<std::size_t>(heads_per_unit);
      std::vector<double> x(static_cast<std::size_t>(scored) * pairs_per_block,
                            -std::numeric_limits<double>::infinity());
      double x_max = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < scored; ++j) {
        std::size_t n = static_cast<std::size_t>(j) * pairs_per_block;
        for (std::int64_t r = g.row_begin(i); r < g.row_end(i); ++r) {
          for (int h = h0; h < h0 + heads_per_unit; ++h, ++n) {
            if (seq.geo.position(r) < static_cast<std::int64_t>(j) * bs) continue;
            x[n] = seq.scale * dot(seq.q_row(r, h), means.k_mean(j, hk), seq.d);
            x_max = nan_max(x_max, x[n]);
          }
        }
      }
      // E_j = Σ_r exp(x[r, j] - M), M the tile's maximum; non-contributing pairs add exp(-inf) = 0.
      std::vector<double> energy(static_cast<std::size_t>(scored), 0.0);
      double e_max = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < scored; ++j) {
        double e = 0.0;
        for (std::size_t n = 0; n < pairs_per_block; ++n) {
          e += std::exp(x[static_cast<std::size_t>(j) * pairs_per_block + n] - x_max);
        }
        energy[static_cast<std::size_t>(j)] = e;
        e_max = nan_max(e_max, e);
      }

      // The mask's head is the unit: the query head, or with pack_gqa the KV head.
      const bool tail_tile = g.is_tail_block(i, p.tail, prompt_len);
      for (std::int64_t j = 0; j <= lqb; ++j) {
        const int kb = static_cast<int>(j);
        // E_j >= alpha · max E as written: a NaN energy (or peak) fails it, and with NaN scores
        // in the tile only the forced blocks remain.
        const bool by_energy = j < scored && energy[static_cast<std::size_t>(j)] >= p.alpha * e_max;
        const bool forced = tail_tile || j < p.sink || fqb - p.window + 1 <= j;
        if (by_energy || forced) {
          SP_RETURN_IF_ERROR(decisions->kept.add(shape, seq.batch, unit, i, kb));
        } else if (p.mean_correction && g.key_end(kb) - 1 <= a_f) {
          // Pruned and wholly visible to the tile's first row, hence to every row.
          SP_RETURN_IF_ERROR(decisions->corrected.add(shape, seq.batch, unit, i, kb));
        }
      }
    }
  }
  return {};
}

}  // namespace sparseprefill::ref
