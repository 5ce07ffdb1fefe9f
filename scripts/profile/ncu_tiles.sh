#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GPU machine: profile forward-kernel launches of `sp_cuda_tiles` (src/cuda/dev/tiles.cu) with
# Nsight Compute and write what the paged-K/V investigation of issue #8 needed, in one call:
#   OUTDIR/report.ncu-rep   the full report (ncu --set full, clocks left alone)
#   OUTDIR/details.csv      every section's metrics, one row per (launch, metric)
#   OUTDIR/stalls.txt       warp-stall sampling per launch: the stall reasons, then the hottest
#                           SASS instructions split at the warp-specialised kernels'
#                           `USETMAXREG.DEALLOC` (producer after it, consumers before)
#   OUTDIR/metrics.txt      headline throughput, occupancy and cache figures
# (the build and the summary: scripts/profile/ncu_common.sh)
# Usage: scripts/profile/ncu_tiles.sh OUTDIR [sp_cuda_tiles arguments, e.g. paged 16]
# Env: SP_NCU_KERNEL (demangled-name regex, default sm90), SP_NCU_SKIP (launches of it to skip,
#      default 8: the contiguous call's warm-up and 7 timed launches in `paged` mode, so the next
#      one is the first paged call's warm-up), SP_NCU_COUNT (launches to profile, default 1),
#      JOBS (build parallelism, default 16). GoogleTest from .carry/gtest when present.
set -uo pipefail
if (($# < 1)); then
  echo "usage: $0 OUTDIR [sp_cuda_tiles arguments]" >&2
  exit 2
fi
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
# shellcheck source=scripts/profile/ncu_common.sh
source "$root/scripts/profile/ncu_common.sh"
ncu_build sp_cuda_tiles || exit 1
timeout 480 ncu --clock-control none --set full --import-source no --kernel-name-base demangled \
  -k "regex:${SP_NCU_KERNEL:-sm90}" --launch-skip "${SP_NCU_SKIP:-8}" --launch-count "${SP_NCU_COUNT:-1}" \
  -o "$out/report" build/h200/src/cuda/sp_cuda_tiles "$@" >"$out/ncu.log" 2>&1
rc=$?
tail -3 "$out/ncu.log"
((rc == 0)) || exit "$rc"
ncu_summarise
