#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Prepares the quality runs' inputs for the GPU machine, which reaches no registry and receives
# at most 64 MiB per copy: the GGUF split into parts of 48 MiB, the text, and the wheels that
# loading a GGUF adds to torch + transformers (gguf, accelerate, psutil), under .carry/model/
# (git-ignored). scripts/model/assemble.sh joins the parts there and checks the checksum.
# Usage: scripts/model/pack.sh [MODELS]   (default build/models, as written by fetch.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
src=${1:-$root/build/models}
out=$root/.carry/model
py=${PYTHON:-python3}
rm -rf "$out"
mkdir -p "$out/parts" "$out/wheels"
split -b 48M -d "$src/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$out/parts/gguf."
cp "$src/text/policy.txt" "$out/"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" \
  gguf==0.19.0 accelerate==1.15.0 psutil==7.2.2
du -ah "$out" | sort -k2
cat <<MSG
Copy to the GPU machine in separate runs (each call carries at most 64 MiB), e.g.
  run carry=[".carry/model/parts/gguf.00"]  command: mkdir -p build/carry && cp .carry/model/parts/gguf.00 build/carry/
  run carry=[".carry/model/parts/gguf.01", ".carry/model/policy.txt", ".carry/model/wheels"]
      command: cp -r .carry/model/parts/gguf.01 .carry/model/policy.txt .carry/model/wheels build/carry/ && scripts/model/assemble.sh build/carry
MSG
