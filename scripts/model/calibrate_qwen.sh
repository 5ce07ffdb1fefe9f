#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Issue 32's calibration of Qwen2.5-Coder-1.5B-Instruct on the GPU machine: 3 windows of 32K
# tokens of the Debian Reference (a document no evaluation reads), block 128, bf16; exact_gate
# budgets 4, 8, 16, 32, softmax_skip skip targets 0.7, 0.8, 0.9, estimate_select density targets
# 0.1, 0.2, 0.3. scripts/model/gpu_qwen.sh (the quality run) and scripts/vllm/gpu_vllm.sh (the
# calibrated settings of its qwen stage) both calibrate through it.
# Usage: scripts/model/calibrate_qwen.sh OUTPUT   (the log on stdout and stderr)
# Env: QWEN_HOME (default /root/qwen: debian-reference.en.txt, qwen-bf16), QWEN_MODEL (a model
#      folder other than QWEN_HOME/qwen-bf16), SP_DEVICE (default cuda), PYTHON, SP_CAL_ARGS (more
#      calibrate arguments; later ones win), SOURCE_DATE_EPOCH (the date the file records).
set -euo pipefail
output=$(realpath -m "${1:?usage: scripts/model/calibrate_qwen.sh OUTPUT}")
root=$(cd "$(dirname "$0")/../.." && pwd)
# shellcheck source=scripts/model/qwen_env.sh
. "$root/scripts/model/qwen_env.sh"
home=${QWEN_HOME:-/root/qwen}
device=${SP_DEVICE:-cuda}
cd /tmp  # the installed package, not the checkout's python/ folder
# shellcheck disable=SC2086
exec "${PYTHON:-python3}" -m sparseprefill.quality.calibrate --model "${QWEN_MODEL:-$home/qwen-bf16}" \
  --model-name "$QWEN_MODEL_NAME" --text "$home/debian-reference.en.txt" --whole-text --direct --device "$device" \
  --dtype "$(qwen_dtype "$device")" --samples 3 --length 32768 --block 128 --budgets 4,8,16,32 --skip-targets 0.7,0.8,0.9 \
  --density-targets 0.1,0.2,0.3 --output "$output" ${SP_CAL_ARGS:-}
