// SPDX-License-Identifier: Apache-2.0
// The subcommands of `sparseprefill`; each parses argv[first..argc) and returns an exit code.
#pragma once

namespace sparseprefill::cli {

int demo_main(int argc, char** argv, int first);
int run_main(int argc, char** argv, int first);
int calibrate_main(int argc, char** argv, int first);
int info_main(int argc, char** argv, int first);

}  // namespace sparseprefill::cli
