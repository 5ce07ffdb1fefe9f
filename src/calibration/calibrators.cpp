// SPDX-License-Identifier: Apache-2.0
// The calibrators of calibration.h: statistics of each layer's Q/K samples (computed by the
// backend of the sample's device, src/dispatch) reduced to the factors that hit a target
// budget, skip fraction or density.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "core/geometry.h"
#include "core/parallel.h"
#include "core/rules/estimate_select.h"
#include "core/rules/softmax_skip.h"
#include "dispatch/dispatch.h"
#include "sparseprefill/calibration.h"

namespace sparseprefill {

namespace {

using detail::parallel_for;
using detail::parallel_sort;
using detail::check_sample;


Status check_layer(const char* who, int layer, int layers) {
  if (layer < 0 || layer >= layers) {
    return invalid_argument(std::string(who) + ": layer: expected 0 .. " + std::to_string(layers - 1) +
                            ", got " + std::to_string(layer));
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
  SP_RETURN_IF_ERROR(detail::block_statistics(kWho, sample, block_q_, block_k_, true, false, cuda_stream, &stats));
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
        for (int kb = 0; kb < g.gated_end(qb); ++kb) {
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
        const int gated = g.gated_end(qb);  // the causal gated blocks: 0 .. gated - 1
        if (gated <= budgets_.front()) continue;  // -inf for every budget: not averaged
        const double* bmax = &st.block_max[(static_cast<std::size_t>(h) * nqb + qb) * nkb];
        maxima.assign(bmax, bmax + gated);
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
  SP_RETURN_IF_ERROR(detail::block_statistics(kWho, sample, block_q_, block_k_, false, true, cuda_stream, &stats));
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
        const std::vector<int> order = rules::blasst_order(g, qb);
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
  SP_RETURN_IF_ERROR(detail::select_statistics(kWho, sample, base_, cuda_stream, &stats));
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
        for (int j = 0; j < rules::estimate_scored_blocks(g, i); ++j) {
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
        // The tail counts the sample's query tiles (calibration has no prompt_len).
        const rules::EstimateTile tile = rules::estimate_tile(g, i, base_.tail, 0);
        if (tile.empty()) continue;
        for (std::int64_t j = 0; j <= tile.lqb; ++j) forced_[l] += rules::estimate_forced(tile.tail, tile.fqb, j, base_.sink, base_.window);
        visible_[l] += tile.lqb + 1;
        const double* ratio = &st.ratio[(static_cast<std::size_t>(unit) * tiles + i) * blocks];
        for (int j = 0; j < tile.scored; ++j) {
          if (!rules::estimate_forced(tile.tail, tile.fqb, j, base_.sink, base_.window)) ratios_[l].push_back(ratio[j]);
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
