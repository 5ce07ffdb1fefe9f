#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: how evenly launches of a kernel of ours spread their work over the SMs, inside a
# benchmark run (bench/bench_attention.py). For each profiled launch: the kernel's elapsed
# cycles and the active cycles of the least busy, the average and the busiest SM; avg / elapsed
# is the share of the launch the SMs worked on average (1.0: no tail at all). Writes
# OUTDIR/balance.csv (ncu's raw metrics) and OUTDIR/balance.txt (the summary).
# Usage: scripts/profile/ncu_balance.sh OUTDIR KERNEL_REGEX SKIP COUNT [bench_attention.py arguments]
#   e.g. scripts/profile/ncu_balance.sh /tmp/b permute_attend 1 2 --lengths= --small-lengths= \
#        --paged-lengths= --chunked-lengths= --structured-lengths 131072 --impls ours_permute_stop
set -uo pipefail
if (($# < 4)); then
  echo "usage: $0 OUTDIR KERNEL_REGEX SKIP COUNT [bench_attention.py arguments]" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
kernel=$2
skip=$3
count=$4
shift 4
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/profile/ncu_common.sh
source "$root/scripts/profile/ncu_common.sh"
ncu_build sparseprefill_c || exit 1
metrics=sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.max
timeout 480 ncu --clock-control none --metrics "$metrics" --csv --kernel-name-base demangled \
  -k "regex:$kernel" --launch-skip "$skip" --launch-count "$count" \
  python3 bench/bench_attention.py --out "$out/bench" --lib build/h200/src/api/libsparseprefill_c.so \
  --budget-ms 1 --min-reps 1 --max-reps 1 "$@" >"$out/ncu.log" 2>&1
rc=$?
((rc == 0)) || { tail -5 "$out/ncu.log"; exit "$rc"; }
# ncu's CSV rows start at the header line ("ID","Process ID",...); one row per (launch, metric).
sed -n '/^"ID"/,$p' "$out/ncu.log" >"$out/balance.csv"
python3 - "$out/balance.csv" <<'EOF' | tee "$out/balance.txt"
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
launches = {}
for r in rows:
    v = float(r["Metric Value"].replace(",", ""))
    launches.setdefault((r["ID"], r["Kernel Name"]), {})[r["Metric Name"]] = v
print("| launch | kernel | elapsed cycles | SM active min | avg | max | avg / elapsed | min / max |")
print("|---|---|---|---|---|---|---|---|")
for (i, name), m in launches.items():
    el, lo = m["sm__cycles_elapsed.max"], m["sm__cycles_active.min"]
    av, hi = m["sm__cycles_active.avg"], m["sm__cycles_active.max"]
    print(f"| {i} | {name.split('(')[0][:60]} | {el:.4g} | {lo:.4g} | {av:.4g} | {hi:.4g} | {av / el:.3f} | {lo / hi:.3f} |")
EOF
