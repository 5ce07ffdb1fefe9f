// SPDX-License-Identifier: Apache-2.0
// Shared pieces of the CLI's subcommands: exit codes, one-line errors, a small JSON writer,
// progress lines on stderr, and helpers over the public tensor types.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sparseprefill/sparseprefill.h"

namespace sparseprefill::cli {

// Exit codes (docs/cli.md and every --help list them).
enum ExitCode : int {
  kExitOk = 0,
  kExitFailure = 1,      // a runtime failure (internal error, CUDA error)
  kExitUsage = 2,        // usage error or bad input (flags, tensors, parameters, file contents)
  kExitUnsupported = 3,  // well-formed, but no compiled backend runs it
  kExitIo = 4,           // a file could not be opened, read or written
};

extern const char* const kExitCodesHelp;

int exit_code_for(const Status& status);
// Prints "sparseprefill <command>: <status>" as one line on stderr; returns the exit code.
int report_error(std::string_view command, const Status& status);

// A minimal JSON writer: objects, arrays, strings, numbers (NaN and infinities as null).
class JsonWriter {
 public:
  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  JsonWriter& key(std::string_view name);
  JsonWriter& value(std::string_view s);
  JsonWriter& value(const char* s) { return value(std::string_view(s)); }
  JsonWriter& value(double x);
  JsonWriter& value(std::int64_t x);
  JsonWriter& value(int x) { return value(static_cast<std::int64_t>(x)); }
  JsonWriter& value(bool b);
  const std::string& str() const { return out_; }

 private:
  void separator();
  std::string out_;
  std::vector<bool> first_;  // per open container: no element written yet
  bool after_key_ = false;
};

// Progress on stderr for steps that take more than a moment: a redrawn bar on a terminal, one
// line per step otherwise.
class Progress {
 public:
  Progress(std::string label, int total);
  void step(const std::string& what);  // call before each step
  void done();

 private:
  std::string label_;
  int total_ = 0, current_ = 0;
  bool tty_ = false;
};

class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

// Element i of a bf16/fp16/fp32 host tensor as a double.
double element(const HostTensor& t, std::int64_t i);

// Relative L2 error ||a - b|| / ||b|| and max |a - b| of two tensors of one shape (accumulated
// in double). NaN anywhere makes both NaN.
struct ErrorStats {
  double rel_l2 = 0;
  double max_abs = 0;
};
ErrorStats compare(const HostTensor& a, const HostTensor& b);

// The tensor `name` of `file` (read from `path`); a missing tensor is an error naming both.
// `required` false: *out = nullptr when absent.
Status find_tensor(const SafetensorsFile& file, const std::string& path, const std::string& name,
                   bool required, const HostTensor** out);

// Reads `path` as safetensors; errors name the file.
Status read_input(const std::string& path, SafetensorsFile* out);

// "cpu" | "reference" | "cuda" | "auto": auto is cuda when a CUDA device is present (the
// library then stages the CLI's host tensors to it), else cpu.
Status parse_backend(const std::string& name, Backend* out);

// Formats a number with `digits` significant digits (for tables).
std::string fmt(double x, int digits = 3);

}  // namespace sparseprefill::cli
