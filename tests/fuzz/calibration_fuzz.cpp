// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: one input goes through parse_safetensors, parse_calibration and the JSON
// parser. Beyond "no crash, no leak, no undefined behaviour" it checks what success promises:
// a parsed calibration validates and can be indexed, and parsed JSON reserializes to text
// that parses back to the same serialization.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/json.h"
#include "sparseprefill/calibration.h"
#include "sparseprefill/safetensors.h"

namespace sp = sparseprefill;

namespace {

void check(bool condition) {
  if (!condition) __builtin_trap();
}

void check_calibration(const sp::Calibration& c) {
  check(c.validate().ok());
  const sp::ThresholdTable& t = c.exact_gate;
  if (t.values.empty()) return;
  const int nb = static_cast<int>(t.budgets.size());
  // Corners of the table, positions past the end clamp to the last row.
  const float first = t.at(0, 0, 0, 0);
  const float last = t.at(t.layers - 1, nb - 1, t.heads - 1, t.positions + 5);
  check(first == first && last == last);  // never NaN
  check(t.slice(t.layers - 1, nb - 1).numel() == static_cast<std::int64_t>(t.heads) * t.positions);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  sp::SafetensorsFile file;
  const sp::Status file_status = sp::parse_safetensors(data, size, &file);
  check(file_status.ok() || (file_status.code() == sp::StatusCode::kCorruptData &&
                             file.tensors.empty() && file.metadata.empty()));

  sp::Calibration calibration;
  const sp::Status cal_status = sp::parse_calibration(data, size, &calibration);
  if (cal_status.ok()) {
    check(file_status.ok());
    check_calibration(calibration);
  } else {
    check(cal_status.code() == sp::StatusCode::kCorruptData && !cal_status.message().empty());
  }

  sp::json::Value value;
  if (sp::json::parse(std::string_view(reinterpret_cast<const char*>(data), size), &value).ok()) {
    const std::string text = sp::json::serialize(value);
    sp::json::Value again;
    check(sp::json::parse(text, &again).ok());
    check(sp::json::serialize(again) == text);
  }
  return 0;
}
