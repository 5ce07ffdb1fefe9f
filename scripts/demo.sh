#!/usr/bin/env bash
# The project's main job (README): builds the CPU preset if needed and runs
# `sparseprefill demo` on its embedded default problem. Extra arguments go to the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
cmake --preset cpu >/dev/null
cmake --build --preset cpu -j "$(nproc)" --target sparseprefill_cli
exec build/cpu/tools/cli/sparseprefill demo "$@"
