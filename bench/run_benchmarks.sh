#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs the benchmark against the peers (bench_attention.py) on the GPU machine, after the build.
# Usage: bench/run_benchmarks.sh OUTDIR [extra bench_attention.py arguments, e.g. --peers-only]
# Env: SP_BUILD_DIR (default build/h200), SP_LIB (the library; default SP_BUILD_DIR's, "installed":
#      the installed package's, e.g. after scripts/python_install_cuda.sh), SP_COMMIT (the commit
#      the working tree came from; the GPU machine has no .git), PYTHON (default python3).
# Writes OUTDIR/bench.json, OUTDIR/bench.md and OUTDIR/bench.log. Record it here afterwards:
#   python3 bench/record.py OUTDIR/bench.json --name <what-changed>
set -euo pipefail
if (($# < 1)); then
  echo "usage: $0 OUTDIR [bench_attention.py arguments]" >&2
  exit 2
fi
out=$1
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${SP_BUILD_DIR:-$root/build/h200}
lib=${SP_LIB:-$build/src/api/libsparseprefill_c.so}
if [[ $lib == installed ]]; then
  lib=$(cd /tmp && "${PYTHON:-python3}" -c 'import os, sparseprefill
print(os.path.join(os.path.dirname(sparseprefill.__file__), "libsparseprefill_c.so"))')
fi
mkdir -p "$out"

args=(--out "$out")
peers_only=0
for a in "$@"; do [[ $a == --peers-only ]] && peers_only=1; done
if ((!peers_only)); then
  if [[ ! -f $lib ]]; then
    echo "run_benchmarks: $lib not found (build the h200 preset first, or pass --peers-only)" >&2
    exit 1
  fi
  args+=(--lib "$lib")
fi

export SP_BENCH_COMMAND="bench/run_benchmarks.sh OUTDIR${*:+ $*}"
export PYTHONUNBUFFERED=1
set -o pipefail
"${PYTHON:-python3}" "$root/bench/bench_attention.py" "${args[@]}" "$@" 2>&1 | tee "$out/bench.log"
