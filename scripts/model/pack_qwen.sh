#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Lays issue 32's inputs out for the GPU machine, which reaches no registry and receives at most
# 64 MiB per call (the working tree included): .carry/qwen/NN/partNN.bin for NN = 01 .. 22 (50 MiB
# each, the last 16 MiB), and beside the last part the two texts and the gguf wheel that loading
# a GGUF adds to the machine's torch + transformers (.carry/ is git-ignored). One device call
# per folder; python3 scripts/model/qwen_calls.py prints them.
# Usage: scripts/model/pack_qwen.sh [MODELS]   (default build/models, as written by fetch_qwen.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
src=${1:-$root/build/models}
out=$root/.carry/qwen
py=${PYTHON:-python3}
sums=$root/scripts/model/SHA256SUMS
parts=22
rm -rf "$out"
for i in $(seq 1 "$parts"); do
  n=$(printf %02d "$i")
  mkdir -p "$out/$n"
  ln "$src/qwen/parts/part$n.bin" "$out/$n/" 2>/dev/null || cp "$src/qwen/parts/part$n.bin" "$out/$n/"
done
last=$out/$(printf %02d "$parts")
mkdir -p "$last/wheels"
cp "$src/text/policy.txt" "$src/text/debian-reference.en.txt" "$last/"
"$py" -m pip download -q --no-deps --only-binary=:all: -d "$last/wheels" gguf==0.19.0
(cd "$last" && for f in part$(printf %02d "$parts").bin policy.txt debian-reference.en.txt wheels/gguf-0.19.0-py3-none-any.whl; do
  echo "$(awk -v f="$(basename "$f")" '$2 == f {print $1}' "$sums")  $f"
done | sha256sum -c --quiet -)
tree=$(cd "$root" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
big=$(du -sb "$out"/* | sort -n | tail -1 | cut -f1)
echo "pack_qwen: $parts folders under $out; the largest $((big >> 20)) MiB, the tracked tree $((tree >> 20)) MiB"
if [ $((tree + big)) -gt $((62 << 20)) ]; then
  echo "pack_qwen: a part and the tree exceed 62 MiB; a device call carries at most 64 MiB" >&2
  exit 1
fi
echo "next: python3 scripts/model/qwen_calls.py   (the device calls, in order)"
