# SPDX-License-Identifier: Apache-2.0
"""The torch.library operators: sparseprefill::attention (allocates out and lse) and
sparseprefill::attention_out (writes caller buffers), each with a fake implementation, so
they trace under torch.compile and run on the current CUDA stream.

FP8 inputs (torch.float8_e4m3fn q, k, v) take optional float32 descales [b, h_kv] (q_descale,
k_descale, v_descale, beside the index tensors) and give a bfloat16 out, in the fake
implementations too. The model-family features follow softmax_scale: window_left and
window_right (FlashAttention's window_size, -1 no bound), attention_chunk (0: none), softcap (0:
none) and optional sinks
(float32 [h_q]); v may have a head dim d_v of its own, which out then has (docs/semantics.md §1).

A policy travels as plain operator arguments: its name, its settings ("key=value;..."), an
optional threshold table (on q's device), an optional block mask as host CSR tensors, and
estimate_select's optional chunked-prefill tensors (prompt_len, the cache of block means, which
the op writes in place, and its valid counts).

CUDA graphs: on this side a batched call whose policy needs no host data (dense,
softmax_skip, estimate_select, permute_stop, exact_gate with its table already on the device)
does nothing a capture forbids. Index tensors (cu_seqlens_*, seqused_k, block_table) are read
by the library on the host: CUDA ones are copied to the host first, a synchronising copy that
capture forbids, so varlen and paged calls can never be captured. The CUDA backend keeps each
call's small metadata on the device keyed by content: a captured call must follow one warm-up
call of the same shapes and tensors outside capture, or it raises UnsupportedError before any
CUDA work (native.execute reads no statistics under capture). A call whose prepared call exists
(_fastpath.py: planned on its second uncaptured call) runs that plan instead, pinned from then
on (docs/python.md, "Prepared calls")."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch.library import custom_op

from . import _fastpath, native
from ._core import Features, Geometry, check_chunk, check_problem, check_softcap, check_window, out_dtype
from .stats import collecting

__all__ = ["attention", "attention_out"]


def _decode(settings: str) -> List[Tuple[str, str]]:
    pairs = []
    for item in settings.split(";"):
        if item:
            key, _, value = item.partition("=")
            pairs.append((key, value))
    return pairs


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
             cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
             block_table: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
             k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], causal: bool, softmax_scale: float,
             window_left: int, window_right: int, attention_chunk: int, softcap: float, sinks: Optional[torch.Tensor], policy: str,
             settings: str, thresholds: Optional[torch.Tensor], mask_indptr: Optional[torch.Tensor],
             mask_indices: Optional[torch.Tensor], mask_block_q: int, mask_block_k: int, mask_per_kv_head: bool,
             layer: int, prompt_len: Optional[torch.Tensor], k_block_means: Optional[torch.Tensor],
             v_block_means: Optional[torch.Tensor], block_means_valid: Optional[torch.Tensor],
             out: Optional[torch.Tensor], lse: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Runs the op into out and lse (both None: allocated, as attention returns them). A call
    without a block mask or chunked-prefill tensors (contents its key does not hold) runs as a
    prepared call when the cache holds one (_fastpath.py)."""
    descales = (q_descale, k_descale, v_descale)
    index = (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    features = Features((window_left, window_right), softcap, sinks, attention_chunk)
    key = hosts = None
    if (mask_indptr is None and mask_indices is None and prompt_len is None and k_block_means is None
            and v_block_means is None and block_means_valid is None and not collecting()):
        key, hosts = _fastpath.op_key(policy, settings, causal, softmax_scale, thresholds, q, k, v, out, lse, descales,
                                      index, features)
        entry = None if key is None else _fastpath.lookup(key)
        if entry is not None:
            return _fastpath.run(entry, q, k, v, out, lse, descales, sinks)
    geom = _check(q, k, v, *index, out, lse, *descales, window_left, window_right, attention_chunk, softcap, sinks)
    if out is None:
        out, lse = _new_outputs(q, geom)
    if hosts is None:
        hosts = tuple(native.host_index(x) for x in index)
    mask = None
    if mask_indptr is not None:
        mask = (native.host_index(mask_indptr), native.host_index(mask_indices), mask_block_q,
                mask_block_k, mask_per_kv_head)
    chunked = None
    if any(x is not None for x in (prompt_len, k_block_means, v_block_means, block_means_valid)):
        chunked = (native.host_index(prompt_len), k_block_means, v_block_means, native.host_index(block_means_valid))
    _fastpath.execute(key, thresholds, q, k, v, hosts, descales, causal, softmax_scale, features, policy,
                      _decode(settings), thresholds, mask, chunked, out, lse, layer if layer >= 0 else None, ())
    return out, lse


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, lse, q_descale, k_descale, v_descale,
           window_left, window_right, attention_chunk, softcap, sinks):
    """The checks of the op and its fakes: the problem's, the window's, the chunks' and the
    softcap's."""
    check_window((window_left, window_right))
    check_chunk(attention_chunk)
    check_softcap(softcap)
    return check_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, lse, q_descale, k_descale,
                         v_descale, sinks)


def _new_outputs(q: torch.Tensor, geom: Geometry) -> Tuple[torch.Tensor, torch.Tensor]:
    """attention's (out, lse), allocated alike by the op and its fake."""
    return q.new_empty(geom.out_shape, dtype=out_dtype(q)), q.new_empty(geom.lse_shape, dtype=torch.float32)


# No argument has a default: the boxed call drops trailing arguments equal to their defaults,
# and the in-place bookkeeping of mutated arguments then indexes past the end (torch 2.11:
# IndexError in custom_ops.adinplaceorview_impl, seen on the GPU machine).
@custom_op("sparseprefill::attention", mutates_args=("k_block_means", "v_block_means"))
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
              cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
              block_table: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
              k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], causal: bool,
              softmax_scale: float, window_left: int, window_right: int, attention_chunk: int, softcap: float,
              sinks: Optional[torch.Tensor], policy: str, settings: str, thresholds: Optional[torch.Tensor],
              mask_indptr: Optional[torch.Tensor], mask_indices: Optional[torch.Tensor], mask_block_q: int,
              mask_block_k: int, mask_per_kv_head: bool, layer: int, prompt_len: Optional[torch.Tensor],
              k_block_means: Optional[torch.Tensor], v_block_means: Optional[torch.Tensor],
              block_means_valid: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns (out [q's shape with v's head dim, q's dtype; bfloat16 for FP8 inputs], lse
    float32 [b, h_q, s_q] or varlen [h_q, total_q]). softmax_scale 0 means 1/sqrt(d); layer < 0
    means none (for statistics)."""
    return _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, q_descale, k_descale, v_descale,
                    causal, softmax_scale, window_left, window_right, attention_chunk, softcap, sinks, policy, settings, thresholds,
                    mask_indptr, mask_indices, mask_block_q, mask_block_k, mask_per_kv_head, layer, prompt_len,
                    k_block_means, v_block_means, block_means_valid, None, None)


@attention.register_fake
def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, q_descale, k_descale, v_descale,
                    causal, softmax_scale, window_left, window_right, attention_chunk, softcap, sinks, policy, settings, thresholds,
                    mask_indptr, mask_indices, mask_block_q, mask_block_k, mask_per_kv_head, layer, prompt_len,
                    k_block_means, v_block_means, block_means_valid):
    geom = _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, None, None, q_descale, k_descale,
                  v_descale, window_left, window_right, attention_chunk, softcap, sinks)
    return _new_outputs(q, geom)


@custom_op("sparseprefill::attention_out", mutates_args=("out", "lse", "k_block_means", "v_block_means"))
def attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Optional[torch.Tensor],
                  cu_seqlens_k: Optional[torch.Tensor], seqused_k: Optional[torch.Tensor],
                  block_table: Optional[torch.Tensor], q_descale: Optional[torch.Tensor],
                  k_descale: Optional[torch.Tensor], v_descale: Optional[torch.Tensor], causal: bool,
                  softmax_scale: float, window_left: int, window_right: int, attention_chunk: int, softcap: float,
                  sinks: Optional[torch.Tensor], policy: str, settings: str, thresholds: Optional[torch.Tensor],
                  mask_indptr: Optional[torch.Tensor], mask_indices: Optional[torch.Tensor], mask_block_q: int,
                  mask_block_k: int, mask_per_kv_head: bool, layer: int, prompt_len: Optional[torch.Tensor],
                  k_block_means: Optional[torch.Tensor], v_block_means: Optional[torch.Tensor],
                  block_means_valid: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor) -> None:
    """As attention, writing the caller's out and lse."""
    _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, q_descale, k_descale, v_descale, causal,
             softmax_scale, window_left, window_right, attention_chunk, softcap, sinks, policy, settings, thresholds, mask_indptr,
             mask_indices, mask_block_q, mask_block_k, mask_per_kv_head, layer, prompt_len, k_block_means,
             v_block_means, block_means_valid, out, lse)


@attention_out.register_fake
def _attention_out_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, q_descale, k_descale,
                        v_descale, causal, softmax_scale, window_left, window_right, attention_chunk, softcap, sinks, policy, settings,
                        thresholds, mask_indptr, mask_indices, mask_block_q, mask_block_k, mask_per_kv_head, layer,
                        prompt_len, k_block_means, v_block_means, block_means_valid, out, lse):
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, lse, q_descale, k_descale, v_descale,
           window_left, window_right, attention_chunk, softcap, sinks)
