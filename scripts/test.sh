#!/usr/bin/env bash
# The project's test command (README): installs build dependencies, configures the `ci`
# preset (CPU library, CLI and tests, plus every CUDA translation unit compiled, not run) —
# or the `cpu` preset where nvcc is absent — builds it and runs the CPU test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install_deps.sh
preset=ci
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "test.sh: nvcc not found; building the CPU-only preset (CUDA translation units not compiled)" >&2
  preset=cpu
fi
export PATH="$PATH:/usr/local/cuda/bin"
cmake --preset "$preset"
cmake --build --preset "$preset" -j "$(nproc)"
ctest --preset "$preset" -j "$(nproc)"
