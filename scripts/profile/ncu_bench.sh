#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: Nsight Compute over one launch of a kernel of ours inside a benchmark run
# (bench/bench_attention.py), summarised as scripts/profile/ncu_tiles.sh does: stalls.txt (stall
# reasons, hottest SASS) and the headline throughput/occupancy metrics (metrics.txt).
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
cd "$root"
prefix=()
[[ -d $root/.carry/gtest/usr ]] && prefix=(-DCMAKE_PREFIX_PATH="$root/.carry/gtest/usr")
if ! { cmake --preset h200 "${prefix[@]}" && cmake --build build/h200 -j"${JOBS:-16}" --target sparseprefill_c; } \
  >"$out/build.log" 2>&1; then
  tail -30 "$out/build.log"
  exit 1
fi
timeout 480 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
  -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 -o "$out/report" \
  python3 bench/bench_attention.py --out "$out/bench" --lib build/h200/src/api/libsparseprefill_c.so \
  --budget-ms 1 --min-reps 1 --max-reps 1 "$@" >"$out/ncu.log" 2>&1
rc=$?
tail -3 "$out/ncu.log"
((rc == 0)) || exit "$rc"
ncu -i "$out/report.ncu-rep" --page details --csv >"$out/details.csv"
ncu -i "$out/report.ncu-rep" --page raw --csv >"$out/raw.csv"
ncu -i "$out/report.ncu-rep" --page source --csv --print-source sass >"$out/source.csv"
python3 "$root/scripts/profile/ncu_stalls.py" "$out/raw.csv" "$out/source.csv" 30 | tee "$out/stalls.txt"
grep -E '"(Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Issue Slots Busy|Executed Ipc Active|L1/TEX Hit Rate|L2 Hit Rate|Shared Memory Configuration Size|Block Limit Registers|Block Limit Shared Mem)"' \
  "$out/details.csv" | awk -F'","' '{print $(NF-2) " = " $NF " " $(NF-1)}' | tee "$out/metrics.txt"
rm -f "$out/raw.csv" "$out/source.csv"  # large; the report holds them
