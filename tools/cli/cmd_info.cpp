// SPDX-License-Identifier: Apache-2.0
// `sparseprefill info`: version, compiled backends and CUDA variants (build_info()).
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "args.h"
#include "commands.h"
#include "common.h"

namespace sparseprefill::cli {

int info_main(int argc, char** argv, int first) {
  const std::vector<Flag> flags;
  Args args;
  if (Status s = Args::parse(flags, argc, argv, first, &args); !s.ok()) {
    return report_error("info", s);
  }
  if (args.has("help")) {
    std::cout << "Usage: sparseprefill info [--json]\n\n"
                 "Prints the version, the compiled backends, CUDA architectures and kernel "
                 "variants.\n\n"
              << format_flags(flags) << "\n"
              << kExitCodesHelp;
    return kExitOk;
  }
  const std::string info = build_info();
  if (!args.has("json")) {
    std::cout << info;
    if (!info.empty() && info.back() != '\n') std::cout << "\n";
    return kExitOk;
  }
  // build_info() lines "backend <name>: <description>" become the "backends" object; every
  // line is also kept verbatim.
  std::vector<std::string> lines;
  std::istringstream in(info);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  const std::string prefix = "backend ";
  JsonWriter json;
  json.begin_object().key("version").value(SPARSEPREFILL_VERSION_STRING);
  json.key("backends").begin_object();
  for (const std::string& line : lines) {
    const std::size_t colon = line.find(": ");
    if (line.compare(0, prefix.size(), prefix) != 0 || colon == std::string::npos) continue;
    json.key(line.substr(prefix.size(), colon - prefix.size())).value(line.substr(colon + 2));
  }
  json.end_object();
  json.key("build_info").begin_array();
  for (const std::string& line : lines) json.value(line);
  json.end_array().end_object();
  std::cout << json.str() << "\n";
  return kExitOk;
}

}  // namespace sparseprefill::cli
