#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: vLLM 0.26.0 from the parts scripts/vllm/pack.sh laid out, one device call
# each, kept outside the repository's copy under SP_VLLM_HOME (default /root/sp-vllm), since a
# carried path that the next call does not name is removed there:
#   assemble.sh part1   copy .carry/vllm/1/C.xz to SP_VLLM_HOME; start `pip install .` of
#                       sparseprefill with CUDA in the background (scripts/python_install_cuda.sh,
#                       from a copy of the tree in SP_VLLM_HOME/src), so it builds meanwhile
#   assemble.sh part2   check every part's sha256, install the wheels and unpack vLLM into
#                       SP_VLLM_HOME/site (PYTHONPATH: scripts/vllm/env.sh), wait for the build,
#                       import vLLM, FA3 and our backend once
# Env: PYTHON (default python3), SP_VLLM_HOME, SP_INSTALL_WAIT (seconds part2 waits for the
#      build, default 420).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
home=${SP_VLLM_HOME:-/root/sp-vllm}
py=${PYTHON:-python3}
cd "$root"
case "${1:-}" in
  part1)
    mkdir -p "$home"
    cp .carry/vllm/1/C.xz "$home/"
    rm -rf "$home/src" "$home/install" && mkdir -p "$home/src" "$home/install"
    tar --exclude=./.carry --exclude=./build -cf - . | tar -xf - -C "$home/src"
    (cd "$home/src" && setsid nohup bash -c "scripts/python_install_cuda.sh '$home/install'; echo \$? >'$home/install/rc'" \
      >"$home/install/out.log" 2>&1 </dev/null &)
    echo "assemble: C.xz in $home ($(du -h "$home/C.xz" | cut -f1)); building sparseprefill in the background ($home/install)"
    ;;
  part2)
    [ -f "$home/C.xz" ] || { echo "assemble: $home/C.xz missing: run part1 first (same warm machine)" >&2; exit 1; }
    cp .carry/vllm/2/rest.tar.xz .carry/vllm/2/SHA256SUMS "$home/"
    rm -rf "$home/wheels" && cp -r .carry/vllm/2/wheels "$home/wheels"
    (cd "$home" && sha256sum -c --quiet SHA256SUMS)  # C.xz, rest.tar.xz, wheels/*.whl
    rm -rf "$home/site" && mkdir -p "$home/site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$home/site" "$home"/wheels/*.whl
    xz -dc "$home/rest.tar.xz" | tar -xf - -C "$home/site"
    xz -dc "$home/C.xz" >"$home/site/vllm/_C_stable_libtorch.abi3.so"
    echo "assemble: vLLM in $home/site ($(du -sh "$home/site" | cut -f1))"
    for _ in $(seq 1 "${SP_INSTALL_WAIT:-420}"); do [ -f "$home/install/rc" ] && break; sleep 1; done
    if [ "$(cat "$home/install/rc" 2>/dev/null)" != 0 ]; then
      tail -n 30 "$home/install/install.log" "$home/install/out.log" 2>/dev/null || true
      echo "assemble: the sparseprefill build failed or has not finished ($home/install)" >&2
      exit 1
    fi
    tail -n 1 "$home/install/out.log"
    # shellcheck source=scripts/vllm/env.sh
    source "$root/scripts/vllm/env.sh"
    (cd /tmp && "$py" -c "
import vllm, vllm.vllm_flash_attn, sparseprefill, sparseprefill.vllm.backend
from importlib.metadata import entry_points
assert [e.value for e in entry_points(group='vllm.general_plugins') if e.name == 'sparseprefill'] == ['sparseprefill.vllm:register']
print('assemble: vllm', vllm.__version__, '| sparseprefill', sparseprefill.__version__, '| plugin registered')")
    ;;
  *)
    echo "usage: assemble.sh part1 | part2" >&2
    exit 2
    ;;
esac
