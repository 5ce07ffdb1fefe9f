#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Builds the libFuzzer target (the `fuzz` preset: clang, ASan + UBSan + LeakSanitizer) and runs
# it for a bounded time over the seed corpus of tests/fuzz/corpus. Exits non-zero on any crash,
# leak, timeout or sanitizer report; the reproducer is left in build/fuzz/artifacts/.
#   scripts/fuzz.sh [seconds]    (default 60)
set -euo pipefail

seconds="${1:-60}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build/fuzz"

cmake --preset fuzz -S "$root" >/dev/null
cmake --build "$build" --target calibration_fuzz -j "${SP_JOBS:-2}"

# New inputs go to a scratch corpus; the committed seeds are only read.
work="$build/corpus"
artifacts="$build/artifacts"
mkdir -p "$work" "$artifacts"
rm -f "$artifacts"/*

export ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1:allocator_may_return_null=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"

status=0
"$build/tests/fuzz/calibration_fuzz" \
  -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=8192 \
  -dict="$root/tests/fuzz/calibration.dict" -print_final_stats=1 \
  -artifact_prefix="$artifacts/" "$work" "$root/tests/fuzz/corpus" || status=$?

if [[ $status -ne 0 ]] || compgen -G "$artifacts/*" >/dev/null; then
  echo "fuzz.sh: FAILED (exit $status); reproducers:" >&2
  ls -l "$artifacts" >&2
  exit 1
fi
echo "fuzz.sh: clean after ${seconds}s"
