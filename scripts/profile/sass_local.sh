#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# This machine (no GPU needed): compiles one kernel instance for one architecture with ptxas -v
# and summarises its SASS, so that registers, spills and instruction counts are read before
# device time is spent (DEVELOPERS.md). The compile command is the configured build's own
# (`ninja -t commands`) with the architecture replaced and the object written to a temporary
# folder; cuobjdump and nvdisasm (not in the CUDA toolkit install here) come from PyPI,
# nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm 13.5.37, installed into SP_TOOLS.
# Usage: scripts/profile/sass_local.sh INSTANCE [ARCH] [BUILD_DIR]
#   INSTANCE: a file name under src/cuda/instances without .cu, e.g. fwd_sm80_bf16_hd128
#   ARCH: 90 (default), 80, 90a, ...; BUILD_DIR: a configured build with CUDA (default build/ci)
# Prints per kernel: ptxas's registers and spills, then the SASS instruction count and the most
# frequent opcodes. Env: SP_TOOLS (default ~/.cache/sparseprefill-tools), SP_SASS_OUT (keep the
# object and its SASS there), SP_SASS_TOP (opcodes listed, default 12).
set -euo pipefail
if (($# < 1)); then
  echo "usage: $0 INSTANCE [ARCH] [BUILD_DIR]" >&2
  exit 2
fi
inst=$1
arch=${2:-90}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
build=$(cd "${3:-$root/build/ci}" && pwd)
tools=${SP_TOOLS:-$HOME/.cache/sparseprefill-tools}
out=${SP_SASS_OUT:-$(mktemp -d)}
mkdir -p "$out"

cmd=$(ninja -C "$build" -t commands | grep -F "instances/$inst.cu.o" | grep -F nvcc | tail -n 1 || true)
if [[ -z $cmd ]]; then
  echo "sass_local: no nvcc command for instances/$inst.cu in $build (configure it with CUDA first)" >&2
  exit 1
fi
obj=$out/$inst.sm_$arch.o
# One architecture, no dependency file, our object; ccache left out (its cache key ignores -Xptxas=-v
# output, which a cache hit would not print).
cmd=$(sed -E -e 's/^ccache //' \
  -e 's/(-gencode[= ]|--generate-code[= ])[^ ]+//g' \
  -e 's/ -MD -MT [^ ]+ -MF [^ ]+//' \
  -e "s| -o [^ ]+| -o $obj|" <<<"$cmd")
[[ $cmd == *"-Xptxas=-v"* ]] || cmd+=" -Xptxas=-v"
cmd+=" -gencode=arch=compute_$arch,code=sm_$arch"
(cd "$build" && eval "$cmd") >"$out/ptxas.log" 2>&1 || {
  tail -20 "$out/ptxas.log" >&2
  exit 1
}

demangle="cat"
command -v c++filt >/dev/null && demangle=c++filt
echo "== ptxas (sm_$arch): registers | spills"
awk '/Compiling entry function/ {name=$7; gsub(/\x27/, "", name)}
     /spill stores/ {spill=$0; sub(/^ +/, "", spill)}
     /Used [0-9]+ registers/ {sub(/.*Used/, "Used"); print name " | " $0 " | " spill; spill=""}' "$out/ptxas.log" |
  $demangle | sed 's/sparseprefill::cuda:://g'

cuobjdump=$tools/nvidia/cu13/bin/cuobjdump
if [[ ! -x $cuobjdump ]]; then
  echo "(installing cuobjdump and nvdisasm 13.5.37 from PyPI into $tools)" >&2
  python3 -m pip install --quiet --no-deps --target "$tools" nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37 >&2
fi
PATH=$(dirname "$cuobjdump"):$PATH "$cuobjdump" --dump-sass "$obj" >"$out/$inst.sm_$arch.sass"
echo "== SASS: instructions and the most frequent opcodes per kernel"
python3 - "$out/$inst.sm_$arch.sass" "${SP_SASS_TOP:-12}" <<'PY' | $demangle | sed 's/sparseprefill::cuda:://g'
import collections, re, sys
kernels, name = {}, None
for line in open(sys.argv[1]):
    m = re.match(r"\s+Function : (\S+)", line)
    if m:
        name = m.group(1)
        kernels[name] = collections.Counter()
        continue
    m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)", line)
    if m and name:
        op = m.group(1)
        kernels[name][op.split(".")[0] if not op.startswith("IMAD.MOV") else "IMAD.MOV"] += 1
for name, ops in kernels.items():
    print(f"{name}: {sum(ops.values())} instructions; " +
          ", ".join(f"{op} {n}" for op, n in ops.most_common(int(sys.argv[2]))))
PY
[[ -n ${SP_SASS_OUT:-} ]] || rm -rf "$out"
