#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: a same-call A/B of a kernel change. Between device calls the same build's times
# move by up to 4% (docs/cuda.md), so changes of a few percent are decided only by builds timed
# alternately in one call: the tree as it is (old), then with each PATCH applied alone, ROUNDS
# times (old / new / old / new ...), each the h200 preset's sparseprefill_c (ncu_common.sh's
# ncu_build) and then bench/run_benchmarks.sh with the given arguments. The tree is left as it was.
# Usage: scripts/profile/ab_bench.sh OUTDIR PATCH[,PATCH...] [bench_attention.py arguments]
#   PATCH: a `git diff` of the change (the GPU machine has no .git), relative to the repository
#   root, e.g. made here with `git diff main...my-branch > ab.patch` (untracked, so the device
#   tool copies it). One patch is the side `new`; with several, each side is named after its
#   file (lazy.patch: `lazy`), and a round runs old then each of them.
# Env: SP_AB_ROUNDS (default 2), SP_AB_RUN_SECONDS (each benchmark run's limit, default 300),
#      SPARSEPREFILL_CUDA_PATH (passed through; `portable` for the portable kernels on a Hopper
#      GPU), SP_COMMIT (the commit the tree came from), JOBS.
# Writes OUTDIR/ab.txt (one line per benchmark row: median ms of every run in order, old first;
# with --kernel-profile also one line per kernel of a row: its time in the profiled call)
# and OUTDIR/<side>.json (each side's last run: old.json, new.json), the only files that come
# back.
set -uo pipefail
if (($# < 2)); then
  echo "usage: $0 OUTDIR PATCH[,PATCH...] [bench_attention.py arguments]" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
IFS=, read -ra patch_args <<<"$2"
shift 2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rounds=${SP_AB_ROUNDS:-2}
run_limit=${SP_AB_RUN_SECONDS:-300}
sides=(old)
declare -A patch_of
for arg in "${patch_args[@]}"; do
  file=$(cd "$(dirname "$arg")" && pwd)/$(basename "$arg")
  side=new
  ((${#patch_args[@]} > 1)) && side=$(basename "$file" .patch)
  if [[ $side == old || -n ${patch_of[$side]:-} || ! $side =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "ab_bench: $arg: a side needs its own name of letters, digits, - and _ (not old)" >&2
    exit 2
  fi
  (cd "$root" && patch --dry-run -p1 <"$file" >/dev/null) || {
    echo "ab_bench: $arg does not apply to this tree" >&2
    exit 1
  }
  sides+=("$side")
  patch_of[$side]=$file
done
cd "$root" || exit 1
# shellcheck source=scripts/profile/ncu_common.sh
source "$root/scripts/profile/ncu_common.sh"  # ncu_build: the h200 preset's target, log in $out/build.log
applied=""  # the patch file the tree carries now
restore() { [[ -n $applied ]] && patch -R -p1 <"$applied" >/dev/null && applied=""; }
trap restore EXIT
runs=()
for ((i = 1; i <= rounds; ++i)); do
  for side in "${sides[@]}"; do
    restore
    if [[ $side != old ]]; then patch -p1 <"${patch_of[$side]}" >/dev/null && applied=${patch_of[$side]}; fi
    run=$side$i
    ncu_build sparseprefill_c || exit 1
    # A patch that deadlocks a kernel would otherwise hold the device call to its limit.
    timeout "$run_limit" bench/run_benchmarks.sh "$out/$run" "$@" >"$out/$run.log" 2>&1 || {
      rc=$?
      tail -20 "$out/$run.log"
      ((rc == 124)) && echo "ab_bench: $run ran past ${run_limit} s (SP_AB_RUN_SECONDS): stopped" >&2
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
for side in "${sides[@]}"; do cp "$out/$side$rounds/bench.json" "$out/$side.json"; done
rm -rf "${runs[@]/#/$out/}" "$out"/*[0-9].log "$out/build.log"
