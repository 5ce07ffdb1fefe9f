#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# GoogleTest for the GPU machine, which has no package registry: Debian's libgtest-dev (the
# static libraries and CMake config the GPU tests link) unpacked into .carry/gtest/usr
# (git-ignored), which scripts/gpu_check.sh finds there. Carry `.carry/gtest` in the device
# call that builds the tests.
# Usage: scripts/carry_gtest.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
out=$root/.carry/gtest
[[ -d $out/usr/lib ]] && { echo "carry_gtest: $out already unpacked"; exit 0; }
mkdir -p "$out/dl"
(cd "$out/dl" && apt-get download libgtest-dev)
for deb in "$out"/dl/*.deb; do dpkg -x "$deb" "$out"; done
rm -rf "$out/dl"
du -sh "$out"
