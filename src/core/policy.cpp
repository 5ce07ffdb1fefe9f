// SPDX-License-Identifier: Apache-2.0
// Policy names, descriptions, the key=value parser and parameter validation.
#include "sparseprefill/policy.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace sparseprefill {
namespace {

template <class... F> struct Overloaded : F... { using F::operator()...; };
template <class... F> Overloaded(F...) -> Overloaded<F...>;

Status parse_int(const std::string& key, const std::string& text, int* out) {
  errno = 0;
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0 || v < -(1L << 30) || v > (1L << 30)) {
    return invalid_argument(key + ": expected an integer, got '" + text + "'");
  }
  *out = static_cast<int>(v);
  return {};
}

Status parse_double(const std::string& key, const std::string& text, double* out) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || end != text.c_str() + text.size() || errno != 0) {
    return invalid_argument(key + ": expected a number, got '" + text + "'");
  }
  if (!std::isfinite(v)) return invalid_argument(key + ": expected a finite number, got '" + text + "'");
  *out = v;
  return {};
}

Status parse_bool(const std::string& key, const std::string& text, bool* out) {
  if (text == "1" || text == "true" || text == "on" || text == "yes") { *out = true; return {}; }
  if (text == "0" || text == "false" || text == "off" || text == "no") { *out = false; return {}; }
  return invalid_argument(key + ": expected true/false (or 1/0), got '" + text + "'");
}

Status check_block(const char* name, int v) {
  if (v <= 0) return invalid_argument(std::string(name) + ": expected a positive block size, got " + std::to_string(v));
  return {};
}

}  // namespace

const char* policy_name(const Policy& policy) {
  return std::visit(Overloaded{
      [](const DenseParams&) { return "dense"; },
      [](const BlockSparseParams&) { return "block_sparse"; },
      [](const ExactGateParams&) { return "exact_gate"; },
      [](const SoftmaxSkipParams&) { return "softmax_skip"; },
      [](const EstimateSelectParams&) { return "estimate_select"; },
      [](const PermuteStopParams&) { return "permute_stop"; }}, policy);
}

std::vector<std::string> policy_names() {
  return {"dense", "block_sparse", "exact_gate", "softmax_skip", "estimate_select", "permute_stop"};
}

std::string describe(const Policy& policy) {
  std::ostringstream os;
  os << policy_name(policy);
  std::visit(Overloaded{
      [](const DenseParams&) {},
      [&](const BlockSparseParams& p) {
        os << " block_q=" << p.block_q() << " block_k=" << p.block_k() << (p.per_kv_head() ? " per_kv_head" : "")
           << (p.in_place() ? (p.device_mask.is_csr() ? " device_csr" : " device_flex") : "");
      },
      [&](const ExactGateParams& p) {
        os << " block_q=" << p.block_q << " block_k=" << p.block_k << " thresholds=" << describe(p.thresholds);
      },
      [&](const SoftmaxSkipParams& p) { os << " block_q=" << p.block_q << " block_k=" << p.block_k << " a=" << p.a; },
      [&](const EstimateSelectParams& p) {
        os << " block=" << p.block << " alpha=" << p.alpha << " sink=" << p.sink << " window=" << p.window
           << " tail=" << p.tail << " mean_correction=" << (p.mean_correction ? "true" : "false")
           << " pack_gqa=" << (p.pack_gqa ? "true" : "false");
      },
      [&](const PermuteStopParams& p) {
        os << " segment=" << p.segment << " tau=" << p.tau << " block_q=" << p.block_q << " block_k=" << p.block_k;
      }}, policy);
  return os.str();
}

Status parse_policy(std::string_view name, const std::vector<std::pair<std::string, std::string>>& settings,
                    Policy* out) {
  Policy policy;
  if (name == "dense") policy = DenseParams{};
  else if (name == "block_sparse") policy = BlockSparseParams{};
  else if (name == "exact_gate") policy = ExactGateParams{};
  else if (name == "softmax_skip") policy = SoftmaxSkipParams{};
  else if (name == "estimate_select") policy = EstimateSelectParams{};
  else if (name == "permute_stop") policy = PermuteStopParams{};
  else {
    std::string known;
    for (const auto& n : policy_names()) known += (known.empty() ? "" : ", ") + n;
    return invalid_argument("policy: unknown name '" + std::string(name) + "' (known: " + known + ")");
  }
  for (const auto& setting : settings) {
    // Named references, not structured bindings: clang 14 cannot capture bindings in lambdas.
    const std::string& key = setting.first;
    const std::string& value = setting.second;
    Status st = std::visit(Overloaded{
        [&](DenseParams&) -> Status { return invalid_argument("dense: unknown parameter '" + key + "' (dense takes none)"); },
        [&](BlockSparseParams&) -> Status {
          return invalid_argument("block_sparse: unknown parameter '" + key + "' (the mask is passed as a tensor)");
        },
        [&](ExactGateParams& p) -> Status {
          if (key == "block_q") return parse_int(key, value, &p.block_q);
          if (key == "block_k") return parse_int(key, value, &p.block_k);
          return invalid_argument("exact_gate: unknown parameter '" + key + "' (known: block_q, block_k; thresholds come from a calibration file)");
        },
        [&](SoftmaxSkipParams& p) -> Status {
          if (key == "block_q") return parse_int(key, value, &p.block_q);
          if (key == "block_k") return parse_int(key, value, &p.block_k);
          if (key == "a") return parse_double(key, value, &p.a);
          return invalid_argument("softmax_skip: unknown parameter '" + key + "' (known: block_q, block_k, a)");
        },
        [&](EstimateSelectParams& p) -> Status {
          if (key == "block") return parse_int(key, value, &p.block);
          if (key == "alpha") return parse_double(key, value, &p.alpha);
          if (key == "sink") return parse_int(key, value, &p.sink);
          if (key == "window") return parse_int(key, value, &p.window);
          if (key == "tail") return parse_int(key, value, &p.tail);
          if (key == "mean_correction") return parse_bool(key, value, &p.mean_correction);
          if (key == "pack_gqa") return parse_bool(key, value, &p.pack_gqa);
          return invalid_argument("estimate_select: unknown parameter '" + key +
                                  "' (known: block, alpha, sink, window, tail, mean_correction, pack_gqa)");
        },
        [&](PermuteStopParams& p) -> Status {
          if (key == "segment") return parse_int(key, value, &p.segment);
          if (key == "tau") return parse_double(key, value, &p.tau);
          if (key == "block_q") return parse_int(key, value, &p.block_q);
          if (key == "block_k") return parse_int(key, value, &p.block_k);
          return invalid_argument("permute_stop: unknown parameter '" + key + "' (known: segment, tau, block_q, block_k)");
        }}, policy);
    SP_RETURN_IF_ERROR(st);
  }
  // Tensor-valued parameters (thresholds, mask) are attached later; check the rest now.
  if (!std::holds_alternative<ExactGateParams>(policy) && !std::holds_alternative<BlockSparseParams>(policy)) {
    SP_RETURN_IF_ERROR(validate_policy(policy));
  } else if (auto* g = std::get_if<ExactGateParams>(&policy)) {
    SP_RETURN_IF_ERROR(check_block("block_q", g->block_q));
    SP_RETURN_IF_ERROR(check_block("block_k", g->block_k));
  }
  *out = std::move(policy);
  return {};
}

Status validate_policy(const Policy& policy) {
  return std::visit(Overloaded{
      [](const DenseParams&) -> Status { return {}; },
      [](const BlockSparseParams& p) -> Status {
        if (!p.in_place()) return p.mask.validate();
        if (p.mask.batch != 0) return invalid_argument("mask: give a BlockMask or a device mask, not both");
        if (p.device_mask.block_q < 1 || p.device_mask.block_k < 1) {
          return invalid_argument("mask: block sizes must be >= 1");
        }
        return {};
      },
      [](const ExactGateParams& p) -> Status {
        SP_RETURN_IF_ERROR(check_block("block_q", p.block_q));
        SP_RETURN_IF_ERROR(check_block("block_k", p.block_k));
        const TensorView& t = p.thresholds;
        if (!t.defined()) return invalid_argument("thresholds: required for exact_gate, expected fp32 [h_q, positions]");
        if (t.rank != 2 || t.dtype != DType::kFP32 || t.shape[1] < 1 || t.data == nullptr) {
          return invalid_argument("thresholds: expected fp32 [h_q, positions] with positions >= 1, got " + describe(t));
        }
        return {};
      },
      [](const SoftmaxSkipParams& p) -> Status {
        SP_RETURN_IF_ERROR(check_block("block_q", p.block_q));
        SP_RETURN_IF_ERROR(check_block("block_k", p.block_k));
        if (!std::isfinite(p.a) || p.a <= 0) return invalid_argument("a: expected a finite positive number, got " + std::to_string(p.a));
        return {};
      },
      [](const EstimateSelectParams& p) -> Status {
        SP_RETURN_IF_ERROR(check_block("block", p.block));
        if (!std::isfinite(p.alpha) || p.alpha < 0) return invalid_argument("alpha: expected a finite number >= 0, got " + std::to_string(p.alpha));
        if (p.sink < 0) return invalid_argument("sink: expected >= 0 blocks, got " + std::to_string(p.sink));
        if (p.window < 0) return invalid_argument("window: expected >= 0 blocks, got " + std::to_string(p.window));
        if (p.tail < 0) return invalid_argument("tail: expected >= 0 tiles, got " + std::to_string(p.tail));
        const int cached = int{p.k_block_means.defined()} + int{p.v_block_means.defined()} +
                           int{p.block_means_valid.defined()};
        if (cached != 0 && cached != 3) {
          return invalid_argument("k_block_means, v_block_means, block_means_valid: expected all three or none, got " +
                                  std::to_string(cached));
        }
        return {};
      },
      [](const PermuteStopParams& p) -> Status {
        SP_RETURN_IF_ERROR(check_block("block_q", p.block_q));
        SP_RETURN_IF_ERROR(check_block("block_k", p.block_k));
        if (p.segment <= 0) return invalid_argument("segment: expected a positive length, got " + std::to_string(p.segment));
        if (!std::isfinite(p.tau) || p.tau < 0) return invalid_argument("tau: expected a finite number >= 0, got " + std::to_string(p.tau));
        return {};
      }}, policy);
}

}  // namespace sparseprefill
