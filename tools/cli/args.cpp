// SPDX-License-Identifier: Apache-2.0
// Strict flag parsing for the CLI's subcommands.
#include "args.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace sparseprefill::cli {

bool parse_int64(const std::string& s, std::int64_t* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno != 0 || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

bool parse_finite_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno == ERANGE || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

namespace {

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : s) {
    if (c == ',') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(c);
    }
  }
  parts.push_back(cur);
  return parts;
}

const Flag* find_flag(const std::vector<Flag>& flags, const std::string& name) {
  for (const Flag& f : flags) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

}  // namespace

Status Args::parse(const std::vector<Flag>& flags, int argc, char** argv, int first, Args* out) {
  std::vector<Flag> all = flags;
  all.push_back({"help", "", "show this help and exit", false});
  all.push_back({"json", "", "print the result as JSON on stdout", false});
  Args args;
  for (int i = first; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.size() < 3 || arg.compare(0, 2, "--") != 0) {
      return invalid_argument("unexpected argument '" + arg + "' (flags start with --)");
    }
    std::string name = arg.substr(2);
    std::string value;
    bool has_inline_value = false;
    const std::size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_inline_value = true;
    }
    const Flag* flag = find_flag(all, name);
    if (flag == nullptr) return invalid_argument("unknown flag --" + name);
    if (flag->value_name.empty()) {
      if (has_inline_value) return invalid_argument("--" + name + ": takes no value");
    } else if (!has_inline_value) {
      if (i + 1 >= argc)
        return invalid_argument("--" + name + ": expected a value " + flag->value_name);
      value = argv[++i];
    }
    std::vector<std::string>& slot = args.values_[name];
    if (!slot.empty() && !flag->repeatable) return invalid_argument("--" + name + ": given twice");
    slot.push_back(value);
  }
  *out = std::move(args);
  return Status::ok_status();
}

std::string Args::get(const std::string& name, const std::string& fallback) const {
  const auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second.back();
}

std::vector<std::string> Args::all(const std::string& name) const {
  const auto it = values_.find(name);
  return it == values_.end() ? std::vector<std::string>{} : it->second;
}

Status Args::get_int(const std::string& name, std::int64_t min, std::int64_t max, int* out) const {
  if (!has(name)) return Status::ok_status();
  std::int64_t v = 0;
  if (!parse_int64(get(name), &v) || v < min || v > max) {
    return invalid_argument("--" + name + ": expected an integer in [" + std::to_string(min) +
                            ", " + std::to_string(max) + "], got '" + get(name) + "'");
  }
  *out = static_cast<int>(v);
  return Status::ok_status();
}

Status Args::get_u64(const std::string& name, std::uint64_t* out) const {
  if (!has(name)) return Status::ok_status();
  const std::string s = get(name);
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (s.empty() || s[0] == '-' || errno != 0 || end != s.c_str() + s.size()) {
    return invalid_argument("--" + name + ": expected a non-negative integer, got '" + s + "'");
  }
  *out = v;
  return Status::ok_status();
}

Status Args::get_double(const std::string& name, double min, double max, double* out) const {
  if (!has(name)) return Status::ok_status();
  double v = 0;
  std::ostringstream range;
  range << "[" << min << ", " << max << "]";
  if (!parse_finite_double(get(name), &v) || v < min || v > max) {
    return invalid_argument("--" + name + ": expected a finite number in " + range.str() +
                            ", got '" + get(name) + "'");
  }
  *out = v;
  return Status::ok_status();
}

Status Args::get_int_list(const std::string& name, std::int64_t min, std::int64_t max,
                          std::vector<int>* out) const {
  if (!has(name)) return Status::ok_status();
  std::vector<int> list;
  for (const std::string& part : split_commas(get(name))) {
    std::int64_t v = 0;
    if (!parse_int64(part, &v) || v < min || v > max) {
      return invalid_argument("--" + name + ": expected comma-separated integers in [" +
                              std::to_string(min) + ", " + std::to_string(max) + "], got '" + part +
                              "'");
    }
    list.push_back(static_cast<int>(v));
  }
  *out = list;
  return Status::ok_status();
}

Status Args::get_double_list(const std::string& name, double min, double max,
                             std::vector<double>* out) const {
  if (!has(name)) return Status::ok_status();
  std::vector<double> list;
  for (const std::string& part : split_commas(get(name))) {
    double v = 0;
    if (!parse_finite_double(part, &v) || v < min || v > max) {
      std::ostringstream range;
      range << "[" << min << ", " << max << "]";
      return invalid_argument("--" + name + ": expected comma-separated numbers in " + range.str() +
                              ", got '" + part + "'");
    }
    list.push_back(v);
  }
  *out = list;
  return Status::ok_status();
}

std::string format_flags(const std::vector<Flag>& flags) {
  std::ostringstream os;
  os << "Options:\n";
  std::vector<Flag> all = flags;
  all.push_back({"json", "", "print the result as JSON on stdout", false});
  all.push_back({"help", "", "show this help and exit", false});
  for (const Flag& f : all) {
    std::string left = "  --" + f.name + (f.value_name.empty() ? "" : " " + f.value_name);
    if (left.size() < 30)
      left.resize(30, ' ');
    else
      left += "\n" + std::string(30, ' ');
    os << left << f.help << (f.repeatable ? " (repeatable)" : "") << "\n";
  }
  return os.str();
}

}  // namespace sparseprefill::cli
