// SPDX-License-Identifier: Apache-2.0
// CalibrationRun (calibration.h): the three calibrators of one run behind one add() per layer
// and the Calibration record their factors make.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "sparseprefill/calibration.h"

namespace sparseprefill {

namespace {

Status check_ascending(const char* name, const std::vector<double>& v, double lo, double hi) {
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i]) || v[i] < lo || v[i] > hi) {
      return invalid_argument(std::string(name) + "[" + std::to_string(i) + "]: expected a fraction in [0, 1], got " +
                              std::to_string(v[i]));
    }
    if (i > 0 && !(v[i - 1] < v[i])) return invalid_argument(std::string(name) + ": expected strictly ascending values");
  }
  return {};
}

}  // namespace

CalibrationRun::CalibrationRun(const CalibrationTargets& targets) : targets_(targets) {
  const CalibrationTargets& t = targets_;
  if (!t.budgets.empty()) gate_ = std::make_unique<ExactGateCalibrator>(t.layers, t.heads, t.budgets, t.block_q, t.block_k);
  if (!t.skip_targets.empty()) skip_ = std::make_unique<SoftmaxSkipCalibrator>(t.layers, t.block_q, t.block_k);
  if (!t.density_targets.empty()) select_ = std::make_unique<EstimateSelectCalibrator>(t.layers, t.estimate);
}

Status CalibrationRun::create(const CalibrationTargets& t, std::unique_ptr<CalibrationRun>* out) {
  if (t.budgets.empty() && t.skip_targets.empty() && t.density_targets.empty()) {
    return invalid_argument("calibration targets: expected at least one of budgets, skip_targets, density_targets");
  }
  if (t.layers < 1 || t.block_q < 1 || t.block_k < 1 || (!t.budgets.empty() && t.heads < 1)) {
    return invalid_argument("calibration targets: layers, block_q, block_k (and heads with budgets) must be >= 1, got layers " +
                            std::to_string(t.layers) + ", heads " + std::to_string(t.heads) + ", blocks " +
                            std::to_string(t.block_q) + "x" + std::to_string(t.block_k));
  }
  for (std::size_t i = 0; i < t.budgets.size(); ++i) {
    if (t.budgets[i] < 1 || (i > 0 && t.budgets[i - 1] >= t.budgets[i])) {
      return invalid_argument("calibration targets: budgets: expected strictly ascending values >= 1");
    }
  }
  SP_RETURN_IF_ERROR(check_ascending("calibration targets: skip_targets", t.skip_targets, 0.0, 1.0));
  SP_RETURN_IF_ERROR(check_ascending("calibration targets: density_targets", t.density_targets, 0.0, 1.0));
  if (!t.density_targets.empty()) {
    const Status st = validate_policy(t.estimate);
    if (!st.ok()) return invalid_argument("calibration targets: estimate: " + st.message());
  }
  out->reset(new CalibrationRun(t));
  return {};
}

Status CalibrationRun::add(int layer, const AttentionProblem& sample, void* cuda_stream) {
  if (layer < 0 || layer >= targets_.layers) {
    return invalid_argument("CalibrationRun: layer: expected 0 .. " + std::to_string(targets_.layers - 1) + ", got " +
                            std::to_string(layer));
  }
  // Every statistic first, then the reductions: a failure to compute adds nothing anywhere.
  std::vector<BlockStatistics> blocks;
  std::vector<SelectStatistics> select;
  if (gate_ || skip_) {
    SP_RETURN_IF_ERROR(compute_block_statistics(sample, targets_.block_q, targets_.block_k, gate_ != nullptr,
                                                skip_ != nullptr, &blocks, cuda_stream));
  }
  if (select_) SP_RETURN_IF_ERROR(compute_select_statistics(sample, targets_.estimate, &select, cuda_stream));
  if (gate_) SP_RETURN_IF_ERROR(gate_->add_statistics(layer, blocks));
  if (skip_) SP_RETURN_IF_ERROR(skip_->add_statistics(layer, blocks));
  if (select_) SP_RETURN_IF_ERROR(select_->add_statistics(layer, select));
  return {};
}

Status CalibrationRun::finish(Calibration* out) const {
  Calibration cal;
  const CalibrationTargets& t = targets_;
  cal.layers = t.layers;
  if (gate_) cal.exact_gate = gate_->finish();
  if (skip_) {
    cal.skip_block_q = t.block_q;
    cal.skip_block_k = t.block_k;
    for (double target : t.skip_targets) cal.skip_targets.push_back(static_cast<float>(target));
    for (int l = 0; l < t.layers; ++l) {
      for (double target : t.skip_targets) {
        double a = 0;
        SP_RETURN_IF_ERROR(skip_->factor_for(target, l, &a));
        cal.skip_a.push_back(static_cast<float>(a));
      }
    }
  }
  if (select_) {
    cal.estimate_base = t.estimate;
    for (double target : t.density_targets) cal.density_targets.push_back(static_cast<float>(target));
    for (int l = 0; l < t.layers; ++l) {
      for (double target : t.density_targets) {
        double alpha = 0;
        SP_RETURN_IF_ERROR(select_->alpha_for(target, l, &alpha));
        cal.alpha.push_back(static_cast<float>(alpha));
      }
    }
  }
  *out = std::move(cal);
  return {};
}

}  // namespace sparseprefill
