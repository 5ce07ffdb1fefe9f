# SPDX-License-Identifier: Apache-2.0
# Sourced by scripts/profile/ncu_*.sh (and ab_bench.sh, for the build): the build they profile
# and the summary of a report.
# Needs $root (the repository) and $out (the output folder).

# Builds TARGET of the h200 preset (JOBS, default 16; GoogleTest from .carry/gtest when
# present) into build/h200; the log goes to $out/build.log, its tail to stdout on failure. The
# cache is scripts/gpu_check.sh's (ptxas' resource lines on: they change no code), so that the
# GPU check reuses this build instead of compiling every kernel again.
ncu_build() {
  local prefix=()
  [[ -d $root/.carry/gtest/usr ]] && prefix=(-DCMAKE_PREFIX_PATH="$root/.carry/gtest/usr")
  if ! { cmake --preset h200 "${prefix[@]}" -DSP_CUDA_RESOURCE_USAGE=ON && cmake --build build/h200 -j"${JOBS:-16}" --target "$1"; } \
    >"$out/build.log" 2>&1; then
    tail -30 "$out/build.log"
    return 1
  fi
}

# $out/report.ncu-rep -> details.csv, stalls.txt (scripts/profile/ncu_stalls.py, TOP hottest
# instructions, default its own) and metrics.txt (the headline throughput, occupancy and cache
# figures); the large raw and source exports are removed again (the report holds them).
ncu_summarise() {
  ncu -i "$out/report.ncu-rep" --page details --csv >"$out/details.csv"
  ncu -i "$out/report.ncu-rep" --page raw --csv >"$out/raw.csv"
  ncu -i "$out/report.ncu-rep" --page source --csv --print-source sass >"$out/source.csv"
  python3 "$root/scripts/profile/ncu_stalls.py" "$out/raw.csv" "$out/source.csv" ${1:+"$1"} | tee "$out/stalls.txt"
  grep -E '"(Duration|Compute \(SM\) Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Issue Slots Busy|Executed Ipc Active|L1/TEX Hit Rate|L2 Hit Rate|Block Limit Registers|Block Limit Shared Mem)"' \
    "$out/details.csv" | awk -F'","' '{print $(NF-2) " = " $NF " " $(NF-1)}' | tee "$out/metrics.txt"
  rm -f "$out/raw.csv" "$out/source.csv"
}
