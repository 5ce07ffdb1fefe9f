// SPDX-License-Identifier: Apache-2.0
#include "common/chunks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>

#include "common/cases.h"
#include "common/poison.h"
#include "common/results.h"
#include "reference/decide.h"
#include "reference/sequence.h"

namespace sparseprefill::test {

Inputs chunk_of(const Inputs& full, std::int64_t c0, std::int64_t c1) {
  Inputs c = full;
  const auto rows = [&](const HostTensor& src, int heads, std::int64_t r0, std::int64_t r1) {
    HostTensor out(src.dtype(), {r1 - r0, heads, src.shape()[2]});
    const std::size_t row_bytes = src.nbytes() / static_cast<std::size_t>(src.shape()[0]);
    std::memcpy(out.data(), static_cast<const unsigned char*>(src.data()) + static_cast<std::size_t>(r0) * row_bytes,
                out.nbytes());
    return out;
  };
  for (std::size_t b = 0; b < full.seqs.size(); ++b) {
    const SequenceData& s = full.seqs[b];
    c.seqs[b].q = rows(s.q, full.h_q, c0, c1);
    c.seqs[b].k = rows(s.k, full.h_kv, 0, c1);
    c.seqs[b].v = rows(s.v, full.h_kv, 0, c1);
  }
  return c;
}

MeansCache::MeansCache(const Inputs& full, int block_size, std::int64_t max_blocks)
    : k(full.dtype, {static_cast<std::int64_t>(full.seqs.size()), full.h_kv, max_blocks, full.d}),
      v(full.dtype, {static_cast<std::int64_t>(full.seqs.size()), full.h_kv, max_blocks, full.d_v}),
      valid(DType::kInt32, {static_cast<std::int64_t>(full.seqs.size())}),
      prompt_len(DType::kInt32, {static_cast<std::int64_t>(full.seqs.size())}),
      block(block_size) {
  poison(&k);
  poison(&v);
  for (std::size_t b = 0; b < full.seqs.size(); ++b) {
    valid.as<std::int32_t>()[b] = 0;
    prompt_len.as<std::int32_t>()[b] = static_cast<std::int32_t>(full.s_k(static_cast<int>(b)));
  }
}

EstimateSelectParams MeansCache::attach(EstimateSelectParams p) const {
  p.prompt_len = prompt_len.view();
  p.k_block_means = k.view();
  p.v_block_means = v.view();
  p.block_means_valid = valid.view();
  return p;
}

void MeansCache::advance(std::int64_t s_k) {
  for (std::int64_t b = 0; b < valid.numel(); ++b) valid.as<std::int32_t>()[b] = static_cast<std::int32_t>(s_k / block);
}

::testing::AssertionResult chunks_decide_as_one_shot(const Inputs& full, std::int64_t chunk, int block_q,
                                                     const LayoutOptions& layout,
                                                     const std::function<Policy(std::int64_t, std::int64_t)>& policy_for,
                                                     const ChunkCall& call, const Decisions& one_shot,
                                                     ref::Result* joined) {
  const int batch = static_cast<int>(full.seqs.size());
  const std::int64_t n = full.s_q(0);
  const std::int64_t row_elems = static_cast<std::int64_t>(full.h_q) * full.d_v;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  joined->o.assign(static_cast<std::size_t>(batch * n * row_elems), nan);
  joined->lse.assign(static_cast<std::size_t>(batch * n * full.h_q), nan);
  std::ostringstream diff;
  int differences = 0;
  std::size_t tiles = 0;  // permute_stop tiles of the chunks
  for (std::int64_t c0 = 0; c0 < n; c0 += chunk) {
    const std::int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
    TestProblem tp = build_problem(chunk_of(full, c0, c1), layout);
    ref::Result r;
    const Status st = call(&tp, policy_for(c0, c1), &r);
    if (!st.ok()) return ::testing::AssertionFailure() << "chunk [" << c0 << ", " << c1 << "): " << st.to_string();
    const std::int64_t rows = c1 - c0;  // per sequence
    for (int b = 0; b < batch; ++b) {
      for (std::int64_t r0 = 0; r0 < rows; ++r0) {
        const std::int64_t src = b * rows + r0, dst = b * n + c0 + r0;
        for (std::int64_t e = 0; e < row_elems; ++e) {
          joined->o[static_cast<std::size_t>(dst * row_elems + e)] = r.o[static_cast<std::size_t>(src * row_elems + e)];
        }
        for (int h = 0; h < full.h_q; ++h) {
          joined->lse[static_cast<std::size_t>(h * batch * n + dst)] = r.lse[static_cast<std::size_t>(h * batch * rows + src)];
        }
      }
      const Decisions& d = r.decisions;
      // permute_stop (chunks of whole segments): the chunk's query order is the one-shot
      // call's shifted by c0 (both [b, h_q, slots]).
      for (int h = 0; h < (d.query_order.empty() ? 0 : full.h_q); ++h) {
        for (std::int64_t i = 0; i < rows; ++i) {
          const std::int32_t got = d.query_order[static_cast<std::size_t>((b * full.h_q + h) * rows + i)];
          const std::int32_t want = one_shot.query_order[static_cast<std::size_t>((b * full.h_q + h) * n + c0 + i)];
          if (got + c0 != want && differences++ < 8) {
            diff << "\n  chunk [" << c0 << ", " << c1 << ") batch " << b << " head " << h << " slot " << c0 + i
                 << ": row " << got + c0 << ", one-shot row " << want;
          }
        }
      }
      for (int h = 0; h < d.kept.heads; ++h) {
        for (int qb = 0; qb < d.kept.num_q_blocks; ++qb) {
          const int qb_full = static_cast<int>(c0 / block_q) + qb;
          const bool kept_differs = kept_blocks(d.kept, b, h, qb) != kept_blocks(one_shot.kept, b, h, qb_full);
          const bool corr_differs = d.corrected.heads != 0 &&
                                    kept_blocks(d.corrected, b, h, qb) != kept_blocks(one_shot.corrected, b, h, qb_full);
          if ((kept_differs || corr_differs) && differences++ < 8) {
            diff << "\n  chunk [" << c0 << ", " << c1 << ") batch " << b << " head " << h << " query block "
                 << qb_full << (kept_differs ? ": kept differs" : ": corrected differs");
          }
        }
      }
    }
    // The chunk's permute_stop tiles are the one-shot call's tiles of the same (absolute)
    // segments, with the same chunk counts.
    for (const PermuteTile& t : r.decisions.tiles) {
      const auto it = std::find_if(one_shot.tiles.begin(), one_shot.tiles.end(), [&](const PermuteTile& o) {
        return o.batch == t.batch && o.head == t.head && o.segment == t.segment && o.tile == t.tile;
      });
      const bool same = it != one_shot.tiles.end() && it->chunks_visited == t.chunks_visited &&
                        it->chunks_total == t.chunks_total;
      if (!same && differences++ < 8) {
        diff << "\n  chunk [" << c0 << ", " << c1 << ") batch " << t.batch << " head " << t.head << " segment "
             << t.segment << " tile " << t.tile << ": visits " << t.chunks_visited << " of " << t.chunks_total
             << (it == one_shot.tiles.end() ? " (no such one-shot tile)" : " chunks, one-shot " +
                 std::to_string(it->chunks_visited) + " of " + std::to_string(it->chunks_total));
      }
    }
    tiles += r.decisions.tiles.size();
  }
  if (tiles != one_shot.tiles.size() && differences++ < 8) {
    diff << "\n  " << tiles << " permute_stop tiles over the chunks, " << one_shot.tiles.size() << " in the one-shot call";
  }
  if (differences > 0) {
    return ::testing::AssertionFailure() << differences << " decisions unlike the one-shot call's:" << diff.str();
  }
  return ::testing::AssertionSuccess();
}

void expect_cache_holds_recomputed_means(const Inputs& in, const MeansCache& cache, const EstimateSelectParams& p) {
  const TestProblem tp = make_problem(in, true, Layout::kVarlen);
  ProblemShape shape;
  ASSERT_TRUE(validate_problem(tp.problem(), nullptr, &shape).ok());
  const std::int64_t max_blocks = cache.k.shape()[2];
  for (int b = 0; b < shape.batch; ++b) {
    const ref::Sequence seq = ref::gather_sequence(tp.problem(), shape, b);
    const ref::BlockMeans want = ref::block_means(seq, p, 0);
    const std::int64_t complete = in.s_k(b) / p.block;
    for (int hk = 0; hk < in.h_kv; ++hk) {
      for (std::int64_t j = 0; j < max_blocks; ++j) {
        for (const bool value : {false, true}) {
          const int dim = value ? in.d_v : in.d;
          const HostTensor& t = value ? cache.v : cache.k;
          for (int i = 0; i < dim; ++i) {
            const std::int64_t at = ((b * in.h_kv + hk) * max_blocks + j) * dim + i;
            if (j < complete) {
              const double* mean = value ? want.v_mean(static_cast<int>(j), hk) : want.k_mean(static_cast<int>(j), hk);
              ASSERT_EQ(get(t, at), mean[i]) << (value ? "v" : "k") << " mean, b " << b << " block " << j;
            } else {
              ASSERT_TRUE(std::isnan(get(t, at))) << "written past block " << complete;
            }
          }
        }
      }
    }
  }
}

}  // namespace sparseprefill::test
