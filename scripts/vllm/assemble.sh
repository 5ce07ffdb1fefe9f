#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: vLLM 0.26.0 from the parts scripts/vllm/pack.sh laid out, one device call
# each, kept outside the repository's copy under SP_VLLM_HOME (default /root/sp-vllm), since a
# carried path that the next call does not name is removed there:
#   assemble.sh part1 N   copy piece N of vLLM's _C (.carry/vllm/1/N/C.xz.N) to SP_VLLM_HOME
#   assemble.sh install   start `pip install .` of sparseprefill with CUDA in the background
#                         (scripts/python_install_background.sh, in SP_VLLM_HOME/install), so it
#                         builds meanwhile; scripts/vllm/gpu_vllm.sh waits for it. One build per
#                         machine: the session with the real model builds it with
#                         scripts/model/assemble_qwen.sh install instead (scripts/vllm/README.md)
#   assemble.sh part2     join the pieces into C.xz, check every part's sha256, install the wheels and unpack vLLM into
#                         SP_VLLM_HOME/site (PYTHONPATH: scripts/vllm/env.sh), import vLLM and
#                         FA3 once (neither needs the build)
# Env: PYTHON (default python3), SP_VLLM_HOME.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
home=${SP_VLLM_HOME:-/root/sp-vllm}
py=${PYTHON:-python3}
cd "$root"
case "${1:-}" in
  part1)
    n=${2:?usage: assemble.sh part1 N}
    mkdir -p "$home"
    cp ".carry/vllm/1/$n/C.xz.$n" "$home/"
    echo "assemble: C.xz.$n in $home ($(du -h "$home/C.xz.$n" | cut -f1))"
    ;;
  install)
    scripts/python_install_background.sh start "$home/install"
    echo "assemble: building sparseprefill in the background ($home/install)"
    ;;
  part2)
    compgen -G "$home/C.xz.?" >/dev/null ||
      { echo "assemble: no piece of C.xz in $home: run part1 first (same warm machine)" >&2; exit 1; }
    cat "$home"/C.xz.? >"$home/C.xz"
    cp .carry/vllm/2/rest.tar.xz .carry/vllm/2/SHA256SUMS "$home/"
    rm -rf "$home/wheels" && cp -r .carry/vllm/2/wheels "$home/wheels"
    (cd "$home" && sha256sum -c --quiet SHA256SUMS)  # C.xz, rest.tar.xz, wheels/*.whl
    rm -rf "$home/site" && mkdir -p "$home/site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$home/site" "$home"/wheels/*.whl
    xz -dc "$home/rest.tar.xz" | tar -xf - -C "$home/site"
    xz -dc "$home/C.xz" >"$home/site/vllm/_C_stable_libtorch.abi3.so"
    echo "assemble: vLLM in $home/site ($(du -sh "$home/site" | cut -f1))"
    # shellcheck source=scripts/vllm/env.sh
    source "$root/scripts/vllm/env.sh"
    (cd /tmp && "$py" -c "import vllm, vllm.vllm_flash_attn; print('assemble: vllm', vllm.__version__, 'with FA3')")
    ;;
  *)
    echo "usage: assemble.sh part1 N | install | part2" >&2
    exit 2
    ;;
esac
