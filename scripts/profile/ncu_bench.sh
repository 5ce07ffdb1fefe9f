#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: Nsight Compute over one launch of a kernel of ours inside a benchmark run
# (bench/bench_attention.py), summarised as scripts/profile/ncu_tiles.sh does (both through
# scripts/profile/ncu_common.sh): report.ncu-rep, details.csv, stalls.txt (stall reasons, the
# 30 hottest SASS instructions) and metrics.txt (headline throughput, occupancy, caches).
# Usage: scripts/profile/ncu_bench.sh OUTDIR KERNEL_REGEX SKIP [bench_attention.py arguments]
#   e.g. scripts/profile/ncu_bench.sh /tmp/n select_kernel 4 --lengths= --small-lengths= \
#        --paged-lengths= --chunked-lengths= --structured-lengths 32768 --impls ours_estimate_select
# SKIP: launches of the kernel to let pass first (warm-up, calibration calls). Builds the h200
# preset's library first (JOBS, default 16; GoogleTest from .carry/gtest when present).
set -uo pipefail
if (($# < 3)); then
  echo "usage: $0 OUTDIR KERNEL_REGEX SKIP [bench_attention.py arguments]" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
kernel=$2
skip=$3
shift 3
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
# shellcheck source=scripts/profile/ncu_common.sh
source "$root/scripts/profile/ncu_common.sh"
ncu_build sparseprefill_c || exit 1
timeout 480 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
  -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 -o "$out/report" \
  python3 bench/bench_attention.py --out "$out/bench" --lib build/h200/src/api/libsparseprefill_c.so \
  --budget-ms 1 --min-reps 1 --max-reps 1 "$@" >"$out/ncu.log" 2>&1
rc=$?
tail -3 "$out/ncu.log"
((rc == 0)) || exit "$rc"
# The benchmark launches a kernel only a few times at --max-reps 1 (a warm-up, a timing
# estimate, one rep: ours_exact_gate's fwd_kernel 3 times at 32K), so a SKIP past the last
# launch profiles nothing, which ncu reports without failing.
if grep -q "No kernels were profiled" "$out/ncu.log"; then
  echo "ncu_bench: no launch of '$kernel' after skipping $skip: try a smaller SKIP ($out/ncu.log lists the launched kernels)" >&2
  exit 1
fi
ncu_summarise 30
