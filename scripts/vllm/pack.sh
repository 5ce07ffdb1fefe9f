#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Lays vLLM 0.26.0 out for the GPU machine, which reaches no registry and receives at most
# 64 MiB per device call (the working tree, about 12 MiB, included), under the git-ignored
# .carry/vllm/ (never committed):
#   1/N/C.xz.N          vllm/_C_stable_libtorch.abi3.so, xz -9 (about 53 MiB), split into pieces of
#                       at most 40 MiB (N = 0, 1, ...), one call each: the tree (about 12 MiB)
#                       travels with every call
#   2/rest.tar.xz       the rest of the wheel that vLLM imports, xz -9 (about 14 MiB), without what
#                       FA3-on-Hopper serving never loads: FlashAttention-2's and the MoE
#                       library, the Rust frontend, DeepGEMM's builds and headers, FlashMLA,
#                       QuTLASS, FA's CuTe sources (docs/vllm.md, "Install on the GPU machine")
#   2/wheels/           scripts/vllm/wheels.txt for CPython 3.12, manylinux x86-64 (about 22 MiB)
#   2/SHA256SUMS        of C.xz, rest.tar.xz and the wheels, checked by assemble.sh there
# Usage: scripts/vllm/pack.sh   (PYTHON picks the pip; SP_VLLM_WHEEL: a vllm-0.26.0 wheel already
#        downloaded, else it is fetched into build/vllm/dl)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-python3}
out=$root/.carry/vllm
dl=$root/build/vllm/dl
stage=$root/build/vllm/stage
version=0.26.0
mkdir -p "$dl"
wheel=${SP_VLLM_WHEEL:-}
if [ -z "$wheel" ]; then
  wheel=$(ls "$dl"/vllm-$version-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d "$dl" "vllm==$version"
    wheel=$(ls "$dl"/vllm-$version-*.whl | head -1)
  fi
fi
rm -rf "$out" "$stage"
mkdir -p "$out/1" "$out/2/wheels" "$stage"
(cd "$stage" && "$py" -m zipfile -e "$wheel" .)
site=$stage
xz -9 -T0 -c "$site/vllm/_C_stable_libtorch.abi3.so" >"$stage/C.xz"
(cd "$stage" && sha256sum C.xz >"$stage/C.sum")
split -b 40M -d -a 1 "$stage/C.xz" "$stage/C.xz."
for piece in "$stage"/C.xz.?; do
  n=${piece##*.}
  mkdir -p "$out/1/$n" && mv "$piece" "$out/1/$n/"
done
rm "$stage/C.xz"
rm "$site/vllm/_C_stable_libtorch.abi3.so"
rm -rf "$site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$site/vllm/_moe_C_stable_libtorch.abi3.so" \
  "$site/vllm/vllm-rs" "$site/vllm/third_party/deep_gemm/include" "$site/vllm/_qutlass_C.abi3.so" \
  "$site/vllm/vllm_flash_attn/cute"
rm -f "$site"/vllm/third_party/deep_gemm/*.so "$site"/vllm/_flashmla*_C.abi3.so
find "$site" -name __pycache__ -prune -exec rm -rf {} +
(cd "$site" && tar -cf - vllm "vllm-$version.dist-info" | xz -9 -T0 >"$out/2/rest.tar.xz")
grep -v '^#' "$root/scripts/vllm/wheels.txt" | xargs "$py" -m pip download -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out/2/wheels"
(cat "$stage/C.sum" && cd "$out/2" && sha256sum rest.tar.xz wheels/*.whl) >"$out/2/SHA256SUMS"
rm -rf "$stage"
tree=$(cd "$root" && git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for part in $(cd "$out" && echo 1/* 2); do
  size=$(du -sb "$out/$part" | cut -f1)
  echo "pack: .carry/vllm/$part: $((size >> 20)) MiB (+ the tracked tree, $((tree >> 20)) MiB)"
  if [ $((size + tree)) -gt $((63 << 20)) ]; then
    echo "pack: .carry/vllm/$part and the tree exceed 63 MiB; a device call carries at most 64 MiB" >&2
    exit 1
  fi
done
echo "next: python3 scripts/vllm/calls.py   (the device calls of both sessions, in order)"
