# SPDX-License-Identifier: Apache-2.0
# Sourced on the GPU machine after scripts/vllm/assemble.sh part2: vLLM from SP_VLLM_HOME/site,
# offline, without FlashInfer's sampler (FlashInfer is not carried) or usage reports, and with
# NVLink multicast off in every process vLLM starts (the GPU machines' rule, device KINDS.md:
# multicast there can take a shared host's GPUs out of service).
export SP_VLLM_HOME=${SP_VLLM_HOME:-/root/sp-vllm}
export PYTHONPATH=$SP_VLLM_HOME/site${PYTHONPATH:+:$PYTHONPATH}
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
