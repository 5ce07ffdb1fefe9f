# SPDX-License-Identifier: Apache-2.0
"""sparseprefill as a vLLM attention backend (docs/vllm.md).

`pip install` of this package registers it in every vLLM process through the entry point
vllm.general_plugins -> sparseprefill.vllm:register; then

    vllm serve MODEL --attention-backend CUSTOM --additional-config '{"sparseprefill": {...}}'
    LLM(MODEL, attention_backend="CUSTOM", additional_config={"sparseprefill": {...}})

Decodes and short prefills run vLLM's FlashAttention; long prefills and prefill chunks run the
configured policy over vLLM's paged KV cache in place. This package's pure parts (config: the
configuration and per-layer decisions; batch: the split of a step's batch) import neither vLLM
nor torch; sparseprefill.vllm.backend holds the vLLM classes."""

from __future__ import annotations

from .batch import BatchSplit, DenseRun, SparseRun, flex_lists, split_batch, synthetic_mask
from .config import (LayerDecision, LayerSpec, PolicySpec, SparsePrefillConfig, SyntheticDensity, decide_layer,
                     layer_policy, parse_config, rank_heads, rank_thresholds)

__all__ = ["BACKEND", "register", "BatchSplit", "DenseRun", "SparseRun", "flex_lists", "split_batch", "synthetic_mask",
           "LayerDecision", "LayerSpec", "PolicySpec", "SparsePrefillConfig", "SyntheticDensity", "decide_layer",
           "layer_policy", "parse_config", "rank_heads", "rank_thresholds"]

BACKEND = "sparseprefill.vllm.backend.SparsePrefillBackend"


def register() -> None:
    """vLLM's general plugin hook (every vLLM process calls it): fills the CUSTOM attention
    backend slot with ours, by class path, so that nothing of the backend (nor CUDA) is loaded
    until a model selects it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND)
