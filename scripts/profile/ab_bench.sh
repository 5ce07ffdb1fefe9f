#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: a same-call A/B of a kernel change. Between device calls the same build's times
# move by up to 4% (docs/cuda.md), so changes of a few percent are decided only by builds timed
# alternately in one call: the tree as it is (old), then with PATCH applied (new), ROUNDS times
# (old / new / old / new ...), each the h200 preset's sparseprefill_c (ncu_common.sh's ncu_build) and then
# bench/run_benchmarks.sh with the given arguments. The tree is left as it was.
# Usage: scripts/profile/ab_bench.sh OUTDIR PATCH [bench_attention.py arguments]
#   PATCH: a `git diff` of the change (the GPU machine has no .git), relative to the repository
#   root, e.g. made here with `git diff main..my-branch > ab.patch` (untracked, so the device
#   tool copies it).
# Env: SP_AB_ROUNDS (default 2), SPARSEPREFILL_CUDA_PATH (passed through; `portable` for the
#      portable kernels on a Hopper GPU), SP_COMMIT (the commit the tree came from), JOBS.
# Writes OUTDIR/ab.txt (one line per benchmark row: median ms of every run in order, old first;
# with --kernel-profile also one line per kernel of a row: its time in the profiled call)
# and OUTDIR/{old,new}.json (the last run of each), the only files that come back.
set -uo pipefail
if (($# < 2)); then
  echo "usage: $0 OUTDIR PATCH [bench_attention.py arguments]" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
patch_file=$(cd "$(dirname "$2")" && pwd)/$(basename "$2")
shift 2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1
rounds=${SP_AB_ROUNDS:-2}
patch --dry-run -p1 <"$patch_file" >/dev/null || {
  echo "ab_bench: $patch_file does not apply to this tree" >&2
  exit 1
}
# shellcheck source=scripts/profile/ncu_common.sh
source "$root/scripts/profile/ncu_common.sh"  # ncu_build: the h200 preset's target, log in $out/build.log
applied=0
restore() { ((applied)) && patch -R -p1 <"$patch_file" >/dev/null && applied=0; }
trap restore EXIT
runs=()
for ((i = 1; i <= rounds; ++i)); do
  for side in old new; do
    if [[ $side == new ]]; then patch -p1 <"$patch_file" >/dev/null && applied=1; else restore; fi
    run=$side$i
    ncu_build sparseprefill_c || exit 1
    bench/run_benchmarks.sh "$out/$run" "$@" >"$out/$run.log" 2>&1 || {
      tail -20 "$out/$run.log"
      exit 1
    }
    runs+=("$run")
  done
done
restore
python3 - "$out" "${runs[@]}" >"$out/ab.txt" <<'PY'
import json, sys
out, runs = sys.argv[1], sys.argv[2:]
table = {}
for run in runs:
    data = json.load(open(f"{out}/{run}/bench.json"))
    for case in data["cases"]:
        for row in case["rows"]:
            key = f"{case['model']} {case['n']} | {row['label']}"
            ms = row.get("ms")
            table.setdefault(key, {})[run] = f"{ms:.4g}" if ms else row.get("status", "?")
            # --kernel-profile: each kernel's device time in the profiled call, [name, calls, ms]
            for name, _, kernel_ms in row.get("kernels", []):
                table.setdefault(f"{key} | {name}", {})[run] = f"{kernel_ms:.4g}"
print("row | " + " / ".join(runs) + " (ms)")
for key, times in table.items():
    print(f"{key} | " + " / ".join(times.get(r, "-") for r in runs))
PY
cat "$out/ab.txt"
cp "$out/old$rounds/bench.json" "$out/old.json"
cp "$out/new$rounds/bench.json" "$out/new.json"
rm -rf "${runs[@]/#/$out/}" "$out"/*[0-9].log "$out/build.log"
