// SPDX-License-Identifier: Apache-2.0
// Exit codes, error lines, JSON, progress and tensor helpers shared by the subcommands.
#include "common.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>

namespace sparseprefill::cli {

const char* const kExitCodesHelp =
    "Exit codes:\n"
    "  0  success\n"
    "  1  runtime failure (internal or CUDA error)\n"
    "  2  usage error or bad input (flags, tensors, parameters, file contents)\n"
    "  3  unsupported (no compiled backend runs this combination)\n"
    "  4  I/O error (a file could not be opened, read or written)\n";

int exit_code_for(const Status& status) {
  switch (status.code()) {
    case StatusCode::kOk: return kExitOk;
    case StatusCode::kInvalidArgument:
    case StatusCode::kCorruptData: return kExitUsage;
    case StatusCode::kUnsupported: return kExitUnsupported;
    case StatusCode::kIoError: return kExitIo;
    case StatusCode::kCudaError:
    case StatusCode::kInternal: return kExitFailure;
  }
  return kExitFailure;
}

int report_error(std::string_view command, const Status& status) {
  std::string line = status.to_string();
  for (char& c : line) {
    if (c == '\n') c = ' ';
  }
  std::cerr << "sparseprefill " << command << ": " << line << std::endl;
  return exit_code_for(status);
}

// ---------------------------------------------------------------- JSON

void JsonWriter::separator() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!first_.empty()) {
    if (!first_.back()) out_ += ", ";
    first_.back() = false;
  }
}

JsonWriter& JsonWriter::begin_object() {
  separator();
  out_ += "{";
  first_.push_back(true);
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  out_ += "}";
  first_.pop_back();
  return *this;
}

JsonWriter& JsonWriter::begin_array() {
  separator();
  out_ += "[";
  first_.push_back(true);
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  out_ += "]";
  first_.pop_back();
  return *this;
}

JsonWriter& JsonWriter::key(std::string_view name) {
  value(name);
  out_ += ": ";
  after_key_ = true;
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view s) {
  separator();
  out_ += '"';
  for (char c : s) {
    switch (c) {
      case '"': out_ += "\\\""; break;
      case '\\': out_ += "\\\\"; break;
      case '\n': out_ += "\\n"; break;
      case '\t': out_ += "\\t"; break;
      case '\r': out_ += "\\r"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          out_ += buf;
        } else {
          out_ += c;
        }
    }
  }
  out_ += '"';
  return *this;
}

JsonWriter& JsonWriter::value(double x) {
  separator();
  if (!std::isfinite(x)) {
    out_ += "null";
  } else {
    std::ostringstream os;
    os << std::setprecision(9) << x;
    out_ += os.str();
  }
  return *this;
}

JsonWriter& JsonWriter::value(std::int64_t x) {
  separator();
  out_ += std::to_string(x);
  return *this;
}

JsonWriter& JsonWriter::value(bool b) {
  separator();
  out_ += b ? "true" : "false";
  return *this;
}

// ---------------------------------------------------------------- progress

Progress::Progress(std::string label, int total)
    : label_(std::move(label)), total_(total), tty_(isatty(STDERR_FILENO) != 0) {}

void Progress::step(const std::string& what) {
  ++current_;
  if (tty_) {
    constexpr int kWidth = 24;
    const int filled = total_ > 0 ? (current_ - 1) * kWidth / total_ : 0;
    std::cerr << "\r\033[K" << label_ << " [" << std::string(static_cast<std::size_t>(filled), '#')
              << std::string(static_cast<std::size_t>(kWidth - filled), '.') << "] " << current_
              << "/" << total_ << " " << what << std::flush;
  } else {
    std::cerr << label_ << " " << current_ << "/" << total_ << ": " << what << std::endl;
  }
}

void Progress::done() {
  if (tty_) std::cerr << "\r\033[K" << std::flush;
}

// ---------------------------------------------------------------- tensors

double element(const HostTensor& t, std::int64_t i) {
  switch (t.dtype()) {
    case DType::kBF16: return bf16_to_float(t.as<std::uint16_t>()[i]);
    case DType::kFP16: return fp16_to_float(t.as<std::uint16_t>()[i]);
    case DType::kFP32: return t.as<float>()[i];
    case DType::kInt32: return t.as<std::int32_t>()[i];
    case DType::kFP8E4M3: return e4m3_to_float(t.as<std::uint8_t>()[i]);
  }
  return 0;
}

ErrorStats compare(const HostTensor& a, const HostTensor& b) {
  double diff2 = 0, ref2 = 0, max_abs = 0;
  bool nan = false;
  for (std::int64_t i = 0; i < b.numel(); ++i) {
    const double x = element(a, i), y = element(b, i);
    const double e = x - y;
    if (std::isnan(e)) nan = true;
    diff2 += e * e;
    ref2 += y * y;
    max_abs = std::max(max_abs, std::fabs(e));
  }
  ErrorStats s;
  s.rel_l2 = nan ? NAN : (ref2 > 0 ? std::sqrt(diff2 / ref2) : std::sqrt(diff2));
  s.max_abs = nan ? NAN : max_abs;
  return s;
}

Status find_tensor(const SafetensorsFile& file, const std::string& path, const std::string& name,
                   bool required, const HostTensor** out) {
  const auto it = file.tensors.find(name);
  if (it == file.tensors.end()) {
    *out = nullptr;
    if (!required) return Status::ok_status();
    return invalid_argument(path + ": missing tensor '" + name + "'");
  }
  *out = &it->second;
  return Status::ok_status();
}

Status read_input(const std::string& path, SafetensorsFile* out) {
  const Status s = read_safetensors(path, out);
  if (s.ok() || s.message().find(path) != std::string::npos) return s;
  return {s.code(), path + ": " + s.message()};
}

Status parse_backend(const std::string& name, Backend* out) {
  if (name == "cpu")
    *out = Backend::kCPU;
  else if (name == "reference")
    *out = Backend::kReference;
  else if (name == "cuda")
    *out = Backend::kCUDA;
  else if (name == "auto")
    *out = cuda_device_count() > 0 ? Backend::kCUDA : Backend::kCPU;  // the CLI's tensors are on the host
  else
    return invalid_argument("--backend: expected auto, cpu, reference or cuda, got '" + name + "'");
  return Status::ok_status();
}

std::string fmt(double x, int digits) {
  std::ostringstream os;
  os << std::setprecision(digits) << x;
  return os.str();
}

}  // namespace sparseprefill::cli
