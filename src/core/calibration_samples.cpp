// SPDX-License-Identifier: Apache-2.0
// The calibrators of calibration.h: statistics gathered from Q/K samples (exact block maxima
// for exact_gate, the BLASST skip statistic for softmax_skip, relative block energies for
// estimate_select) on the CPU, or on the GPU for CUDA tensors (src/cuda), and the one
// reduction of both routes to the factors that hit a target budget, skip fraction or density.
// Host scores are scale·q·k in double with the oracle's summation order, so a host statistic
// equals what the oracle's decision rule compares.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/geometry.h"
#include "core/tensor_access.h"
#include "sparseprefill/calibration.h"
#if defined(SP_WITH_CUDA)
#include "cuda/cuda_backend.h"
#endif

namespace sparseprefill {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();
constexpr double kPosInf = std::numeric_limits<double>::infinity();

// Runs fn(i) for i in [0, n) on up to hardware_concurrency threads.
template <class Fn>
void parallel_for(int n, const Fn& fn) {
  const int threads = std::max(1, std::min<int>(n, static_cast<int>(std::thread::hardware_concurrency())));
  if (threads <= 1) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&]() {
      for (int i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
    });
  }
  for (std::thread& th : pool) th.join();
}

// Sorts v by `less` like std::sort (the same sorted sequence), on up to hardware_concurrency
// threads: chunks sorted in parallel, then merged pairwise in parallel rounds. A 128K-token
// sample gives ~17 M statistics per layer to rank (bench/records/2026-11-29-h200-calib-statistics.md:
// the single-threaded sorts were most of the 4.6 s of host reductions per Llama layer).
template <class Less>
void parallel_sort(std::vector<double>* v, Less less) {
  const std::size_t n = v->size();
  const int chunks = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  if (chunks == 1 || n < (std::size_t{1} << 16)) {
    std::sort(v->begin(), v->end(), less);
    return;
  }
  std::vector<std::ptrdiff_t> bound(static_cast<std::size_t>(chunks) + 1);
  for (int i = 0; i <= chunks; ++i) {
    bound[static_cast<std::size_t>(i)] = static_cast<std::ptrdiff_t>(n * static_cast<std::size_t>(i) / static_cast<std::size_t>(chunks));
  }
  const auto at = [&](int i) { return v->begin() + bound[static_cast<std::size_t>(std::min(i, chunks))]; };
  parallel_for(chunks, [&](int i) { std::sort(at(i), at(i + 1), less); });
  for (int width = 1; width < chunks; width *= 2) {
    parallel_for((chunks + 2 * width - 1) / (2 * width), [&](int pair) {
      const int lo = pair * 2 * width;
      if (lo + width < chunks) std::inplace_merge(at(lo), at(lo + width), at(lo + 2 * width), less);
    });
  }
}

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
Status check_sample(const char* who, const AttentionProblem& sample, ProblemShape* shape) {
  Status st = validate_problem(sample, nullptr, shape);
  if (!st.ok()) return Status(st.code(), std::string(who) + ": sample: " + st.message());
  if (!shape->causal) {
    return invalid_argument(std::string(who) + ": sample.causal: calibration expects causal "
                            "(prefill) samples");
  }
  if (shape->dtype == DType::kFP8E4M3) {
    return unsupported(std::string(who) + ": sample: fp8_e4m3 inputs run dense and block_sparse only, which need no "
                       "calibration; calibrate on the bf16/fp16 activations");
  }
  return {};
}

Status check_layer(const char* who, int layer, int layers) {
  if (layer < 0 || layer >= layers) {
    return invalid_argument(std::string(who) + ": layer: expected 0 .. " + std::to_string(layers - 1) +
                            ", got " + std::to_string(layer));
  }
  return {};
}

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

Status check_target(double target, int layer, int layers, const char* name) {
  if (!std::isfinite(target) || target < 0.0 || target > 1.0) {
    return invalid_argument(std::string(name) + ": expected a fraction in [0, 1], got " +
                            std::to_string(target));
  }
  if (layer < -1 || layer >= layers) {
    return invalid_argument("layer: expected -1 (all layers) or 0 .. " + std::to_string(layers - 1) +
                            ", got " + std::to_string(layer));
  }
  return {};
}

// Among the counts n in [0, size] reachable by a threshold between distinct neighbours of
// sorted[0, size) (n = 0, n = size, or sorted[n-1] != sorted[n]), the one nearest to `wanted`
// (ties: the smaller n).
std::size_t nearest_reachable(const double* sorted, std::size_t size, double wanted) {
  std::size_t best = 0;
  double best_dist = std::abs(wanted);
  for (std::size_t n = 1; n <= size; ++n) {
    if (n < size && sorted[n - 1] == sorted[n]) continue;
    const double dist = std::abs(static_cast<double>(n) - wanted);
    if (dist < best_dist) {
      best = n;
      best_dist = dist;
    }
  }
  return best;
}

// A statistics array of one sequence must hold [heads, q_blocks, k_blocks] values.
Status check_size(const char* who, const char* name, std::size_t b, std::size_t size, std::size_t expected) {
  if (size == expected) return {};
  return invalid_argument(std::string(who) + ": statistics[" + std::to_string(b) + "]." + name + ": expected " +
                          std::to_string(expected) + " values [heads, q_blocks, k_blocks], got " +
                          std::to_string(size));
}

Status non_finite_statistic(const char* who, const char* name, std::size_t b, std::size_t index, double value) {
  return invalid_argument(std::string(who) + ": statistics[" + std::to_string(b) + "]." + name + "[" +
                          std::to_string(index) + "] is " + (std::isnan(value) ? "NaN" : "infinite") +
                          " (non-finite q or k?)");
}

// The geometry of a statistics record, checked against a calibrator's block sizes.
Status check_block_record(const char* who, std::size_t b, const BlockStatistics& st, int block_q, int block_k,
                          geom::BlockGeometry* g) {
  if (st.block_q != block_q || st.block_k != block_k) {
    return invalid_argument(std::string(who) + ": statistics[" + std::to_string(b) + "]: block " +
                            std::to_string(st.block_q) + "x" + std::to_string(st.block_k) + ", calibrator expects " +
                            std::to_string(block_q) + "x" + std::to_string(block_k));
  }
  if (st.s_q < 0 || st.s_k < 0 || st.heads < 1) {
    return invalid_argument(std::string(who) + ": statistics[" + std::to_string(b) +
                            "]: expected s_q, s_k >= 0 and heads >= 1");
  }
  *g = geom::BlockGeometry{{st.s_q, st.s_k, true}, block_q, block_k};
  return {};
}

// estimate_select's scored blocks of tile i: j < (a_l + 1) / block, a_l the tile's last
// absolute position (0 when no row sees a key).
int scored_blocks(const geom::BlockGeometry& g, int i) {
  const std::int64_t a_l = g.seq.position(g.row_end(i) - 1);
  return a_l < 0 ? 0 : static_cast<int>((a_l + 1) / g.block_k);
}

// BLASST visit order of query block qb: partial blocks, then full blocks, each descending.
std::vector<int> blasst_order(const geom::BlockGeometry& g, int qb) {
  std::vector<int> order;
  for (int kb = g.visible_end(qb) - 1; kb >= g.full_end(qb); --kb) order.push_back(kb);
  for (int kb = g.full_end(qb) - 1; kb >= 0; --kb) order.push_back(kb);
  return order;
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
      // Without g only the full blocks are needed, in any order.
      const std::vector<int> order = want_g ? blasst_order(g, qb) : [&] {
        std::vector<int> full(static_cast<std::size_t>(g.full_end(qb)));
        for (int kb = 0; kb < g.full_end(qb); ++kb) full[static_cast<std::size_t>(kb)] = kb;
        return full;
      }();
      std::fill(m_run.begin(), m_run.begin() + rows, kNegInf);
      for (std::size_t visit = 0; visit < order.size(); ++visit) {
        const int kb = order[visit];
        for (int i = 0; i < rows; ++i) seen[static_cast<std::size_t>(i)] = seen_in_block(g, r0 + i, kb);
        block_row_max(s, h, r0, rows, kt.block(hk, kb), kt.kpad, seen.data(), tile.data());
        if (bmax != nullptr) bmax[kb] = *std::max_element(tile.begin(), tile.begin() + rows);
        if (gs == nullptr) continue;
        if (visit > 0) {
          // g = max over the rows that have a say of (tile_rowmax - m_run) + ln s_k: a row
          // seeing its first keys here can never skip (+inf); a row seeing none of this
          // block's keys after earlier ones always skips (-inf); a row that has seen
          // nothing and sees nothing has no say.
          double stat = kNegInf;
          for (int i = 0; i < rows; ++i) {
            const auto u = static_cast<std::size_t>(i);
            const bool before = m_run[u] != kNegInf, here = seen[u] > 0;
            if (!before && !here) continue;
            const double diff = !before ? kPosInf : (here ? tile[u] - m_run[u] : kNegInf);
            stat = std::max(stat, diff);
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

// The statistics of every sequence of `sample`: on the GPU for CUDA tensors (on_cuda(shape),
// its message prefixed with `who`), else one host record per sequence (on_host(sequence), which
// may release the sequence's buffers).
template <class Stat, class OnCuda, class OnHost>
Status per_sample(const char* who, const AttentionProblem& sample, std::vector<Stat>* out, const OnCuda& on_cuda,
                  const OnHost& on_host) {
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(who, sample, &shape));
  if (shape.device.kind == DeviceKind::kCUDA) {
#if defined(SP_WITH_CUDA)
    const Status st = on_cuda(shape);
    if (!st.ok()) return Status(st.code(), std::string(who) + ": " + st.message());
    return {};
#else
    (void)on_cuda;
    return unsupported(std::string(who) + ": sample: CUDA tensors, but this build has no CUDA backend");
#endif
  }
  SP_RETURN_IF_ERROR(check_all_sequences(who, sample, shape));
  out->clear();
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(who, sample, shape, b, &s));
    out->push_back(on_host(s));
  }
  return {};
}

Status block_statistics(const char* who, const AttentionProblem& sample, int block_q, int block_k, bool want_max,
                        bool want_g, void* cuda_stream, std::vector<BlockStatistics>* out) {
  if (block_q < 1 || block_k < 1) return invalid_argument(std::string(who) + ": block sizes must be >= 1");
#if defined(SP_WITH_CUDA)
  auto on_cuda = [&](const ProblemShape& shape) {
    return cuda::block_statistics_cuda(sample, shape, block_q, block_k, want_max, want_g, cuda_stream, out);
  };
#else
  const std::nullptr_t on_cuda = nullptr;  // CUDA samples are refused
  (void)cuda_stream;
#endif
  return per_sample(who, sample, out, on_cuda,
                    [&](SampleSeq& s) { return host_block_statistics(s, block_q, block_k, want_max, want_g); });
}

// The host route of compute_select_statistics: fp64 scores against the dtype-rounded means.
SelectStatistics host_select_statistics(const SampleSeq& s, int bs, bool pack_gqa) {
  const geom::BlockGeometry g{s.geo, bs, bs};
  const int blocks = g.num_k_blocks();
  // Mean keys per block and KV head, accumulated in double and rounded to fp32 and then to
  // the input dtype: what a kernel stores and scores with (the oracle does the same).
  std::vector<double> means(static_cast<std::size_t>(blocks) * s.h_kv * s.d);
  for (int j = 0; j < blocks; ++j) {
    const auto len = static_cast<double>(g.key_end(j) - g.key_begin(j));
    for (int hk = 0; hk < s.h_kv; ++hk) {
      double* m = &means[(static_cast<std::size_t>(j) * s.h_kv + hk) * s.d];
      for (std::int64_t t = g.key_begin(j); t < g.key_end(j); ++t) {
        for (int i = 0; i < s.d; ++i) m[i] += s.k_row(t, hk)[i];
      }
      for (int i = 0; i < s.d; ++i) m[i] = round_to(s.dtype, static_cast<float>(m[i] / len));
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
      const int scored = scored_blocks(g, i);
      if (scored == 0) continue;
      // x[r, j] = scale · q_r · k̄_j for the pairs whose row sees block j's first key, in
      // the oracle's pair order (row, then head); other pairs add exp(-inf) = 0.
      const std::size_t pairs = static_cast<std::size_t>(g.row_end(i) - g.row_begin(i)) * heads_per_unit;
      x.assign(static_cast<std::size_t>(scored) * pairs, kNegInf);
      double x_max = kNegInf;
      for (int j = 0; j < scored; ++j) {
        const double* kbar = &means[(static_cast<std::size_t>(j) * s.h_kv + hk) * s.d];
        std::size_t n = static_cast<std::size_t>(j) * pairs;
        for (std::int64_t r = g.row_begin(i); r < g.row_end(i); ++r) {
          for (int h = h0; h < h0 + heads_per_unit; ++h, ++n) {
            if (s.geo.position(r) < static_cast<std::int64_t>(j) * bs) continue;
            const double* q = s.q_row(r, h);
            double acc = 0.0;
            for (int dd = 0; dd < s.d; ++dd) acc += q[dd] * kbar[dd];
            x[n] = s.scale * acc;
            x_max = std::max(x_max, x[n]);
          }
        }
      }
      double* ratio = &st.ratio[(static_cast<std::size_t>(unit) * tiles + i) * blocks];
      double e_max = kNegInf;
      for (int j = 0; j < scored; ++j) {
        double e = 0.0;
        for (std::size_t n = 0; n < pairs; ++n) e += std::exp(x[static_cast<std::size_t>(j) * pairs + n] - x_max);
        ratio[j] = e;
        e_max = std::max(e_max, e);
      }
      for (int j = 0; j < scored; ++j) ratio[j] /= e_max;
    }
  });
  return st;
}

Status select_statistics(const char* who, const AttentionProblem& sample, const EstimateSelectParams& base,
                         void* cuda_stream, std::vector<SelectStatistics>* out) {
  if (base.block < 1) return invalid_argument(std::string(who) + ": base.block must be >= 1");
#if defined(SP_WITH_CUDA)
  auto on_cuda = [&](const ProblemShape& shape) { return cuda::select_statistics_cuda(sample, shape, base, cuda_stream, out); };
#else
  const std::nullptr_t on_cuda = nullptr;  // CUDA samples are refused
  (void)cuda_stream;
#endif
  return per_sample(who, sample, out, on_cuda,
                    [&](SampleSeq& s) { return host_select_statistics(s, base.block, base.pack_gqa); });
}

}  // namespace

Status compute_block_statistics(const AttentionProblem& sample, int block_q, int block_k, bool block_max,
                                bool skip_g, std::vector<BlockStatistics>* out, void* cuda_stream) {
  return block_statistics("compute_block_statistics", sample, block_q, block_k, block_max, skip_g, cuda_stream, out);
}

Status compute_select_statistics(const AttentionProblem& sample, const EstimateSelectParams& base,
                                 std::vector<SelectStatistics>* out, void* cuda_stream) {
  return select_statistics("compute_select_statistics", sample, base, cuda_stream, out);
}

// ---------------------------------------------------------------- exact_gate

ExactGateCalibrator::ExactGateCalibrator(int layers, int heads, std::vector<int> budgets,
                                         int block_q, int block_k)
    : layers_(layers), heads_(heads), block_q_(block_q), block_k_(block_k),
      budgets_(std::move(budgets)) {
  const std::size_t rows = static_cast<std::size_t>(std::max(0, layers_)) * budgets_.size() *
                           static_cast<std::size_t>(std::max(0, heads_));
  sum_.resize(rows);
  count_.resize(rows);
}

Status ExactGateCalibrator::check_config() const {
  constexpr const char* kWho = "ExactGateCalibrator";
  if (layers_ < 1 || heads_ < 1 || block_q_ < 1 || block_k_ < 1 || budgets_.empty()) {
    return invalid_argument(std::string(kWho) + ": layers, heads, block sizes must be >= 1 and "
                            "budgets non-empty");
  }
  for (std::size_t i = 0; i < budgets_.size(); ++i) {
    if (budgets_[i] < 1 || (i > 0 && budgets_[i - 1] >= budgets_[i])) {
      return invalid_argument(std::string(kWho) + ": budgets: expected strictly ascending values >= 1");
    }
  }
  return {};
}

Status ExactGateCalibrator::add(int layer, const AttentionProblem& sample, void* cuda_stream) {
  constexpr const char* kWho = "ExactGateCalibrator";
  SP_RETURN_IF_ERROR(check_config());
  SP_RETURN_IF_ERROR(check_layer(kWho, layer, layers_));
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(kWho, sample, &shape));
  if (shape.h_q != heads_) {
    return invalid_argument(std::string(kWho) + ": sample.q: expected " + std::to_string(heads_) +
                            " query heads, got " + std::to_string(shape.h_q));
  }
  std::vector<BlockStatistics> stats;
  SP_RETURN_IF_ERROR(block_statistics(kWho, sample, block_q_, block_k_, true, false, cuda_stream, &stats));
  return add_statistics(layer, stats);
}

Status ExactGateCalibrator::add_statistics(int layer, const std::vector<BlockStatistics>& sample) {
  constexpr const char* kWho = "ExactGateCalibrator";
  SP_RETURN_IF_ERROR(check_config());
  SP_RETURN_IF_ERROR(check_layer(kWho, layer, layers_));
  // Everything is checked before anything accumulates: a rejected call changes nothing.
  for (std::size_t b = 0; b < sample.size(); ++b) {
    const BlockStatistics& st = sample[b];
    geom::BlockGeometry g;
    SP_RETURN_IF_ERROR(check_block_record(kWho, b, st, block_q_, block_k_, &g));
    if (st.heads != heads_) {
      return invalid_argument(std::string(kWho) + ": statistics[" + std::to_string(b) + "]: expected " +
                              std::to_string(heads_) + " query heads, got " + std::to_string(st.heads));
    }
    const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
    SP_RETURN_IF_ERROR(check_size(kWho, "block_max", b, st.block_max.size(),
                                  static_cast<std::size_t>(heads_) * nqb * nkb));
    for (int h = 0; h < heads_; ++h) {
      for (int qb = 0; qb < nqb; ++qb) {
        const std::size_t row = (static_cast<std::size_t>(h) * nqb + qb) * nkb;
        for (int kb = 0; kb < g.full_end(qb); ++kb) {
          if (!std::isfinite(st.block_max[row + kb])) return non_finite_statistic(kWho, "block_max", b, row + kb, st.block_max[row + kb]);
        }
      }
    }
  }
  const std::size_t nb = budgets_.size();
  for (const BlockStatistics& st : sample) {
    const geom::BlockGeometry g{{st.s_q, st.s_k, true}, block_q_, block_k_};
    const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
    // Every sequence is one sample: each (head, absolute position) gets at most one value.
    parallel_for(heads_, [&](int h) {
      std::vector<double> maxima;
      for (int qb = 0; qb < nqb; ++qb) {
        const int full = g.full_end(qb);
        if (full <= budgets_.front()) continue;  // -inf for every budget: not averaged
        const double* bmax = &st.block_max[(static_cast<std::size_t>(h) * nqb + qb) * nkb];
        maxima.assign(bmax, bmax + full);
        std::sort(maxima.begin(), maxima.end(), std::greater<double>());
        const auto pos = static_cast<std::size_t>(g.threshold_position(qb, std::numeric_limits<int>::max()));
        for (std::size_t bi = 0; bi < nb; ++bi) {
          const auto k = static_cast<std::size_t>(budgets_[bi]);
          if (maxima.size() <= k) break;  // budgets ascend: the rest are -inf too
          const std::size_t row = (static_cast<std::size_t>(layer) * nb + bi) * heads_ + h;
          if (sum_[row].size() <= pos) {
            sum_[row].resize(pos + 1, 0.0);
            count_[row].resize(pos + 1, 0);
          }
          sum_[row][pos] += 0.5 * (maxima[k - 1] + maxima[k]);
          count_[row][pos] += 1;
        }
      }
    });
    // A position is covered once any query block sat there, even with -inf thresholds.
    const int last = nqb > 0 ? g.threshold_position(nqb - 1, std::numeric_limits<int>::max()) : -1;
    positions_seen_ = std::max(positions_seen_, last + 1);
  }
  return {};
}

ThresholdTable ExactGateCalibrator::finish() const {
  ThresholdTable t;
  t.layers = layers_;
  t.heads = heads_;
  t.block_q = block_q_;
  t.block_k = block_k_;
  t.budgets = budgets_;
  t.positions = positions_seen_;
  t.values.assign(sum_.size() * static_cast<std::size_t>(std::max(0, positions_seen_)),
                  -std::numeric_limits<float>::infinity());
  for (std::size_t row = 0; row < sum_.size(); ++row) {
    for (std::size_t p = 0; p < sum_[row].size(); ++p) {
      if (count_[row][p] > 0) {
        t.values[row * static_cast<std::size_t>(positions_seen_) + p] =
            static_cast<float>(sum_[row][p] / static_cast<double>(count_[row][p]));
      }
    }
  }
  return t;
}

// ---------------------------------------------------------------- softmax_skip

SoftmaxSkipCalibrator::SoftmaxSkipCalibrator(int layers, int block_q, int block_k)
    : layers_(layers), block_q_(block_q), block_k_(block_k),
      g_(static_cast<std::size_t>(std::max(0, layers))),
      never_skippable_(static_cast<std::size_t>(std::max(0, layers)), 0),
      min_s_k_(static_cast<std::size_t>(std::max(0, layers)), std::numeric_limits<std::int64_t>::max()) {}

Status SoftmaxSkipCalibrator::add(int layer, const AttentionProblem& sample, void* cuda_stream) {
  constexpr const char* kWho = "SoftmaxSkipCalibrator";
  if (block_q_ < 1 || block_k_ < 1) {
    return invalid_argument(std::string(kWho) + ": block sizes must be >= 1");
  }
  SP_RETURN_IF_ERROR(check_layer(kWho, layer, layers_));
  std::vector<BlockStatistics> stats;
  SP_RETURN_IF_ERROR(block_statistics(kWho, sample, block_q_, block_k_, false, true, cuda_stream, &stats));
  return add_statistics(layer, stats);
}

Status SoftmaxSkipCalibrator::add_statistics(int layer, const std::vector<BlockStatistics>& sample) {
  constexpr const char* kWho = "SoftmaxSkipCalibrator";
  if (block_q_ < 1 || block_k_ < 1) {
    return invalid_argument(std::string(kWho) + ": block sizes must be >= 1");
  }
  SP_RETURN_IF_ERROR(check_layer(kWho, layer, layers_));
  for (std::size_t b = 0; b < sample.size(); ++b) {
    const BlockStatistics& st = sample[b];
    geom::BlockGeometry g;
    SP_RETURN_IF_ERROR(check_block_record(kWho, b, st, block_q_, block_k_, &g));
    const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
    SP_RETURN_IF_ERROR(check_size(kWho, "skip_g", b, st.skip_g.size(), static_cast<std::size_t>(st.heads) * nqb * nkb));
    for (int h = 0; h < st.heads; ++h) {
      for (int qb = 0; qb < nqb; ++qb) {
        const std::size_t row = (static_cast<std::size_t>(h) * nqb + qb) * nkb;
        // The entries read: every visible block but the first visited (the last visible).
        for (int kb = 0; kb + 1 < g.visible_end(qb); ++kb) {
          if (std::isnan(st.skip_g[row + kb])) return non_finite_statistic(kWho, "skip_g", b, row + kb, st.skip_g[row + kb]);
        }
      }
    }
  }
  const auto l = static_cast<std::size_t>(layer);
  for (const BlockStatistics& st : sample) {
    if (st.s_k < 1) continue;
    const geom::BlockGeometry g{{st.s_q, st.s_k, true}, block_q_, block_k_};
    const int nqb = g.num_q_blocks(), nkb = g.num_k_blocks();
    for (int h = 0; h < st.heads; ++h) {
      for (int qb = 0; qb < nqb; ++qb) {
        const std::vector<int> order = blasst_order(g, qb);
        if (order.empty()) continue;
        never_skippable_[l] += 1;
        const double* gs = &st.skip_g[(static_cast<std::size_t>(h) * nqb + qb) * nkb];
        for (std::size_t visit = 1; visit < order.size(); ++visit) g_[l].push_back(gs[order[visit]]);
      }
    }
    min_s_k_[l] = std::min(min_s_k_[l], st.s_k);
  }
  return {};
}

Status SoftmaxSkipCalibrator::factor_for(double target_skip_fraction, int layer, double* a) const {
  SP_RETURN_IF_ERROR(check_target(target_skip_fraction, layer, layers_, "target_skip_fraction"));
  std::vector<double> pooled;
  std::int64_t firsts = 0, min_s_k = std::numeric_limits<std::int64_t>::max();
  for (int l = 0; l < layers_; ++l) {
    if (layer != -1 && l != layer) continue;
    const auto u = static_cast<std::size_t>(l);
    if (layer == -1) pooled.insert(pooled.end(), g_[u].begin(), g_[u].end());
    firsts += never_skippable_[u];
    min_s_k = std::min(min_s_k, min_s_k_[u]);
  }
  // One layer's statistics are sorted in place once (add_statistics appends unsorted).
  std::vector<double>& g = layer == -1 ? pooled : g_[static_cast<std::size_t>(layer)];
  if (g.empty()) {
    return invalid_argument("layer " + std::to_string(layer) +
                            ": no skippable blocks seen (add samples first)");
  }
  if (!std::is_sorted(g.begin(), g.end())) parallel_sort(&g, std::less<double>());
  // Skipping is off for a sample with s_k < a, so a stays <= the shortest s_k seen: only
  // statistics below ln(min s_k) can ever be skipped.
  const double ln_cap = std::log(static_cast<double>(min_s_k));
  const std::size_t skippable =
      static_cast<std::size_t>(std::lower_bound(g.begin(), g.end(), ln_cap) - g.begin());
  const double total = static_cast<double>(g.size()) + static_cast<double>(firsts);
  const std::size_t n = nearest_reachable(g.data(), skippable, target_skip_fraction * total);
  // ln a between the n-th and (n+1)-th smallest statistic: exactly n blocks have g < ln a.
  double ln_a = 0.0;
  if (n == 0) {
    ln_a = g.front() - 1.0;
  } else if (n < g.size()) {
    ln_a = std::min(ln_cap, 0.5 * (g[n - 1] + g[n]));
  } else {
    ln_a = ln_cap;
  }
  *a = std::exp(ln_a);
  if (!(*a > 0.0) || !std::isfinite(*a)) {
    return invalid_argument("target_skip_fraction " + std::to_string(target_skip_fraction) +
                            ": the factor a = exp(" + std::to_string(ln_a) +
                            ") is not representable");
  }
  return {};
}


// ---------------------------------------------------------------- estimate_select

EstimateSelectCalibrator::EstimateSelectCalibrator(int layers, EstimateSelectParams base)
    : layers_(layers), base_(base), ratios_(static_cast<std::size_t>(std::max(0, layers))),
      forced_(static_cast<std::size_t>(std::max(0, layers)), 0),
      visible_(static_cast<std::size_t>(std::max(0, layers)), 0) {}

Status EstimateSelectCalibrator::add(int layer, const AttentionProblem& sample, void* cuda_stream) {
  constexpr const char* kWho = "EstimateSelectCalibrator";
  {
    const Status st = validate_policy(base_);
    if (!st.ok()) return invalid_argument(std::string(kWho) + ": base: " + st.message());
  }
  SP_RETURN_IF_ERROR(check_layer(kWho, layer, layers_));
  std::vector<SelectStatistics> stats;
  SP_RETURN_IF_ERROR(select_statistics(kWho, sample, base_, cuda_stream, &stats));
  return add_statistics(layer, stats);
}

Status EstimateSelectCalibrator::add_statistics(int layer, const std::vector<SelectStatistics>& sample) {
  constexpr const char* kWho = "EstimateSelectCalibrator";
  {
    const Status st = validate_policy(base_);
    if (!st.ok()) return invalid_argument(std::string(kWho) + ": base: " + st.message());
  }
  SP_RETURN_IF_ERROR(check_layer(kWho, layer, layers_));
  const int bs = base_.block;
  for (std::size_t b = 0; b < sample.size(); ++b) {
    const SelectStatistics& st = sample[b];
    if (st.block != bs || st.pack_gqa != base_.pack_gqa) {
      return invalid_argument(std::string(kWho) + ": statistics[" + std::to_string(b) + "]: block " +
                              std::to_string(st.block) + (st.pack_gqa ? " pack_gqa" : "") +
                              ", calibrator expects block " + std::to_string(bs) +
                              (base_.pack_gqa ? " pack_gqa" : ""));
    }
    if (st.s_q < 0 || st.s_k < 0 || st.units < 1) {
      return invalid_argument(std::string(kWho) + ": statistics[" + std::to_string(b) +
                              "]: expected s_q, s_k >= 0 and units >= 1");
    }
    const geom::BlockGeometry g{{st.s_q, st.s_k, true}, bs, bs};
    const int tiles = g.num_q_blocks(), blocks = g.num_k_blocks();
    SP_RETURN_IF_ERROR(check_size(kWho, "ratio", b, st.ratio.size(), static_cast<std::size_t>(st.units) * tiles * blocks));
    for (int unit = 0; unit < st.units; ++unit) {
      for (int i = 0; i < tiles; ++i) {
        const std::size_t row = (static_cast<std::size_t>(unit) * tiles + i) * blocks;
        for (int j = 0; j < scored_blocks(g, i); ++j) {
          if (std::isnan(st.ratio[row + j])) return non_finite_statistic(kWho, "ratio", b, row + j, st.ratio[row + j]);
        }
      }
    }
  }
  const auto l = static_cast<std::size_t>(layer);
  for (const SelectStatistics& st : sample) {
    const geom::BlockGeometry g{{st.s_q, st.s_k, true}, bs, bs};
    const int tiles = g.num_q_blocks(), blocks = g.num_k_blocks();
    for (int unit = 0; unit < st.units; ++unit) {
      for (int i = 0; i < tiles; ++i) {
        const std::int64_t a_f = g.seq.position(g.row_begin(i));
        const std::int64_t a_l = g.seq.position(g.row_end(i) - 1);
        if (a_l < 0) continue;
        const std::int64_t fqb = geom::floor_div(a_f, bs), lqb = a_l / bs;
        const int scored = scored_blocks(g, i);
        const bool tail_tile = i >= tiles - base_.tail;
        auto is_forced = [&](std::int64_t j) {
          return tail_tile || j < base_.sink || fqb - base_.window + 1 <= j;
        };
        for (std::int64_t j = 0; j <= lqb; ++j) forced_[l] += is_forced(j);
        visible_[l] += lqb + 1;
        const double* ratio = &st.ratio[(static_cast<std::size_t>(unit) * tiles + i) * blocks];
        for (int j = 0; j < scored; ++j) {
          if (!is_forced(j)) ratios_[l].push_back(ratio[j]);
        }
      }
    }
  }
  return {};
}

Status EstimateSelectCalibrator::alpha_for(double target_density, int layer, double* alpha) const {
  SP_RETURN_IF_ERROR(check_target(target_density, layer, layers_, "target_density"));
  std::vector<double> pooled;
  std::int64_t forced = 0, visible = 0;
  for (int l = 0; l < layers_; ++l) {
    if (layer != -1 && l != layer) continue;
    const auto u = static_cast<std::size_t>(l);
    if (layer == -1) pooled.insert(pooled.end(), ratios_[u].begin(), ratios_[u].end());
    forced += forced_[u];
    visible += visible_[u];
  }
  if (visible == 0) {
    return invalid_argument("layer " + std::to_string(layer) + ": no blocks seen (add samples first)");
  }
  // Descending: keeping the n largest ratios gives density (forced + n) / visible. One
  // layer's ratios are sorted in place once (add_statistics appends unsorted).
  std::vector<double>& r = layer == -1 ? pooled : ratios_[static_cast<std::size_t>(layer)];
  if (!std::is_sorted(r.begin(), r.end(), std::greater<double>())) parallel_sort(&r, std::greater<double>());
  const double wanted = target_density * static_cast<double>(visible) - static_cast<double>(forced);
  const std::size_t n = nearest_reachable(r.data(), r.size(), wanted);
  if (n == 0) {
    // Every ratio is <= 1 (the peak's own ratio is 1), so 2 keeps none of them.
    *alpha = 2.0;
  } else if (n < r.size()) {
    *alpha = 0.5 * (r[n - 1] + r[n]);
  } else {
    *alpha = 0.5 * r.back();
  }
  return {};
}

}  // namespace sparseprefill
