# SPDX-License-Identifier: Apache-2.0
"""A Hugging Face transformers attention backend: register() makes
attn_implementation="sparseprefill" available. Each attention layer gets its policy from a
BackendConfig (the first layers dense, per-layer policies or calibrated thresholds); decode
steps (one query) and short prefills run dense. K/V keep their h_kv heads (GQA without
repetition); padding masks are handled by packing the valid tokens (varlen). What the model's
attention module passes is applied in every call, whatever the policy: its sliding window
(Gemma 2/3, gpt-oss, Mistral: a window of w tokens is FlashAttention's (w - 1, w - 1),
intersected with causal), its softcap (Gemma 2), its learned sinks (gpt-oss's s_aux) and a
chunked-attention layer's chunks (Llama 4: config.layer_types, attention_chunk_size; whole
prompts only, since the layer's cache keeps no positions), on the backends that run them
(docs/semantics.md §1; the CUDA backend runs sliding windows and chunks under dense and
block_sparse layers and raises UnsupportedError naming the feature otherwise, until its kernels
take it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from ._ext import InvalidArgumentError, UnsupportedError
from .calibration import Calibration, load_calibration
from .flash_attn_interface import flash_attn_func, flash_attn_varlen_func
from .policy import Dense, ExactGate, Policy

__all__ = ["BackendConfig", "register", "set_config", "get_config", "attention_forward", "NAME"]

NAME = "sparseprefill"


@dataclass
class BackendConfig:
    """Which policy each layer runs.

    policy: the policy of sparse layers, or a function layer_idx -> policy.
    dense_layers: layers [0, dense_layers) always run dense.
    layer_policies: per-layer overrides {layer_idx: policy}.
    calibration, budget: when set (a file path or Calibration, and a budget value), sparse
        layers run ExactGate with that layer's calibrated thresholds (unless overridden).
    min_sparse_len: prefills with fewer queries than this run dense (decode always does)."""

    policy: Union[Policy, Callable[[int], Policy]] = field(default_factory=Dense)
    dense_layers: int = 0
    layer_policies: Dict[int, Policy] = field(default_factory=dict)
    calibration: Union[None, str, Calibration] = None
    budget: Optional[int] = None
    min_sparse_len: int = 1024

    def policy_for(self, layer: Optional[int], s_q: int) -> Policy:
        if s_q <= 1 or s_q < self.min_sparse_len:
            return Dense()
        if layer is not None and layer < self.dense_layers:
            return Dense()
        if layer is not None and layer in self.layer_policies:
            return self.layer_policies[layer]
        if self.calibration is not None:
            if layer is None:
                raise UnsupportedError("calibration: the attention module has no layer_idx to pick thresholds by")
            return _calibrated(self.calibration, layer, self.budget)
        return self.policy(layer) if callable(self.policy) and not isinstance(self.policy, Policy) else self.policy


_GATES: Dict[Tuple[int, int, int], ExactGate] = {}


def _calibrated(calibration: Union[str, Calibration], layer: int, budget: Optional[int]) -> ExactGate:
    # One ExactGate per (file, layer, budget), so its threshold table is copied to the device once.
    cal = calibration if isinstance(calibration, Calibration) else load_calibration(calibration)
    if budget is None:
        raise UnsupportedError("budget: required with calibration (a budget value of the file)")
    key = (id(cal), layer, budget)
    gate = _GATES.get(key)
    if gate is None:
        gate = _GATES[key] = cal.exact_gate(layer, budget)
    return gate


_config = BackendConfig()


def set_config(config: BackendConfig) -> None:
    global _config
    _config = config


def get_config() -> BackendConfig:
    return _config


def _unpad(x: torch.Tensor, valid: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """x [b, s, h, d] and a bool mask [b, s] -> (packed rows, row indices, cu_seqlens, max len)."""
    lengths = valid.sum(dim=1, dtype=torch.int32)
    rows = valid.reshape(-1).nonzero().squeeze(1)
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows), rows, cu, int(lengths.max())


def _chunk_of(module: torch.nn.Module) -> int:
    """The chunk of a chunked-attention layer (transformers' layer_types entry
    "chunked_attention" with config.attention_chunk_size: Llama 4's local layers), else 0."""
    config, layer = getattr(module, "config", None), getattr(module, "layer_idx", None)
    types = getattr(config, "layer_types", None)
    if layer is None or not types or layer >= len(types) or types[layer] != "chunked_attention":
        return 0
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        raise InvalidArgumentError(f"attention_chunk_size: layer {layer} is chunked attention, but the config has none")
    return int(chunk)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      sliding_window: Optional[int] = None, softcap: Optional[float] = None,
                      s_aux: Optional[torch.Tensor] = None, **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """AttentionInterface function: query [b, h_q, s_q, d], key [b, h_kv, s_k, d], value
    [b, h_kv, s_k, d_v] (cache included) -> ([b, s_q, h_q, d_v], None). attention_mask is None or
    a 2D padding mask [b, s_k] (flash_attention_mask semantics). sliding_window, softcap and s_aux
    (sinks [h_q]) as the module passes them."""
    if dropout:
        raise UnsupportedError(f"dropout: sparseprefill is inference-only; expected 0.0, got {dropout}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or int(sliding_window) < 1):
        raise InvalidArgumentError(f"sliding_window: expected None or a number of tokens >= 1, got {sliding_window!r}")
    window = (-1, -1) if sliding_window is None else (int(sliding_window) - 1, int(sliding_window) - 1)
    chunk = _chunk_of(module)
    # The module's sinks are a parameter in the model's dtype; the library takes float32.
    sinks = None if s_aux is None else s_aux.detach().to(device=query.device, dtype=torch.float32)
    features = dict(window_size=window, softcap=softcap or 0.0, sinks=sinks, attention_chunk=chunk)
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else bool(causal)
    layer = getattr(module, "layer_idx", None)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [b, s, h, d] views
    b, s_q = q.shape[0], q.shape[1]
    if chunk and k.shape[1] != s_q:
        # transformers keeps a chunked layer's cache as a sliding window of the chunk's length and
        # passes no positions: the keys' chunks are unknown here, and full attention over them
        # would be silently different.
        raise UnsupportedError(
            f"attention_chunk: layer {layer} is a chunked-attention layer (chunks of {chunk}) called over a KV cache "
            f"({k.shape[1]} keys for {s_q} queries), whose keys' positions the call does not carry; the backend runs "
            "such layers on whole prompts only (a prefill without a cache)")
    policy = _config.policy_for(layer, s_q)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise UnsupportedError(
            f"attention_mask: expected None or a 2D padding mask [b, s_k], got rank {attention_mask.dim()}; "
            "register() installs the matching mask function")
    if attention_mask is None or bool(attention_mask.all()):
        out = flash_attn_func(q, k, v, softmax_scale=scaling, causal=causal, policy=policy, layer=layer, **features)
        return out, None
    valid_k = attention_mask.to(torch.bool)[:, -k.shape[1]:]
    valid_q = valid_k[:, -s_q:]
    q_rows, rows, cu_q, max_q = _unpad(q, valid_q)
    k_rows, _, cu_k, max_k = _unpad(k, valid_k)
    v_rows = v.reshape(-1, *v.shape[2:]).index_select(0, valid_k.reshape(-1).nonzero().squeeze(1))
    packed = flash_attn_varlen_func(q_rows, k_rows, v_rows, cu_q, cu_k, max_q, max_k, softmax_scale=scaling,
                                    causal=causal, policy=policy, layer=layer, **features)
    out = q.new_zeros(b * s_q, *packed.shape[1:])
    out.index_copy_(0, rows, packed)
    return out.reshape(b, s_q, *packed.shape[1:]), None


def register(config: Optional[BackendConfig] = None, name: str = NAME) -> str:
    """Registers the backend (and FlashAttention's 2D padding-mask function) under `name`;
    `config` replaces the current BackendConfig when given. Returns the name for
    from_pretrained(..., attn_implementation=name) or model.set_attn_implementation(name)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    if config is not None:
        set_config(config)
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
