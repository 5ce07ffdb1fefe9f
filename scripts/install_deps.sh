#!/usr/bin/env bash
# Installs what building and testing sparseprefill needs on a fresh Debian 12 machine:
# compilers and CMake/Ninja, GoogleTest and Google Benchmark, clang for the fuzzers and the
# sanitizer runtimes. Idempotent; skips apt when everything is already there.
set -euo pipefail
pkgs=(build-essential cmake ninja-build googletest libgtest-dev libgmock-dev libbenchmark-dev
      clang libclang-rt-14-dev python3)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
