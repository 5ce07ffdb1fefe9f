#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: a same-call A/B of a change. Between device calls the same build's times move by
# up to 4% (docs/cuda.md), so changes of a few percent are decided only by builds timed
# alternately in one call: the tree as it is (old) against each SIDE, ROUNDS times (old / new /
# old / new ...), each run bench/run_benchmarks.sh of that side's tree with the given arguments.
# Every side is its own copy of the tree with its own build of the h200 preset's sparseprefill_c
# (ncu_common.sh's ncu_build), built once, all sides at the same time, before the first run.
# Usage: scripts/profile/ab_bench.sh OUTDIR SIDE[,SIDE...] [bench_attention.py arguments]
#   SIDE: either a `git diff` of the change (NAME.patch; the GPU machine has no .git), relative to
#   the repository root, e.g. made here with `git diff main...my-branch > ab.patch`, applied to a
#   copy of the tree; or a whole other tree (NAME.tar or NAME.tar.xz, from
#   `git archive COMMIT | xz > NAME.tar.xz`, 2 MB where the carry allows 64 MiB), e.g.
#   an older commit: its own bench script then times it, so the rows must keep their names.
#   Or `.`: the tree as it is (with SP_AB_OLD). Untracked files travel with the device tool's
#   copy. One side is named `new`; with several, each is named after its file (lazy.patch:
#   `lazy`), and a round runs old then each of them.
# Env: SP_AB_ROUNDS (default 2), SP_AB_RUN_SECONDS (each benchmark run's limit, default 300),
#      SP_AB_WORK (where the sides' trees go, default /tmp/sp-ab), SP_AB_OLD (an archive as
#      above to be the side `old` instead of the tree: `SP_AB_OLD=base.tar.xz ... OUTDIR .` times
#      an older commit against this one), SPARSEPREFILL_CUDA_PATH (passed
#      through; `portable` for the portable kernels on a Hopper GPU), SP_COMMIT (the commit the
#      tree came from), JOBS (compile jobs in all, default 16), SP_AB_STEP (`build`: set up and
#      build the sides, then stop, e.g. in the background while other work uses the GPU; `run`:
#      time the sides an earlier `build` left in SP_AB_WORK, with the same OUTDIR and SIDEs;
#      unset: both).
# Writes OUTDIR/ab.txt (one line per benchmark row: median ms of every run in order, old first;
# with --kernel-profile also one line per kernel of a row: its time in the profiled call)
# and OUTDIR/<side>.json (each side's last run: old.json, new.json) and OUTDIR/<side>-build.log
# when a build fails, the only files that come back.
set -uo pipefail
if (($# < 2)); then
  echo "usage: $0 OUTDIR SIDE[,SIDE...] [bench_attention.py arguments]" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
IFS=, read -ra side_args <<<"$2"
shift 2
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
rounds=${SP_AB_ROUNDS:-2}
run_limit=${SP_AB_RUN_SECONDS:-300}
work=${SP_AB_WORK:-/tmp/sp-ab}
sides=(old)
declare -A source_of
[[ -n ${SP_AB_OLD:-} ]] && side_args=("$SP_AB_OLD" "${side_args[@]}")
for arg in "${side_args[@]}"; do
  side=new
  if [[ $arg == . ]]; then
    sides+=("$side")
    continue
  fi
  file=$(cd "$(dirname "$arg")" && pwd)/$(basename "$arg")
  name=$(basename "$file")
  name=${name%.patch} name=${name%.xz} name=${name%.tar}
  ((${#side_args[@]} > 1)) && side=$name
  if [[ -n ${SP_AB_OLD:-} && $arg == "$SP_AB_OLD" ]]; then
    side=old
  elif [[ $side == old || -n ${source_of[$side]:-} || ! $side =~ ^[A-Za-z0-9_-]+$ ]]; then
    echo "ab_bench: $arg: a side needs its own name of letters, digits, - and _ (not old)" >&2
    exit 2
  fi
  case $file in
    *.patch) (cd "$root" && patch --dry-run -p1 <"$file" >/dev/null) || {
        echo "ab_bench: $arg does not apply to this tree" >&2
        exit 1
      } ;;
    *.tar | *.tar.xz) tar -tf "$file" CMakePresets.json >/dev/null 2>&1 || {
        echo "ab_bench: $arg is not a tree of this repository (git archive COMMIT > NAME.tar)" >&2
        exit 1
      } ;;
    *) echo "ab_bench: $arg: a side is NAME.patch, NAME.tar or NAME.tar.xz" >&2; exit 2 ;;
  esac
  [[ $side == old ]] || sides+=("$side")
  source_of[$side]=$file
done

# shellcheck source=scripts/profile/ncu_common.sh
source "$root/scripts/profile/ncu_common.sh"
step=${SP_AB_STEP:-}
if [[ -n $step && $step != build && $step != run ]]; then
  echo "ab_bench: SP_AB_STEP=$step: build, run or unset" >&2
  exit 2
fi

# Each side's tree: a copy of this one (without its builds), patched or replaced by the archive.
# GoogleTest's carry goes along for the presets that look for it. Then every side's build.
build_sides() {
  rm -rf "$work" && mkdir -p "$work"
  for side in "${sides[@]}"; do
    tree=$work/$side
    mkdir -p "$tree"
    src=${source_of[$side]:-}
    if [[ $src == *.tar || $src == *.tar.xz ]]; then
      tar -xf "$src" -C "$tree"
      [[ -d $root/.carry/gtest ]] && mkdir -p "$tree/.carry" && cp -a "$root/.carry/gtest" "$tree/.carry/"
    else
      tar -C "$root" --exclude=./.git --exclude=./build --exclude=./.carry/qwen --exclude=./.carry/vllm -cf - . | tar -xf - -C "$tree"
      [[ -n $src ]] && (cd "$tree" && patch -p1 <"$src" >/dev/null)
    fi
  done

  # ncu_build reads $root and $out: each side builds in its own tree, its log beside the results.
  jobs_each=$(((${JOBS:-16} + ${#sides[@]} - 1) / ${#sides[@]}))
  pids=()
  for side in "${sides[@]}"; do
    (root=$work/$side out=$work/$side JOBS=$jobs_each && cd "$root" && ncu_build sparseprefill_c >/dev/null) &
    pids+=($!)
  done
  failed=0
  for i in "${!sides[@]}"; do
    wait "${pids[$i]}" || {
      failed=1
      cp "$work/${sides[$i]}/build.log" "$out/${sides[$i]}-build.log"
      echo "ab_bench: side ${sides[$i]} does not build:" >&2
      tail -30 "$work/${sides[$i]}/build.log" >&2
    }
  done
  ((failed)) && return 1
  for side in "${sides[@]}"; do touch "$work/$side/.built"; done
}
if [[ $step != run ]]; then build_sides || exit 1; fi
[[ $step == build ]] && exit 0
for side in "${sides[@]}"; do
  [[ -f $work/$side/.built ]] || { echo "ab_bench: side $side is not built in $work (SP_AB_STEP=build first)" >&2; exit 1; }
done

runs=()
for ((i = 1; i <= rounds; ++i)); do
  for side in "${sides[@]}"; do
    run=$side$i
    # A change that deadlocks a kernel would otherwise hold the device call to its limit.
    (cd "$work/$side" && timeout "$run_limit" bench/run_benchmarks.sh "$out/$run" "$@") >"$out/$run.log" 2>&1 || {
      rc=$?
      tail -20 "$out/$run.log"
      ((rc == 124)) && echo "ab_bench: $run ran past ${run_limit} s (SP_AB_RUN_SECONDS): stopped" >&2
      exit 1
    }
    runs+=("$run")
  done
done
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
rm -rf "${runs[@]/#/$out/}" "$out"/*[0-9].log
