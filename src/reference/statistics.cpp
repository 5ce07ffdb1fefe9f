// SPDX-License-Identifier: Apache-2.0
// The host route of the calibration statistics (compute_block_statistics /
// compute_select_statistics, calibration.h): exact block maxima and the BLASST skip statistic,
// and relative block energies, from fp64 scores in the oracle's summation order, so that a host
// statistic equals what the oracle's decision rule compares.
#include "reference/statistics.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/geometry.h"
#include "core/parallel.h"
#include "core/rules/estimate_select.h"
#include "core/rules/softmax_skip.h"
#include "core/tensor_access.h"

namespace sparseprefill::ref {

namespace {

using detail::parallel_for;

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// One sequence of a sample: q [s_q, h_q, d] and k [s_k, h_kv, d] as exact doubles, and each
// KV head's keys transposed per key block, [h_kv][num_k_blocks][d][kpad] (zero padded), so
// that the score kernel reads consecutive keys of one feature contiguously.
struct SampleSeq {
  int batch = 0;
  geom::SeqGeometry geo;
  int h_q = 0, h_kv = 0, d = 0;
  double scale = 0.0;
  DType dtype = DType::kBF16;
  std::vector<double> q, k;

  int kv_head(int h) const { return h / (h_q / h_kv); }
  const double* q_row(std::int64_t r, int h) const {
    return &q[(static_cast<std::size_t>(r) * h_q + h) * d];
  }
  const double* k_row(std::int64_t t, int hk) const {
    return &k[(static_cast<std::size_t>(t) * h_kv + hk) * d];
  }
};

struct Transposed {
  int block_k = 0, kpad = 0, blocks = 0, d = 0;
  std::vector<double> data;  // [h_kv][blocks][d][kpad]

  const double* block(int hk, int kb) const {
    return &data[((static_cast<std::size_t>(hk) * blocks + kb) * d) * kpad];
  }
};

// Keys of block kb that row r sees (0 when none).
std::int64_t seen_in_block(const geom::BlockGeometry& g, std::int64_t r, int kb) {
  return std::max<std::int64_t>(0, std::min(g.seq.keys_seen(r), g.key_end(kb)) - g.key_begin(kb));
}

Transposed transpose_keys(const SampleSeq& s, int block_k) {
  const geom::BlockGeometry g{s.geo, 1, block_k};
  Transposed t;
  t.block_k = block_k;
  t.kpad = (block_k + 7) / 8 * 8;
  t.blocks = g.num_k_blocks();
  t.d = s.d;
  t.data.assign(static_cast<std::size_t>(s.h_kv) * t.blocks * s.d * t.kpad, 0.0);
  for (int hk = 0; hk < s.h_kv; ++hk) {
    for (int kb = 0; kb < t.blocks; ++kb) {
      double* dst = &t.data[((static_cast<std::size_t>(hk) * t.blocks + kb) * s.d) * t.kpad];
      for (std::int64_t key = g.key_begin(kb); key < g.key_end(kb); ++key) {
        const double* src = s.k_row(key, hk);
        const std::int64_t col = key - g.key_begin(kb);
        for (int i = 0; i < s.d; ++i) dst[static_cast<std::size_t>(i) * t.kpad + col] = src[i];
      }
    }
  }
  return t;
}

// Row maxima of scale·q_r·k_t over the keys of one block: out[i] = max over the first
// seen[i] keys of the block (-inf when seen[i] == 0) for rows r0 + i, i < rows, of head h.
// Each dot product accumulates over d in order from 0.0, exactly like the oracle's dot(), so
// the scores are bit-identical to the oracle's. Register tiles of 4 rows × 8 keys.
void block_row_max(const SampleSeq& s, int h, std::int64_t r0, int rows, const double* kt,
                   int kpad, const std::int64_t* seen, double* out) {
  constexpr int kRows = 4, kCols = 8;
  const int d = s.d;
  const std::size_t q_stride = static_cast<std::size_t>(s.h_q) * d;
  const double* q0 = s.q_row(r0, h);
  std::int64_t max_seen = 0;
  for (int i = 0; i < rows; ++i) {
    out[i] = kNegInf;
    max_seen = std::max(max_seen, seen[i]);
  }
  int i0 = 0;
  for (; i0 + kRows <= rows; i0 += kRows) {
    for (int c0 = 0; c0 < max_seen; c0 += kCols) {
      double acc[kRows][kCols] = {};
      const double* q = q0 + static_cast<std::size_t>(i0) * q_stride;
      for (int dd = 0; dd < d; ++dd) {
        const double* kr = kt + static_cast<std::size_t>(dd) * kpad + c0;
        for (int i = 0; i < kRows; ++i) {
          const double qv = q[static_cast<std::size_t>(i) * q_stride + dd];
          for (int j = 0; j < kCols; ++j) acc[i][j] += qv * kr[j];
        }
      }
      for (int i = 0; i < kRows; ++i) {
        const std::int64_t n = std::min<std::int64_t>(kCols, seen[i0 + i] - c0);
        for (int j = 0; j < n; ++j) out[i0 + i] = std::max(out[i0 + i], s.scale * acc[i][j]);
      }
    }
  }
  for (; i0 < rows; ++i0) {
    const double* q = q0 + static_cast<std::size_t>(i0) * q_stride;
    for (int c0 = 0; c0 < seen[i0]; c0 += kCols) {
      double acc[kCols] = {};
      for (int dd = 0; dd < d; ++dd) {
        const double* kr = kt + static_cast<std::size_t>(dd) * kpad + c0;
        for (int j = 0; j < kCols; ++j) acc[j] += q[dd] * kr[j];
      }
      const std::int64_t n = std::min<std::int64_t>(kCols, seen[i0] - c0);
      for (int j = 0; j < n; ++j) out[i0] = std::max(out[i0], s.scale * acc[j]);
    }
  }
}

// Validates a calibration sample and resolves its shape: causal, host or CUDA tensors.

Status gather_seq(const char* who, const AttentionProblem& p, const ProblemShape& shape, int b,
                  SampleSeq* s) {
  s->batch = b;
  s->geo = geom::SeqGeometry{shape.seq_q[static_cast<std::size_t>(b)],
                             shape.seq_k[static_cast<std::size_t>(b)], true};
  s->h_q = shape.h_q;
  s->h_kv = shape.h_kv;
  s->d = shape.d;
  s->scale = shape.scale;
  s->dtype = shape.dtype;
  detail::gather_q(p, shape, b, &s->q);
  detail::gather_kv(p, shape, b, /*value=*/false, &s->k);
  // Non-finite activations make every statistic meaningless; a calibration run must not
  // average them in silently.
  const std::pair<const char*, const std::vector<double>*> arrays[] = {{"q", &s->q}, {"k", &s->k}};
  for (const auto& [name, values] : arrays) {
    const int heads = values == &s->q ? s->h_q : s->h_kv;
    for (std::size_t i = 0; i < values->size(); ++i) {
      if (!std::isfinite((*values)[i])) {
        const std::size_t per_row = static_cast<std::size_t>(heads) * s->d;
        return invalid_argument(std::string(who) + ": sample." + name + ": non-finite value in sequence " +
                                std::to_string(b) + ", row " + std::to_string(i / per_row) +
                                ", head " + std::to_string(i % per_row / s->d));
      }
    }
  }
  return {};
}

// Gathers and checks every sequence before a calibrator accumulates anything, so that a
// rejected sample leaves the calibrator unchanged.
Status check_all_sequences(const char* who, const AttentionProblem& p, const ProblemShape& shape) {
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(who, p, shape, b, &s));
  }
  return {};
}

// The host route of compute_block_statistics: fp64 scores in the oracle's order.
BlockStatistics host_block_statistics(SampleSeq& s, int block_q, int block_k, bool want_max, bool want_g) {
  const geom::BlockGeometry g{s.geo, block_q, block_k};
  BlockStatistics st;
  st.s_q = s.geo.s_q;
  st.s_k = s.geo.s_k;
  st.heads = s.h_q;
  st.block_q = block_q;
  st.block_k = block_k;
  const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
  const std::size_t cells = static_cast<std::size_t>(s.h_q) * nqb * nkb;
  if (want_max) st.block_max.assign(cells, kNegInf);
  if (want_g) st.skip_g.assign(cells, kNegInf);
  if (cells == 0) return st;
  const Transposed kt = transpose_keys(s, block_k);
  std::vector<double>().swap(s.k);  // only the transposed copy is read from here on
  const double ln_s_k = std::log(static_cast<double>(s.geo.s_k));
  parallel_for(s.h_q, [&](int h) {
    const int hk = s.kv_head(h);
    std::vector<double> m_run(static_cast<std::size_t>(block_q)), tile(static_cast<std::size_t>(block_q));
    std::vector<std::int64_t> seen(static_cast<std::size_t>(block_q));
    for (int qb = 0; qb < nqb; ++qb) {
      const std::size_t row = (static_cast<std::size_t>(h) * nqb + qb) * nkb;
      double* bmax = want_max ? &st.block_max[row] : nullptr;
      double* gs = want_g ? &st.skip_g[row] : nullptr;
      const std::int64_t r0 = g.row_begin(qb);
      const int rows = static_cast<int>(g.row_end(qb) - r0);
      // Without g only the gated (full) blocks are needed, in any order.
      const std::vector<int> order = want_g ? rules::blasst_order(g, qb) : [&] {
        std::vector<int> gated(static_cast<std::size_t>(g.gated_end(qb)));
        for (int kb = 0; kb < g.gated_end(qb); ++kb) gated[static_cast<std::size_t>(kb)] = kb;
        return gated;
      }();
      std::fill(m_run.begin(), m_run.begin() + rows, kNegInf);
      for (std::size_t visit = 0; visit < order.size(); ++visit) {
        const int kb = order[visit];
        for (int i = 0; i < rows; ++i) seen[static_cast<std::size_t>(i)] = seen_in_block(g, r0 + i, kb);
        block_row_max(s, h, r0, rows, kt.block(hk, kb), kt.kpad, seen.data(), tile.data());
        if (bmax != nullptr) bmax[kb] = *std::max_element(tile.begin(), tile.begin() + rows);
        if (gs == nullptr) continue;
        if (visit > 0) {
          // g = max over the rows that have a say of their margin (rules::skip_margin) + ln s_k:
          // the block is skipped iff g < ln a, i.e. every such row's margin < ln λ.
          double stat = kNegInf;
          for (int i = 0; i < rows; ++i) {
            const auto u = static_cast<std::size_t>(i);
            const bool before = m_run[u] != kNegInf, here = seen[u] > 0;
            if (!before && !here) continue;
            stat = std::max(stat, rules::skip_margin(here, before, tile[u], m_run[u]));
          }
          gs[kb] = stat + ln_s_k;
        }
        // The dense running max: skipping never lowers it while a <= s_k (a skipped
        // block's row maxima lie below m_run + ln(a / s_k) <= m_run).
        for (int i = 0; i < rows; ++i) {
          const auto u = static_cast<std::size_t>(i);
          if (seen[u] > 0) m_run[u] = std::max(m_run[u], tile[u]);
        }
      }
    }
  });
  return st;
}

// The host route of compute_select_statistics: fp64 scores against the dtype-rounded means.
SelectStatistics host_select_statistics(const SampleSeq& s, int bs, bool pack_gqa) {
  const geom::BlockGeometry g{s.geo, bs, bs};
  const int blocks = g.num_k_blocks();
  // Mean keys per block and KV head as every backend scores with them (rules::block_mean).
  std::vector<double> means(static_cast<std::size_t>(blocks) * s.h_kv * s.d), sum(static_cast<std::size_t>(s.d));
  const auto round = [&s](float x) { return static_cast<double>(round_to(s.dtype, x)); };
  for (int j = 0; j < blocks; ++j) {
    for (int hk = 0; hk < s.h_kv; ++hk) {
      rules::block_mean(g, j, s.d, [&](std::int64_t t) { return s.k_row(t, hk); }, round, sum.data(),
                        &means[(static_cast<std::size_t>(j) * s.h_kv + hk) * s.d]);
    }
  }
  SelectStatistics st;
  st.s_q = s.geo.s_q;
  st.s_k = s.geo.s_k;
  st.units = pack_gqa ? s.h_kv : s.h_q;
  st.block = bs;
  st.pack_gqa = pack_gqa;
  const int heads_per_unit = pack_gqa ? s.h_q / s.h_kv : 1;
  const int tiles = g.num_q_blocks();
  st.ratio.assign(static_cast<std::size_t>(st.units) * tiles * blocks, 0.0);
  parallel_for(st.units, [&](int unit) {
    const int h0 = unit * heads_per_unit;
    const int hk = s.kv_head(h0);
    std::vector<double> x;
    for (int i = 0; i < tiles; ++i) {
      const int scored = rules::estimate_scored_blocks(g, i);
      if (scored == 0) continue;
      // x[r, j] = scale · q_r · k̄_j for the pairs whose row sees block j's first key, in
      // the oracle's pair order (row, then head); other pairs add exp(-inf) = 0.
      const std::size_t pairs = static_cast<std::size_t>(g.row_end(i) - g.row_begin(i)) * heads_per_unit;
      x.assign(static_cast<std::size_t>(scored) * pairs, kNegInf);
      for (int j = 0; j < scored; ++j) {
        const double* kbar = &means[(static_cast<std::size_t>(j) * s.h_kv + hk) * s.d];
        std::size_t n = static_cast<std::size_t>(j) * pairs;
        for (std::int64_t r = g.row_begin(i); r < g.row_end(i); ++r) {
          for (int h = h0; h < h0 + heads_per_unit; ++h, ++n) {
            if (!rules::estimate_contributes(g, s.geo.position(r), j)) continue;
            const double* q = s.q_row(r, h);
            double acc = 0.0;
            for (int dd = 0; dd < s.d; ++dd) acc += q[dd] * kbar[dd];
            x[n] = s.scale * acc;
          }
        }
      }
      double* ratio = &st.ratio[(static_cast<std::size_t>(unit) * tiles + i) * blocks];
      const double e_max = rules::estimate_energies(
          0, scored, static_cast<std::int64_t>(pairs),
          [&](int j, std::int64_t n) { return x[static_cast<std::size_t>(j) * pairs + static_cast<std::size_t>(n)]; }, ratio);
      for (int j = 0; j < scored; ++j) ratio[j] /= e_max;
    }
  });
  return st;
}

}  // namespace

Status block_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape, int block_q,
                        int block_k, bool want_max, bool want_g, std::vector<BlockStatistics>* out) {
  SP_RETURN_IF_ERROR(check_all_sequences(who, sample, shape));
  out->clear();
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(who, sample, shape, b, &s));
    out->push_back(host_block_statistics(s, block_q, block_k, want_max, want_g));
  }
  return {};
}

Status select_statistics(const char* who, const AttentionProblem& sample, const ProblemShape& shape,
                         const EstimateSelectParams& base, std::vector<SelectStatistics>* out) {
  SP_RETURN_IF_ERROR(check_all_sequences(who, sample, shape));
  out->clear();
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(who, sample, shape, b, &s));
    out->push_back(host_select_statistics(s, base.block, base.pack_gqa));
  }
  return {};
}

}  // namespace sparseprefill::ref
