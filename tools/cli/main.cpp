// SPDX-License-Identifier: Apache-2.0
// `sparseprefill [--help] <command> ...`: dispatches to the subcommands.
#include <cstring>
#include <iostream>
#include <string>

#include "commands.h"
#include "common.h"

namespace {

const char* const kUsage =
    "Usage: sparseprefill [--help] <command> [options]\n"
    "\n"
    "Sparse prefill attention from the command line.\n"
    "\n"
    "Commands:\n"
    "  demo       run dense and every policy on generated inputs; print density, error, time\n"
    "  run        run one policy on q, k, v from a safetensors file; write o, lse, decisions\n"
    "  calibrate  fit exact_gate thresholds, softmax_skip a and estimate_select alpha\n"
    "  info       version, compiled backends and CUDA variants\n"
    "\n"
    "Every command takes --help and --json.\n";

}  // namespace

int main(int argc, char** argv) {
  using namespace sparseprefill::cli;
  if (argc < 2) {
    std::cerr << kUsage << "\n" << kExitCodesHelp;
    return kExitUsage;
  }
  const std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::cout << kUsage << "\n" << kExitCodesHelp;
    return kExitOk;
  }
  if (command == "demo") return demo_main(argc, argv, 2);
  if (command == "run") return run_main(argc, argv, 2);
  if (command == "calibrate") return calibrate_main(argc, argv, 2);
  if (command == "info") return info_main(argc, argv, 2);
  std::cerr << "sparseprefill: unknown command '" << command
            << "' (expected demo, run, calibrate or info; see sparseprefill --help)" << std::endl;
  return kExitUsage;
}
