# SPDX-License-Identifier: Apache-2.0
"""Captures the attention inputs of a transformers model: an attention function, registered as
attn_implementation="sparseprefill_capture", that hands each layer's query (after RoPE)
[b, s, h_q, d] and key/value [b, s, h_kv, d] (GQA heads not repeated) to a sink and then runs
the sparseprefill backend (its current BackendConfig; dense by default)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from .. import transformers as spt

__all__ = ["NAME", "register", "capturing", "numpy_sink"]

NAME = "sparseprefill_capture"

# sink(layer, q, k, v) with q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d] views; None: no capture.
_sink: Optional[Callable[[int, Any, Any, Any], None]] = None


def _forward(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    if _sink is not None:
        _sink(module.layer_idx, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    return spt.attention_forward(module, query, key, value, attention_mask, **kwargs)


def register() -> str:
    """Registers the capturing attention (and FlashAttention's padding-mask function)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(NAME, _forward)
    AttentionMaskInterface.register(NAME, flash_attention_mask)
    return NAME


@contextlib.contextmanager
def capturing(sink: Optional[Callable[[int, Any, Any, Any], None]]) -> Iterator[None]:
    """Calls sink(layer, q, k, v) for every attention call of a model set to NAME (None: no
    capture)."""
    global _sink
    previous, _sink = _sink, sink
    try:
        yield
    finally:
        _sink = previous


def numpy_sink(store: Dict[int, Any], layers: List[int]) -> Callable[[int, Any, Any, Any], None]:
    """A sink that keeps the listed layers' q, k, v in `store` as contiguous float32 NumPy
    arrays [1, s, h, d]."""
    def sink(layer: int, q: Any, k: Any, v: Any) -> None:
        if layer in layers:
            store[layer] = tuple(np.ascontiguousarray(t.detach().float().cpu().numpy()) for t in (q, k, v))
    return sink
