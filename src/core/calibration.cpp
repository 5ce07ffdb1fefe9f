// SPDX-License-Identifier: Apache-2.0
// Threshold tables, the Calibration record and its safetensors file (docs/file-formats.md):
// validation of every field, the writer, and a reader that rejects anything missing,
// unexpected or inconsistent instead of filling in defaults.
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "sparseprefill/calibration.h"
#include "sparseprefill/safetensors.h"

namespace sparseprefill {

namespace {

constexpr const char* kFormat = "sparseprefill.calibration";
constexpr const char* kFormatVersion = "1";

// Metadata keys the file format owns; Calibration::metadata may not use them.
constexpr const char* kKeyFormat = "format";
constexpr const char* kKeyVersion = "format_version";
constexpr const char* kKeyLayers = "layers";
const char* const kSectionPrefixes[] = {"exact_gate.", "softmax_skip.", "estimate_select."};

constexpr const char* kGateThresholds = "exact_gate.thresholds";
constexpr const char* kGateBudgets = "exact_gate.budgets";
constexpr const char* kSkipTargets = "softmax_skip.targets";
constexpr const char* kSkipA = "softmax_skip.a";
constexpr const char* kSelectTargets = "estimate_select.targets";
constexpr const char* kSelectAlpha = "estimate_select.alpha";

const char* const kGateMeta[] = {"exact_gate.layers", "exact_gate.heads", "exact_gate.positions",
                                 "exact_gate.block_q", "exact_gate.block_k"};
const char* const kSkipMeta[] = {"softmax_skip.block_q", "softmax_skip.block_k"};
const char* const kSelectMeta[] = {"estimate_select.block", "estimate_select.sink",
                                   "estimate_select.window", "estimate_select.tail",
                                   "estimate_select.mean_correction",
                                   "estimate_select.pack_gqa"};

// Bounds on table dimensions; far beyond real models, small enough that products fit.
constexpr std::int64_t kMaxDim = 1 << 20;

bool is_reserved_key(const std::string& key) {
  if (key == kKeyFormat || key == kKeyVersion || key == kKeyLayers) return true;
  for (const char* p : kSectionPrefixes) {
    if (key.rfind(p, 0) == 0) return true;
  }
  return false;
}

std::string list_string(const std::vector<std::int64_t>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

std::string float_string(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.9g", x);
  return buf;
}

// Targets: finite, in [0, 1], strictly ascending.
Status check_targets(const char* name, const std::vector<float>& targets) {
  for (std::size_t i = 0; i < targets.size(); ++i) {
    const float t = targets[i];
    if (!std::isfinite(t) || t < 0.0f || t > 1.0f) {
      return invalid_argument(std::string(name) + "[" + std::to_string(i) +
                              "]: expected a fraction in [0, 1], got " + float_string(t));
    }
    if (i > 0 && !(targets[i - 1] < t)) {
      return invalid_argument(std::string(name) + ": must be strictly ascending, got " +
                              float_string(targets[i - 1]) + " then " + float_string(t));
    }
  }
  return {};
}

}  // namespace

float ThresholdTable::at(int layer, int budget_index, int head, int position) const {
  const int p = position < 0 ? 0 : (position >= positions ? positions - 1 : position);
  const std::size_t row =
      (static_cast<std::size_t>(layer) * budgets.size() + static_cast<std::size_t>(budget_index)) *
          static_cast<std::size_t>(heads) + static_cast<std::size_t>(head);
  return values[row * static_cast<std::size_t>(positions) + static_cast<std::size_t>(p)];
}

HostTensor ThresholdTable::slice(int layer, int budget_index) const {
  HostTensor t(DType::kFP32, {heads, positions});
  float* out = t.as<float>();
  for (int h = 0; h < heads; ++h) {
    for (int p = 0; p < positions; ++p) {
      out[static_cast<std::size_t>(h) * positions + p] = at(layer, budget_index, h, p);
    }
  }
  return t;
}

Status ThresholdTable::validate() const {
  const std::pair<const char*, int> dims[] = {{"layers", layers},   {"heads", heads},
                                              {"positions", positions}, {"block_q", block_q},
                                              {"block_k", block_k}};
  for (const auto& [name, value] : dims) {
    if (value < 1 || value > kMaxDim) {
      return invalid_argument(std::string("exact_gate.") + name + ": expected 1 .. " +
                              std::to_string(kMaxDim) + ", got " + std::to_string(value));
    }
  }
  if (budgets.empty() || budgets.size() > static_cast<std::size_t>(kMaxDim)) {
    return invalid_argument("exact_gate.budgets: expected at least one budget, got none");
  }
  for (std::size_t i = 0; i < budgets.size(); ++i) {
    if (budgets[i] < 1) {
      return invalid_argument("exact_gate.budgets[" + std::to_string(i) +
                              "]: expected a block count >= 1, got " + std::to_string(budgets[i]));
    }
    if (i > 0 && budgets[i - 1] >= budgets[i]) {
      return invalid_argument("exact_gate.budgets: must be strictly ascending, got " +
                              std::to_string(budgets[i - 1]) + " then " +
                              std::to_string(budgets[i]));
    }
  }
  const std::size_t nb = budgets.size();
  const std::size_t expected = static_cast<std::size_t>(layers) * nb *
                               static_cast<std::size_t>(heads) * static_cast<std::size_t>(positions);
  if (values.size() != expected) {
    return invalid_argument("exact_gate.thresholds: expected " + std::to_string(expected) +
                            " values [layers, budgets, heads, positions] = " +
                            list_string({layers, static_cast<std::int64_t>(nb), heads, positions}) +
                            ", got " + std::to_string(values.size()));
  }
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float v = values[i];
    // -inf means "keep everything" and is meaningful; NaN and +inf are never produced by
    // calibration and would make the gate skip every block.
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) {
      const std::size_t p = i % positions, h = i / positions % heads;
      const std::size_t b = i / positions / heads % nb, l = i / positions / heads / nb;
      return invalid_argument("exact_gate.thresholds: " + float_string(v) + " at [layer " +
                              std::to_string(l) + ", budget " + std::to_string(b) + ", head " +
                              std::to_string(h) + ", position " + std::to_string(p) +
                              "] (finite or -inf expected)");
    }
  }
  return {};
}

Status Calibration::validate() const {
  for (const auto& [key, value] : metadata) {
    if (key.empty()) return invalid_argument("metadata: empty key");
    if (is_reserved_key(key)) {
      return invalid_argument("metadata: key '" + key + "' is reserved by the file format");
    }
  }
  const bool gate = !exact_gate.values.empty() || !exact_gate.budgets.empty();
  const bool skip = !skip_targets.empty() || !skip_a.empty();
  const bool select = !density_targets.empty() || !alpha.empty();
  if (gate) SP_RETURN_IF_ERROR(exact_gate.validate());
  if (layers < 0 || layers > kMaxDim) {
    return invalid_argument("layers: expected 0 .. " + std::to_string(kMaxDim) + ", got " +
                            std::to_string(layers));
  }
  if ((skip || select) && layers < 1) {
    return invalid_argument("layers: expected >= 1 with softmax_skip or estimate_select results, "
                            "got " + std::to_string(layers));
  }
  if (gate && layers != 0 && layers != exact_gate.layers) {
    return invalid_argument("layers: " + std::to_string(layers) + " disagrees with exact_gate.layers " +
                            std::to_string(exact_gate.layers));
  }
  if (skip) {
    if (skip_targets.empty()) return invalid_argument("softmax_skip.targets: empty but a is not");
    SP_RETURN_IF_ERROR(check_targets("softmax_skip.targets", skip_targets));
    const std::size_t expected = static_cast<std::size_t>(layers) * skip_targets.size();
    if (skip_a.size() != expected) {
      return invalid_argument("softmax_skip.a: expected [layers, targets] = " +
                              list_string({layers, static_cast<std::int64_t>(skip_targets.size())}) +
                              " values, got " + std::to_string(skip_a.size()));
    }
    for (std::size_t i = 0; i < skip_a.size(); ++i) {
      const Status st = validate_policy(SoftmaxSkipParams{skip_block_q, skip_block_k, skip_a[i]});
      if (!st.ok()) {
        return invalid_argument("softmax_skip.a[layer " + std::to_string(i / skip_targets.size()) +
                                ", target " + std::to_string(i % skip_targets.size()) +
                                "]: " + st.message());
      }
    }
  }
  if (select) {
    if (density_targets.empty()) return invalid_argument("estimate_select.targets: empty but alpha is not");
    SP_RETURN_IF_ERROR(check_targets("estimate_select.targets", density_targets));
    const std::size_t expected = static_cast<std::size_t>(layers) * density_targets.size();
    if (alpha.size() != expected) {
      return invalid_argument("estimate_select.alpha: expected [layers, targets] = " +
                              list_string({layers, static_cast<std::int64_t>(density_targets.size())}) +
                              " values, got " + std::to_string(alpha.size()));
    }
    for (std::size_t i = 0; i < alpha.size(); ++i) {
      EstimateSelectParams p = estimate_base;
      p.alpha = alpha[i];
      const Status st = validate_policy(p);
      if (!st.ok()) {
        return invalid_argument("estimate_select.alpha[layer " +
                                std::to_string(i / density_targets.size()) + ", target " +
                                std::to_string(i % density_targets.size()) + "]: " + st.message());
      }
    }
  }
  return {};
}

namespace {

HostTensor f32_tensor(const std::vector<float>& values, std::vector<std::int64_t> shape) {
  HostTensor t(DType::kFP32, std::move(shape));
  std::copy(values.begin(), values.end(), t.as<float>());
  return t;
}

Status to_file(const Calibration& c, SafetensorsFile* file) {
  {
    const Status st = c.validate();
    if (!st.ok()) return invalid_argument("calibration: " + st.message());
  }
  std::map<std::string, std::string>& meta = file->metadata;
  meta = c.metadata;
  meta[kKeyFormat] = kFormat;
  meta[kKeyVersion] = kFormatVersion;
  meta[kKeyLayers] = std::to_string(c.layers);
  if (!c.exact_gate.values.empty()) {
    const ThresholdTable& t = c.exact_gate;
    meta["exact_gate.layers"] = std::to_string(t.layers);
    meta["exact_gate.heads"] = std::to_string(t.heads);
    meta["exact_gate.positions"] = std::to_string(t.positions);
    meta["exact_gate.block_q"] = std::to_string(t.block_q);
    meta["exact_gate.block_k"] = std::to_string(t.block_k);
    const auto nb = static_cast<std::int64_t>(t.budgets.size());
    file->tensors[kGateThresholds] = f32_tensor(t.values, {t.layers, nb, t.heads, t.positions});
    HostTensor budgets(DType::kInt32, {nb});
    std::copy(t.budgets.begin(), t.budgets.end(), budgets.as<std::int32_t>());
    file->tensors[kGateBudgets] = std::move(budgets);
  }
  if (!c.skip_targets.empty()) {
    const auto nt = static_cast<std::int64_t>(c.skip_targets.size());
    meta["softmax_skip.block_q"] = std::to_string(c.skip_block_q);
    meta["softmax_skip.block_k"] = std::to_string(c.skip_block_k);
    file->tensors[kSkipTargets] = f32_tensor(c.skip_targets, {nt});
    file->tensors[kSkipA] = f32_tensor(c.skip_a, {c.layers, nt});
  }
  if (!c.density_targets.empty()) {
    const auto nt = static_cast<std::int64_t>(c.density_targets.size());
    const EstimateSelectParams& b = c.estimate_base;
    meta["estimate_select.block"] = std::to_string(b.block);
    meta["estimate_select.sink"] = std::to_string(b.sink);
    meta["estimate_select.window"] = std::to_string(b.window);
    meta["estimate_select.tail"] = std::to_string(b.tail);
    meta["estimate_select.mean_correction"] = b.mean_correction ? "true" : "false";
    meta["estimate_select.pack_gqa"] = b.pack_gqa ? "true" : "false";
    file->tensors[kSelectTargets] = f32_tensor(c.density_targets, {nt});
    file->tensors[kSelectAlpha] = f32_tensor(c.alpha, {c.layers, nt});
  }
  return {};
}

// Reads a file that parse_safetensors accepted; every inconsistency is kCorruptData.
class Reader {
 public:
  explicit Reader(const SafetensorsFile& file) : file_(file) {}

  Status read(Calibration* c) {
    const auto format = file_.metadata.find(kKeyFormat);
    if (format == file_.metadata.end()) {
      return corrupt_data("metadata 'format' is missing: not a sparseprefill calibration file");
    }
    if (format->second != kFormat) {
      return corrupt_data("metadata 'format' is '" + format->second + "', expected '" + kFormat + "'");
    }
    const auto version = file_.metadata.find(kKeyVersion);
    if (version == file_.metadata.end()) return corrupt_data("metadata 'format_version' is missing");
    if (version->second != kFormatVersion) {
      return corrupt_data("format_version '" + version->second + "' is not supported (this build reads " +
                          kFormatVersion + ")");
    }
    SP_RETURN_IF_ERROR(check_names());
    SP_RETURN_IF_ERROR(get_int(kKeyLayers, 0, &c->layers));
    for (const auto& [key, value] : file_.metadata) {
      if (!is_reserved_key(key)) c->metadata[key] = value;
    }

    bool present = false;
    SP_RETURN_IF_ERROR(section("exact_gate", {kGateThresholds, kGateBudgets}, kGateMeta, &present));
    if (present) {
      ThresholdTable& t = c->exact_gate;
      SP_RETURN_IF_ERROR(get_int("exact_gate.layers", 1, &t.layers));
      SP_RETURN_IF_ERROR(get_int("exact_gate.heads", 1, &t.heads));
      SP_RETURN_IF_ERROR(get_int("exact_gate.positions", 1, &t.positions));
      SP_RETURN_IF_ERROR(get_int("exact_gate.block_q", 1, &t.block_q));
      SP_RETURN_IF_ERROR(get_int("exact_gate.block_k", 1, &t.block_k));
      const HostTensor& budgets = file_.tensors.at(kGateBudgets);
      if (budgets.dtype() != DType::kInt32 || budgets.shape().size() != 1 || budgets.numel() < 1) {
        return corrupt_data(std::string(kGateBudgets) + ": expected I32 [budgets] with at least one "
                            "budget, got " + describe_tensor(budgets));
      }
      t.budgets.assign(budgets.as<std::int32_t>(), budgets.as<std::int32_t>() + budgets.numel());
      SP_RETURN_IF_ERROR(get_f32(kGateThresholds,
                                 {t.layers, budgets.numel(), t.heads, t.positions}, &t.values));
    }
    SP_RETURN_IF_ERROR(section("softmax_skip", {kSkipTargets, kSkipA}, kSkipMeta, &present));
    if (present) {
      SP_RETURN_IF_ERROR(get_int("softmax_skip.block_q", 1, &c->skip_block_q));
      SP_RETURN_IF_ERROR(get_int("softmax_skip.block_k", 1, &c->skip_block_k));
      SP_RETURN_IF_ERROR(get_targets(kSkipTargets, &c->skip_targets));
      SP_RETURN_IF_ERROR(get_f32(kSkipA, {c->layers, static_cast<std::int64_t>(c->skip_targets.size())},
                                 &c->skip_a));
    }
    SP_RETURN_IF_ERROR(section("estimate_select", {kSelectTargets, kSelectAlpha}, kSelectMeta, &present));
    if (present) {
      EstimateSelectParams& b = c->estimate_base;
      SP_RETURN_IF_ERROR(get_int("estimate_select.block", 1, &b.block));
      SP_RETURN_IF_ERROR(get_int("estimate_select.sink", 0, &b.sink));
      SP_RETURN_IF_ERROR(get_int("estimate_select.window", 0, &b.window));
      SP_RETURN_IF_ERROR(get_int("estimate_select.tail", 0, &b.tail));
      SP_RETURN_IF_ERROR(get_bool("estimate_select.mean_correction", &b.mean_correction));
      SP_RETURN_IF_ERROR(get_bool("estimate_select.pack_gqa", &b.pack_gqa));
      SP_RETURN_IF_ERROR(get_targets(kSelectTargets, &c->density_targets));
      SP_RETURN_IF_ERROR(get_f32(kSelectAlpha,
                                 {c->layers, static_cast<std::int64_t>(c->density_targets.size())},
                                 &c->alpha));
    }
    const Status st = c->validate();
    if (!st.ok()) return corrupt_data(st.message());
    return {};
  }

 private:
  static std::string describe_tensor(const HostTensor& t) {
    return list_string(t.shape()) + " " + dtype_name(t.dtype());
  }

  // Every tensor is one we know; every reserved metadata key is one we know.
  Status check_names() const {
    const std::set<std::string> tensors = {kGateThresholds, kGateBudgets, kSkipTargets,
                                           kSkipA,          kSelectTargets, kSelectAlpha};
    for (const auto& kv : file_.tensors) {
      if (!tensors.count(kv.first)) return corrupt_data("unexpected tensor '" + kv.first + "'");
    }
    std::set<std::string> keys = {kKeyFormat, kKeyVersion, kKeyLayers};
    for (const char* k : kGateMeta) keys.insert(k);
    for (const char* k : kSkipMeta) keys.insert(k);
    for (const char* k : kSelectMeta) keys.insert(k);
    for (const auto& kv : file_.metadata) {
      if (is_reserved_key(kv.first) && !keys.count(kv.first)) {
        return corrupt_data("unexpected metadata key '" + kv.first + "'");
      }
    }
    return {};
  }

  // A section is present when any of its tensors or metadata keys is; then all must be.
  template <std::size_t N>
  Status section(const char* name, std::initializer_list<const char*> tensors,
                 const char* const (&meta)[N], bool* present) const {
    std::vector<std::string> have, missing;
    for (const char* t : tensors) (file_.tensors.count(t) ? have : missing).push_back(t);
    for (const char* k : meta) (file_.metadata.count(k) ? have : missing).push_back(k);
    *present = !have.empty();
    if (*present && !missing.empty()) {
      return corrupt_data(std::string(name) + ": '" + missing.front() + "' is missing ('" +
                          have.front() + "' is present)");
    }
    return {};
  }

  Status get_int(const char* key, int min_value, int* out) const {
    const auto it = file_.metadata.find(key);
    if (it == file_.metadata.end()) return corrupt_data("metadata '" + std::string(key) + "' is missing");
    const std::string& s = it->second;
    // At most 9 digits, checked before accumulating: no overflow whatever the text.
    std::int64_t v = 0;
    bool ok = !s.empty() && s.size() <= 9;
    for (std::size_t i = 0; ok && i < s.size(); ++i) {
      const char ch = s[i];
      if (ch < '0' || ch > '9') ok = false;
      else v = v * 10 + (ch - '0');
    }
    if (!ok || v < min_value || v > kMaxDim) {
      return corrupt_data("metadata '" + std::string(key) + "': expected an integer in " +
                          std::to_string(min_value) + " .. " + std::to_string(kMaxDim) +
                          ", got '" + s + "'");
    }
    *out = static_cast<int>(v);
    return {};
  }

  Status get_bool(const char* key, bool* out) const {
    const std::string& s = file_.metadata.at(key);
    if (s != "true" && s != "false") {
      return corrupt_data("metadata '" + std::string(key) + "': expected 'true' or 'false', got '" +
                          s + "'");
    }
    *out = s == "true";
    return {};
  }

  Status get_f32(const char* name, const std::vector<std::int64_t>& shape,
                 std::vector<float>* out) const {
    const HostTensor& t = file_.tensors.at(name);
    if (t.dtype() != DType::kFP32 || t.shape() != shape) {
      return corrupt_data(std::string(name) + ": expected " + list_string(shape) +
                          " fp32 (from the metadata), got " + describe_tensor(t));
    }
    out->assign(t.as<float>(), t.as<float>() + t.numel());
    return {};
  }

  Status get_targets(const char* name, std::vector<float>* out) const {
    const HostTensor& t = file_.tensors.at(name);
    if (t.dtype() != DType::kFP32 || t.shape().size() != 1 || t.numel() < 1) {
      return corrupt_data(std::string(name) + ": expected fp32 [targets] with at least one "
                          "target, got " + describe_tensor(t));
    }
    out->assign(t.as<float>(), t.as<float>() + t.numel());
    return {};
  }

  const SafetensorsFile& file_;
};

Status from_file(const SafetensorsFile& file, Calibration* calibration) {
  Calibration c;
  SP_RETURN_IF_ERROR(Reader(file).read(&c));
  *calibration = std::move(c);
  return {};
}

}  // namespace

Status save_calibration(const std::string& path, const Calibration& calibration) {
  SafetensorsFile file;
  SP_RETURN_IF_ERROR(to_file(calibration, &file));
  return write_safetensors(path, file);
}

Status load_calibration(const std::string& path, Calibration* calibration) {
  *calibration = Calibration();
  SafetensorsFile file;
  SP_RETURN_IF_ERROR(read_safetensors(path, &file));
  const Status st = from_file(file, calibration);
  if (!st.ok()) return Status(st.code(), path + ": " + st.message());
  return {};
}

Status parse_calibration(const std::uint8_t* data, std::size_t size, Calibration* calibration) {
  *calibration = Calibration();
  SafetensorsFile file;
  SP_RETURN_IF_ERROR(parse_safetensors(data, size, &file));
  return from_file(file, calibration);
}

}  // namespace sparseprefill
