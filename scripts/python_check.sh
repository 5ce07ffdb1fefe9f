#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU-machine part of the Python package, offline: `pip install .` with the CUDA backend from
# what is installed there (torch, scikit-build-core, pybind11, cmake, ninja, nvcc), pytest over
# tests/python (CPU and CUDA devices), then FlashAttention-3's forward tests in dense mode
# through tests/python/fa3_shim when .carry/fa3/ holds hopper/{test_flash_attn,test_util,
# padding}.py of Dao-AILab/flash-attention (fetched, never committed).
# Usage: scripts/python_check.sh OUTDIR   (logs: install.log, build_info.txt, pytest.log,
#        fa3.log, fa3_env.txt; exit status: nonzero if the install or our tests fail)
set -uo pipefail
out=${1:?usage: scripts/python_check.sh OUTDIR}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

scripts/python_install_cuda.sh "$out" || exit 1
(cd /tmp && "$py" -c "import sparseprefill; print(sparseprefill.build_info())") | tee "$out/build_info.txt"

# The CPU-device variants run wherever torch is installed without a GPU; here the CUDA ones.
SP_TEST_DEVICES=${SP_TEST_DEVICES:-cuda} "$py" -m pytest -q -p no:cacheprovider --timeout=600 tests/python 2>&1 \
  | tee "$out/pytest.log"
status=${PIPESTATUS[0]}

scripts/fa3_check.sh "$out"
exit "$status"
