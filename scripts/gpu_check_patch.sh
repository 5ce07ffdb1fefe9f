#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine, beside a session's own work: the GPU suite (scripts/gpu_check.sh, no
# timing steps) of a branch, given as a patch against this tree, in the background. The tree is
# copied outside the repository (a carried path the next call does not name is removed), the
# patch applied there, its Python package installed into a folder of its own (PIP_TARGET, first
# on PYTHONPATH for its pytest) so that the session's install stays the one its stages load,
# and the vLLM tests left out (they would start engines beside the session's).
#   gpu_check_patch.sh start PATCH OUT      copy, apply, start; OUT (outside the repository) gets
#                                           gpu_check.sh's results and done when it ends
#   gpu_check_patch.sh collect OUT DEST S   wait up to S seconds for it to end (so that nothing
#                                           timed runs beside it), then copy its summaries to DEST
# Env: SP_PATCH_MEMCHECK (gpu_check.sh's SP_MEMCHECK_FILTER for the patch's scenarios).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
copy=/root/sp-patch
case "${1:-}" in
  start)
    patch_file=$(cd "$(dirname "${2:?usage: gpu_check_patch.sh start PATCH OUT}")" && pwd)/$(basename "$2")
    out=${3:?usage: gpu_check_patch.sh start PATCH OUT}
    rm -rf "$copy" "$out" && mkdir -p "$copy" "$out"
    (cd "$root" && tar --exclude=./.carry/qwen --exclude=./.carry/vllm --exclude=./build -cf - .) | tar -xf - -C "$copy"
    (cd "$copy" && patch -p1 -s <"$patch_file") || { echo "gpu_check_patch: $2 does not apply" >&2; exit 1; }
    rm -f "$copy"/tests/python/test_vllm_*.py
    (setsid nohup env PIP_TARGET="$copy/pytarget" PYTHONPATH="$copy/pytarget${PYTHONPATH:+:$PYTHONPATH}" \
       SP_WITH_PYTHON=1 SP_SKIP_BENCH=1 SP_SKIP_TILES=1 SP_TEST_EXCLUDE=CudaMemory JOBS=6 CMAKE_BUILD_PARALLEL_LEVEL=6 \
       ${SP_PATCH_MEMCHECK:+SP_MEMCHECK_FILTER="$SP_PATCH_MEMCHECK"} \
       bash -c "'$copy/scripts/gpu_check.sh' '$out' >'$out/gpu_check.out' 2>&1; touch '$out/done'" \
       >/dev/null 2>&1 </dev/null &)
    echo "gpu_check_patch: $(basename "$2") applied in $copy, its GPU suite started (results: $out)"
    ;;
  collect)
    out=${2:?usage: gpu_check_patch.sh collect OUT DEST SECONDS}
    dest=${3:?usage: gpu_check_patch.sh collect OUT DEST SECONDS}
    end=$(($(date +%s) + ${4:-300}))
    while [ ! -f "$out/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    [ -f "$out/done" ] || echo "gpu_check_patch: still running after ${4:-300} s; copying what it has"
    mkdir -p "$dest"
    for f in summary.txt tests.log sanitizer.log resources.txt gpu_check.out python/summary.txt python/pytest.log \
             python/install.out; do
      [ -f "$out/$f" ] && mkdir -p "$dest/$(dirname "$f")" && cp "$out/$f" "$dest/$f"
    done
    cat "$dest/summary.txt" 2>/dev/null
    ;;
  *)
    echo "usage: gpu_check_patch.sh start PATCH OUT | collect OUT DEST SECONDS" >&2
    exit 2
    ;;
esac
