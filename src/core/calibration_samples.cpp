// SPDX-License-Identifier: Apache-2.0
// The calibrators of calibration.h: statistics gathered from Q/K samples on the CPU (exact
// block maxima for exact_gate, the BLASST skip statistic for softmax_skip, relative block
// energies for estimate_select) and the factors that hit a target budget, skip fraction or
// density. Scores are scale·q·k in double with the oracle's summation order, so a statistic
// equals what the oracle's decision rule compares.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/geometry.h"
#include "core/tensor_access.h"
#include "sparseprefill/calibration.h"

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

// Validates a calibration sample and resolves its shape: host tensors, causal, finite q/k.
Status check_sample(const char* who, int layer, int layers, const AttentionProblem& sample,
                    ProblemShape* shape) {
  if (layer < 0 || layer >= layers) {
    return invalid_argument(std::string(who) + ": layer: expected 0 .. " + std::to_string(layers - 1) +
                            ", got " + std::to_string(layer));
  }
  Status st = validate_problem(sample, nullptr, shape);
  if (!st.ok()) return Status(st.code(), std::string(who) + ": sample: " + st.message());
  if (shape->device.kind != DeviceKind::kCPU) {
    return invalid_argument(std::string(who) + ": sample: calibration reads host tensors, got q " +
                            describe(sample.q));
  }
  if (!shape->causal) {
    return invalid_argument(std::string(who) + ": sample.causal: calibration expects causal "
                            "(prefill) samples");
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
// `sorted` (n = 0, n = size, or sorted[n-1] != sorted[n]), the one nearest to `wanted`
// (ties: the smaller n).
std::size_t nearest_reachable(const std::vector<double>& sorted, double wanted) {
  std::size_t best = 0;
  double best_dist = std::abs(wanted);
  for (std::size_t n = 1; n <= sorted.size(); ++n) {
    if (n < sorted.size() && sorted[n - 1] == sorted[n]) continue;
    const double dist = std::abs(static_cast<double>(n) - wanted);
    if (dist < best_dist) {
      best = n;
      best_dist = dist;
    }
  }
  return best;
}

}  // namespace

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

Status ExactGateCalibrator::add(int layer, const AttentionProblem& sample) {
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
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(kWho, layer, layers_, sample, &shape));
  if (shape.h_q != heads_) {
    return invalid_argument(std::string(kWho) + ": sample.q: expected " + std::to_string(heads_) +
                            " query heads, got " + std::to_string(shape.h_q));
  }
  SP_RETURN_IF_ERROR(check_all_sequences(kWho, sample, shape));
  const std::size_t nb = budgets_.size();
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(kWho, sample, shape, b, &s));
    const Transposed kt = transpose_keys(s, block_k_);
    std::vector<double>().swap(s.k);  // only the transposed copy is read from here on
    const geom::BlockGeometry g{s.geo, block_q_, block_k_};
    // Every sequence is one sample: each (head, absolute position) gets at most one value.
    parallel_for(heads_, [&](int h) {
      const int hk = s.kv_head(h);
      std::vector<double> row_max(static_cast<std::size_t>(block_q_));
      std::vector<std::int64_t> seen(static_cast<std::size_t>(block_q_));
      std::vector<double> maxima;
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        const int full = g.full_end(qb);
        if (full <= budgets_.front()) continue;  // -inf for every budget: not averaged
        const std::int64_t r0 = g.row_begin(qb);
        const int rows = static_cast<int>(g.row_end(qb) - r0);
        maxima.clear();
        for (int kb = 0; kb < full; ++kb) {
          std::fill(seen.begin(), seen.begin() + rows, g.key_end(kb) - g.key_begin(kb));
          block_row_max(s, h, r0, rows, kt.block(hk, kb), kt.kpad, seen.data(), row_max.data());
          maxima.push_back(*std::max_element(row_max.begin(), row_max.begin() + rows));
        }
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
    const int last = g.num_q_blocks() > 0
                         ? g.threshold_position(g.num_q_blocks() - 1, std::numeric_limits<int>::max())
                         : -1;
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

Status SoftmaxSkipCalibrator::add(int layer, const AttentionProblem& sample) {
  constexpr const char* kWho = "SoftmaxSkipCalibrator";
  if (block_q_ < 1 || block_k_ < 1) {
    return invalid_argument(std::string(kWho) + ": block sizes must be >= 1");
  }
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(kWho, layer, layers_, sample, &shape));
  SP_RETURN_IF_ERROR(check_all_sequences(kWho, sample, shape));
  const auto l = static_cast<std::size_t>(layer);
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(kWho, sample, shape, b, &s));
    if (s.geo.s_k < 1) continue;
    const Transposed kt = transpose_keys(s, block_k_);
    std::vector<double>().swap(s.k);  // only the transposed copy is read from here on
    const geom::BlockGeometry g{s.geo, block_q_, block_k_};
    const double ln_s_k = std::log(static_cast<double>(s.geo.s_k));
    std::vector<std::vector<double>> per_head(static_cast<std::size_t>(s.h_q));
    std::vector<std::int64_t> firsts(static_cast<std::size_t>(s.h_q), 0);
    parallel_for(s.h_q, [&](int h) {
      const int hk = s.kv_head(h);
      std::vector<double>& out = per_head[static_cast<std::size_t>(h)];
      std::vector<double> m_run(static_cast<std::size_t>(block_q_)), tile(static_cast<std::size_t>(block_q_));
      std::vector<std::int64_t> seen(static_cast<std::size_t>(block_q_));
      for (int qb = 0; qb < g.num_q_blocks(); ++qb) {
        // BLASST order: partial blocks, then full blocks, each descending.
        std::vector<int> order;
        for (int kb = g.visible_end(qb) - 1; kb >= g.full_end(qb); --kb) order.push_back(kb);
        for (int kb = g.full_end(qb) - 1; kb >= 0; --kb) order.push_back(kb);
        if (order.empty()) continue;
        firsts[static_cast<std::size_t>(h)] += 1;
        const std::int64_t r0 = g.row_begin(qb);
        const int rows = static_cast<int>(g.row_end(qb) - r0);
        std::fill(m_run.begin(), m_run.begin() + rows, kNegInf);
        for (std::size_t visit = 0; visit < order.size(); ++visit) {
          const int kb = order[visit];
          for (int i = 0; i < rows; ++i) seen[static_cast<std::size_t>(i)] = seen_in_block(g, r0 + i, kb);
          block_row_max(s, h, r0, rows, kt.block(hk, kb), kt.kpad, seen.data(), tile.data());
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
            out.push_back(stat + ln_s_k);
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
    for (int h = 0; h < s.h_q; ++h) {
      const auto& v = per_head[static_cast<std::size_t>(h)];
      g_[l].insert(g_[l].end(), v.begin(), v.end());
      never_skippable_[l] += firsts[static_cast<std::size_t>(h)];
    }
    min_s_k_[l] = std::min(min_s_k_[l], s.geo.s_k);
  }
  return {};
}

Status SoftmaxSkipCalibrator::factor_for(double target_skip_fraction, int layer, double* a) const {
  SP_RETURN_IF_ERROR(check_target(target_skip_fraction, layer, layers_, "target_skip_fraction"));
  std::vector<double> g;
  std::int64_t firsts = 0, min_s_k = std::numeric_limits<std::int64_t>::max();
  for (int l = 0; l < layers_; ++l) {
    if (layer != -1 && l != layer) continue;
    const auto u = static_cast<std::size_t>(l);
    g.insert(g.end(), g_[u].begin(), g_[u].end());
    firsts += never_skippable_[u];
    min_s_k = std::min(min_s_k, min_s_k_[u]);
  }
  if (g.empty()) {
    return invalid_argument("layer " + std::to_string(layer) +
                            ": no skippable blocks seen (add samples first)");
  }
  std::sort(g.begin(), g.end());
  // Skipping is off for a sample with s_k < a, so a stays <= the shortest s_k seen: only
  // statistics below ln(min s_k) can ever be skipped.
  const double ln_cap = std::log(static_cast<double>(min_s_k));
  const std::size_t skippable =
      static_cast<std::size_t>(std::lower_bound(g.begin(), g.end(), ln_cap) - g.begin());
  std::vector<double> usable(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(skippable));
  const double total = static_cast<double>(g.size()) + static_cast<double>(firsts);
  const std::size_t n = nearest_reachable(usable, target_skip_fraction * total);
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

Status EstimateSelectCalibrator::add(int layer, const AttentionProblem& sample) {
  constexpr const char* kWho = "EstimateSelectCalibrator";
  {
    const Status st = validate_policy(base_);
    if (!st.ok()) return invalid_argument(std::string(kWho) + ": base: " + st.message());
  }
  ProblemShape shape;
  SP_RETURN_IF_ERROR(check_sample(kWho, layer, layers_, sample, &shape));
  SP_RETURN_IF_ERROR(check_all_sequences(kWho, sample, shape));
  const auto l = static_cast<std::size_t>(layer);
  const int bs = base_.block;
  for (int b = 0; b < shape.batch; ++b) {
    SampleSeq s;
    SP_RETURN_IF_ERROR(gather_seq(kWho, sample, shape, b, &s));
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
    const int units = base_.pack_gqa ? s.h_kv : s.h_q;
    const int heads_per_unit = base_.pack_gqa ? s.h_q / s.h_kv : 1;
    const int tiles = g.num_q_blocks();
    std::vector<std::vector<double>> per_unit(static_cast<std::size_t>(units));
    std::vector<std::int64_t> forced(static_cast<std::size_t>(units), 0), visible(forced);
    parallel_for(units, [&](int unit) {
      const int h0 = unit * heads_per_unit;
      const int hk = s.kv_head(h0);
      std::vector<double> x, energy;
      for (int i = 0; i < tiles; ++i) {
        const std::int64_t a_f = s.geo.position(g.row_begin(i));
        const std::int64_t a_l = s.geo.position(g.row_end(i) - 1);
        if (a_l < 0) continue;
        const std::int64_t fqb = geom::floor_div(a_f, bs), lqb = a_l / bs;
        const int scored = static_cast<int>((a_l + 1) / bs);
        const bool tail_tile = i >= tiles - base_.tail;
        auto is_forced = [&](std::int64_t j) {
          return tail_tile || j < base_.sink || fqb - base_.window + 1 <= j;
        };
        std::int64_t n_forced = 0;
        for (std::int64_t j = 0; j <= lqb; ++j) n_forced += is_forced(j);
        forced[static_cast<std::size_t>(unit)] += n_forced;
        visible[static_cast<std::size_t>(unit)] += lqb + 1;
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
        energy.assign(static_cast<std::size_t>(scored), 0.0);
        double e_max = kNegInf;
        for (int j = 0; j < scored; ++j) {
          double e = 0.0;
          for (std::size_t n = 0; n < pairs; ++n) e += std::exp(x[static_cast<std::size_t>(j) * pairs + n] - x_max);
          energy[static_cast<std::size_t>(j)] = e;
          e_max = std::max(e_max, e);
        }
        for (int j = 0; j < scored; ++j) {
          if (!is_forced(j)) per_unit[static_cast<std::size_t>(unit)].push_back(energy[static_cast<std::size_t>(j)] / e_max);
        }
      }
    });
    for (int u = 0; u < units; ++u) {
      const auto& v = per_unit[static_cast<std::size_t>(u)];
      ratios_[l].insert(ratios_[l].end(), v.begin(), v.end());
      forced_[l] += forced[static_cast<std::size_t>(u)];
      visible_[l] += visible[static_cast<std::size_t>(u)];
    }
  }
  return {};
}

Status EstimateSelectCalibrator::alpha_for(double target_density, int layer, double* alpha) const {
  SP_RETURN_IF_ERROR(check_target(target_density, layer, layers_, "target_density"));
  std::vector<double> r;
  std::int64_t forced = 0, visible = 0;
  for (int l = 0; l < layers_; ++l) {
    if (layer != -1 && l != layer) continue;
    const auto u = static_cast<std::size_t>(l);
    r.insert(r.end(), ratios_[u].begin(), ratios_[u].end());
    forced += forced_[u];
    visible += visible_[u];
  }
  if (visible == 0) {
    return invalid_argument("layer " + std::to_string(layer) + ": no blocks seen (add samples first)");
  }
  // Descending: keeping the n largest ratios gives density (forced + n) / visible.
  std::sort(r.begin(), r.end(), std::greater<double>());
  const double wanted = target_density * static_cast<double>(visible) - static_cast<double>(forced);
  const std::size_t n = nearest_reachable(r, wanted);
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
