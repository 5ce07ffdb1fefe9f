// SPDX-License-Identifier: Apache-2.0
// Command-line flags of one subcommand: a declared set of `--name [VALUE]` options, parsed
// strictly (unknown flags, missing values and malformed numbers are usage errors).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sparseprefill/types.h"

namespace sparseprefill::cli {

struct Flag {
  std::string name;        // without the leading "--"
  std::string value_name;  // empty: a switch that takes no value
  std::string help;
  bool repeatable = false;
};

class Args {
 public:
  // Parses argv[first..argc) against `flags` ("--help" and "--json" are always accepted).
  // "--name=value" and "--name value" are both accepted.
  static Status parse(const std::vector<Flag>& flags, int argc, char** argv, int first, Args* out);

  bool has(const std::string& name) const { return values_.count(name) > 0; }
  // The last value given for `name`, or `fallback`.
  std::string get(const std::string& name, const std::string& fallback = "") const;
  std::vector<std::string> all(const std::string& name) const;

  // Typed getters: absent flags keep *out unchanged; malformed or out-of-range values are
  // invalid_argument errors that name the flag.
  Status get_int(const std::string& name, std::int64_t min, std::int64_t max, int* out) const;
  Status get_u64(const std::string& name, std::uint64_t* out) const;
  Status get_double(const std::string& name, double min, double max, double* out) const;
  // Comma-separated lists, e.g. "--budgets 8,16,32".
  Status get_int_list(const std::string& name, std::int64_t min, std::int64_t max,
                      std::vector<int>* out) const;
  Status get_double_list(const std::string& name, double min, double max,
                         std::vector<double>* out) const;

 private:
  std::map<std::string, std::vector<std::string>> values_;
};

// "Options:" section of a command's --help text.
std::string format_flags(const std::vector<Flag>& flags);

// Strict number parsing (whole string, finite): false on anything else.
bool parse_int64(const std::string& s, std::int64_t* out);
bool parse_finite_double(const std::string& s, double* out);

}  // namespace sparseprefill::cli
