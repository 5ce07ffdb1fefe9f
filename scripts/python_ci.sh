#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# CI part of the Python package (no GPU, no torch): a fresh virtual environment with the
# build dependencies from PyPI, `pip install .` built CPU-only, then pytest over tests/python
# (the NumPy binding tests run; the torch and transformers modules skip without torch).
# Usage: scripts/python_ci.sh            (SP_PY_VENV overrides the environment's folder)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SP_PY_VENV:-$root/build/python/ci-venv}

python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q scikit-build-core==1.1.2 pybind11==3.1.0 numpy==2.4.6 pytest==9.2.0
# CI compiles the CUDA translation units elsewhere (the ci preset); the package stays CPU-only.
"$venv/bin/python" -m pip install -q --no-build-isolation --no-deps \
  -Ccmake.define.SP_ENABLE_CUDA=OFF -Cbuild-dir="$root/build/python/ci" "$root"
cd "$root"
"$venv/bin/python" -c "import sparseprefill; print(sparseprefill.build_info())"
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/python
