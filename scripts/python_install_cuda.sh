#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine, offline: `pip install .` with the CUDA backend from what is installed there
# (torch, scikit-build-core, pybind11, cmake, ninja, nvcc), building with every core into
# build/python/gpu (kept between calls on a warm machine). Shared by scripts/python_check.sh and
# scripts/model/gpu_quality.sh.
# Usage: scripts/python_install_cuda.sh OUTDIR   (log: OUTDIR/install.log)
# Env: PYTHON, SP_PORTABLE_ARCHS (default 90-real).
set -uo pipefail
out=${1:?usage: scripts/python_install_cuda.sh OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
start=$(date +%s)
if ! "$py" -m pip install --no-index --no-build-isolation --no-deps -v \
    -Ccmake.define.SP_ENABLE_CUDA=ON -Ccmake.define.SP_PORTABLE_ARCHS="${SP_PORTABLE_ARCHS:-90-real}" \
    -Cbuild-dir="$root/build/python/gpu" . >"$out/install.log" 2>&1; then
  tail -n 40 "$out/install.log"
  echo "python_install_cuda: pip install failed (see install.log)"
  exit 1
fi
echo "python_install_cuda: installed in $(($(date +%s) - start)) s"
