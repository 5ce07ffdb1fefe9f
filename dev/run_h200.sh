#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# One GPU-machine call for dev/fwd_sm90_dense.cu: use the binary built here (argument 1) or build
# it there, check each version in its own process under a timeout (a deadlocked pipeline cannot
# eat the call), time the versions that did not hang, time the cuDNN peer, count HGMMA in the SASS.
set -u
cd "$(dirname "$0")/.."
B=${1:-build/dev/fwd_sm90_dense}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader
if ! "$B" info; then
  echo "binary $B does not run here: building it"
  mkdir -p build/dev
  nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -lineinfo -Xptxas=-v -I src \
    -o build/dev/fwd_sm90_dense dev/fwd_sm90_dense.cu 2>&1 | grep -E "registers|spill|warn|error"
  B=build/dev/fwd_sm90_dense
fi
ran=""
for v in v1 v2 v3 v4; do
  timeout 20 "$B" check "$v"
  rc=$?
  [ $rc -ne 124 ] && ran="$ran,$v"
  [ $rc -ne 0 ] && echo "$v: check rc=$rc (124 = timed out: deadlock)"
done
ran=${ran#,}
[ -n "$ran" ] && timeout 120 "$B" bench "$ran"
timeout 120 python3 dev/sdpa_cudnn.py
echo "HGMMA instructions in the SASS: $(cuobjdump --dump-sass "$B" | grep -c HGMMA)"
