#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# On the GPU machine: joins the GGUF parts copied by scripts/model/pack.sh, checks the model and
# text checksums, lays them out as fetch.sh does (build/models/{smollm2,text}/) and installs the
# carried wheels offline.
# Usage: scripts/model/assemble.sh DIR   (DIR holds gguf.00, gguf.01, ..., policy.txt, wheels/)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:?usage: scripts/model/assemble.sh DIR}
py=${PYTHON:-python3}
dest=$root/build/models
mkdir -p "$dest/smollm2" "$dest/text"
cat "$dir"/gguf.[0-9][0-9] >"$dest/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
cp "$dir/policy.txt" "$dest/text/policy.txt"
(cd "$dest" && grep -E '  (SmolLM2-135M-Instruct\.Q4_1\.gguf|policy\.txt)$' "$root/scripts/model/SHA256SUMS" |
  sed -e 's#  SmolLM2#  smollm2/SmolLM2#' -e 's#  policy.txt#  text/policy.txt#' | sha256sum -c -)
if [ -d "$dir/wheels" ]; then
  "$py" -m pip install -q --no-index --no-deps "$dir"/wheels/*.whl
fi
echo "model: $dest/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "text:  $dest/text/policy.txt"
