#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU machine's one call: configure and build the h200 preset, run the GPU tests, run
# compute-sanitizer (memcheck, racecheck) on small cases, time the kernel tiles and run the
# benchmarks, logging the SM clock meanwhile (clocks.csv); logs and tables go to OUTDIR (with
# more than 8 files there, all but summary.txt, resources.txt and bench/bench.{json,md} end in
# OUTDIR/logs.tar.gz: the device tool returns 8).
# Usage: scripts/gpu_check.sh OUTDIR
# Env: JOBS (default 16), SP_SKIP_BENCH=1, SP_SKIP_SANITIZER=1, SP_SKIP_TILES=1, SP_BENCH_ARGS
#      (extra bench/run_benchmarks.sh args), SP_TEST_FILTER (ctest -R regex), SP_TEST_EXCLUDE
#      (ctest -E regex: e.g. CudaMemory while another process shares the GPU), SP_TEST_TIMEOUT
#      (seconds per test, default 300), SP_BENCH_SECONDS (default 420), SP_WITH_PYTHON=1 (also
#      `pip install .` with CUDA, built beside the C++ build, then pytest over tests/python on
#      the GPU: python/install.log, python/pytest.log; SP_PYTEST_SECONDS, default 240),
#      SP_WITH_FA3=1 (then also scripts/fa3_check.sh: python/fa3*.{log,txt}), SP_MEMCHECK_FILTER.
#      GoogleTest is taken from .carry/gtest when present.
#      Every step has a time limit so the whole stays < 10 min.
set -uo pipefail
if (($# < 1)); then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=$root/build/h200
jobs=${JOBS:-16}
t0=$(date +%s)
summary=$out/summary.txt
: >"$summary"
note() { echo "[$(($(date +%s) - t0)) s] $*" | tee -a "$summary"; }

prefix=()
[[ -d $root/.carry/gtest/usr ]] && prefix=(-DCMAKE_PREFIX_PATH="$root/.carry/gtest/usr")

if [[ -n ${SP_WITH_PYTHON:-} ]]; then
  note "pip install (CUDA), in the background"
  mkdir -p "$out/python"
  "$root/scripts/python_install_cuda.sh" "$out/python" >"$out/python/install.out" 2>&1 &
  py_install=$!
fi

note "configure (h200 preset)"
if ! cmake --preset h200 "${prefix[@]}" -DSP_CUDA_RESOURCE_USAGE=ON >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"
  note "configure FAILED"
  exit 1
fi
# Only what this check runs: the GPU tests, the tile timing and the C ABI the benchmarks load.
targets=(sp_cuda_tiles)
for t in "$root"/tests/cuda/*_test.cu; do targets+=("$(basename "$t" .cu)"); done
targets+=(conformance_test)  # tests/conformance: its Cuda/* scenarios are labelled gpu
[[ -f $root/src/api/CMakeLists.txt ]] && targets+=(sparseprefill_c)
note "build -j$jobs: ${targets[*]}"
if ! cmake --build "$build" -j"$jobs" --target "${targets[@]}" >>"$out/build.log" 2>&1; then
  grep -E "error|Error" -A4 "$out/build.log" | head -80
  note "build FAILED"
  exit 1
fi
# Registers, shared memory and spills per kernel (ptxas -v), one line each.
demangle=cat
command -v c++filt >/dev/null && demangle=c++filt
awk '/Compiling entry function/ {name=$7 " " $9; gsub(/\x27/, "", name)}
     /spill stores/ {spill=$0; sub(/^ +/, "", spill)}
     /Used [0-9]+ registers/ {print name " | " $0 " | " spill; spill=""}' "$out/build.log" |
  sed 's/ptxas info *: //' | sort -u | $demangle | sed 's/sparseprefill::cuda:://g' >"$out/resources.txt"
# The Hopper instances' SASS: wgmma (HGMMA) count and local-memory accesses (LDL/STL).
if command -v cuobjdump >/dev/null; then
  for obj in "$build"/src/cuda/CMakeFiles/sp_cuda_sm90.dir/instances/*.o; do
    [[ -f $obj ]] || continue
    sass=$(cuobjdump --dump-sass "$obj")
    echo "$(basename "$obj" .cu.o) SASS | HGMMA $(grep -c HGMMA <<<"$sass") | LDL/STL $(grep -cE '\b(LDL|STL)' <<<"$sass")"
  done >>"$out/resources.txt"
fi
# ptxas serialises wgmma silently (C7510-C7520: a wgmma under a branch, accumulators read while
# a group is in flight, ...): the Hopper kernels' overlap is gone when one of these appears.
grep -h "Potential Performance Loss: wgmma" "$out/build.log" | sort -u | $demangle >>"$out/resources.txt"
note "ptxas: $(grep -c ' | Used ' "$out/resources.txt") kernel builds, $(grep -c 'bytes spill stores' "$out/resources.txt") with a spill line, $(grep -c 'Potential Performance Loss: wgmma' "$out/resources.txt") wgmma serialisation warning(s)"

note "gpu tests"
timeout 360 ctest --test-dir "$build" -L gpu ${SP_TEST_FILTER:+-R "$SP_TEST_FILTER"} ${SP_TEST_EXCLUDE:+-E "$SP_TEST_EXCLUDE"} -j8 --timeout "${SP_TEST_TIMEOUT:-300}" \
  --output-on-failure \
  >"$out/tests.log" 2>&1
tests_rc=$?
grep -E "tests passed|Failed|\*\*\*" "$out/tests.log" | tail -20 | tee -a "$summary"

# Correctness checks that time nothing run side by side on the GPU: compute-sanitizer, and with
# SP_WITH_PYTHON the Python tests (and SP_WITH_FA3: FlashAttention-3's suite); the timing steps
# below run alone.
test_bin=$build/tests/cuda/cuda_attention_test
conf_bin=$build/tests/conformance_test
mask_bin=$build/tests/cuda/cuda_device_mask_test
sanitizer() {
  timeout 240 compute-sanitizer --tool memcheck --error-exitcode 3 "$conf_bin" \
    --gtest_filter="${SP_MEMCHECK_FILTER:-Cuda/Conformance.DenseGqaGroups*:Cuda/Conformance.DenseVarlen*:Cuda/Conformance.EstimateSelectCachedMeans*:Cuda/Conformance.PermuteStopStableTau*:Cuda/Conformance.PermuteStopNaNValues*:Cuda/Conformance.Fp8*:Cuda/Conformance.DenseOddLengthsDtypesAndHeadDims*:Cuda/Conformance.ModelFamilyFeaturesOnEveryPolicy*}"
  echo "memcheck (conformance) rc=$?"
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 "$test_bin" \
    --gtest_filter='CudaBlockSparse.AllVisible*:CudaExactGate.KeptAllGate*:CudaPaged.DenseShortCaches*:CudaPaged.FamilyHeadDims*:CudaFp8.*'
  echo "memcheck rc=$?"
  timeout 180 compute-sanitizer --tool racecheck --error-exitcode 3 "$conf_bin" \
    --gtest_filter='Cuda/Conformance.ExactGateMinusInfinity*:Cuda/Conformance.SoftmaxSkipOffWhen*:Cuda/Conformance.PermuteStopTauZero*:Cuda/Conformance.EstimateSelectStableAlpha*:Cuda/Conformance.DenseOddLengthsDtypesAndHeadDims*'
  echo "racecheck (conformance) rc=$?"
  # The device block mask path (its check kernel, hostile entries included).
  if [[ -x $mask_bin ]]; then
    timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 "$mask_bin"
    echo "memcheck (device masks) rc=$?"
    timeout 120 compute-sanitizer --tool racecheck --error-exitcode 3 "$mask_bin" \
      --gtest_filter='CudaDeviceMask.ABadEntry*:CudaDeviceMask.FlexTensors*'
    echo "racecheck (device masks) rc=$?"
  fi
}
python_tests() {
  SP_TEST_DEVICES=cuda timeout "${SP_PYTEST_SECONDS:-240}" "${PYTHON:-python3}" -m pytest -q \
    -p no:cacheprovider --timeout=120 tests/python >"$out/python/pytest.log" 2>&1
  echo "pytest rc=$?: $(tail -1 "$out/python/pytest.log")"
  if [[ -n ${SP_WITH_FA3:-} ]]; then
    "$root/scripts/fa3_check.sh" "$out/python" >/dev/null 2>&1
    echo "$(head -1 "$out/python/fa3_summary.txt")"
  fi
}
pids=()
if [[ -z ${SP_SKIP_SANITIZER:-} ]]; then
  note "compute-sanitizer (in the background)"
  sanitizer >"$out/sanitizer.log" 2>&1 &
  pids+=($!)
fi
if [[ -n ${SP_WITH_PYTHON:-} ]]; then
  if wait "$py_install"; then
    note "pytest${SP_WITH_FA3:+ and the FlashAttention-3 suite} (CUDA, in the background)"
    python_tests >"$out/python/summary.txt" 2>&1 &
    pids+=($!)
  else
    note "pip install FAILED: $(tail -3 "$out/python/install.out")"
  fi
fi
((${#pids[@]})) && wait "${pids[@]}"
[[ -f $out/sanitizer.log ]] && grep -E "rc=|ERROR SUMMARY|RACECHECK SUMMARY" "$out/sanitizer.log" | tee -a "$summary"
[[ -f $out/python/summary.txt ]] && tee -a "$summary" <"$out/python/summary.txt"
note "correctness checks done"

# SM clock, power and temperature every 200 ms while the timing steps run (clocks.csv): the same
# kernel moved up to 10% between processes on these machines, and the clocks say whether the
# card throttled. Summarised in the summary when the timing steps end.
clock_log=
if [[ -z ${SP_SKIP_TILES:-} || -z ${SP_SKIP_BENCH:-} ]] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,temperature.gpu \
    --format=csv,noheader,nounits -lms 200 >"$out/clocks.csv" 2>/dev/null &
  clock_log=$!
fi

if [[ -z ${SP_SKIP_TILES:-} && -x $build/src/cuda/sp_cuda_tiles ]]; then
  note "kernel tiles"
  timeout 120 "$build/src/cuda/sp_cuda_tiles" 2>&1 | tee -a "$summary"
fi

if [[ -z ${SP_SKIP_BENCH:-} && -x $root/bench/run_benchmarks.sh ]]; then
  bench_s=${SP_BENCH_SECONDS:-420}
  if [[ -n ${SP_DEADLINE_S:-} ]]; then
    left=$((SP_DEADLINE_S - ($(date +%s) - t0) - 10))
    ((left < bench_s)) && bench_s=$left
  fi
  note "benchmarks (at most $bench_s s)"
  # shellcheck disable=SC2086
  SP_BUILD_DIR=$build timeout "$bench_s" "$root/bench/run_benchmarks.sh" "$out/bench" ${SP_BENCH_ARGS:-} >/dev/null 2>&1
  note "benchmarks rc=$?"
  [[ -f $out/bench/bench.md ]] && cat "$out/bench/bench.md" >>"$summary"
fi
if [[ -n $clock_log ]]; then
  kill "$clock_log" 2>/dev/null
  wait "$clock_log" 2>/dev/null
  # Samples while the SM was busy enough to draw power: min / median / max SM clock (MHz).
  [[ -f $out/clocks.csv ]] && awk -F', *' '$4 + 0 > 150 {print $2}' "$out/clocks.csv" | sort -n |
    awk '{v[NR] = $1} END {if (NR) printf "SM clock under load (MHz, %d samples): min %d, median %d, max %d\n", NR, v[1], v[int((NR + 1) / 2)], v[NR]}' |
    tee -a "$summary"
fi
note "done (gpu tests rc=$tests_rc)"
# The device tool brings back at most 8 files of $OUT (its README): the summary, the
# benchmark's bench.json and bench.md and the resource table stay as they are; every other
# file (logs, pytest, clocks) goes into one archive beside them. Two benchmark files lost to
# that limit: record 2026-11-29-h200-cost-order-items.
if (($(find "$out" -type f | wc -l) > 8)); then
  (cd "$out" && find . -type f ! -name summary.txt ! -name resources.txt ! -name logs.tar.gz \
     ! -path ./bench/bench.json ! -path ./bench/bench.md -print0 | tar --null -czf logs.tar.gz -T - --remove-files &&
     find . -mindepth 1 -type d -empty -delete)
fi
exit $tests_rc
