# SPDX-License-Identifier: Apache-2.0
"""FlashAttention-compatible functions over the sparseprefill torch ops (in eager mode their
implementation is called directly, through prepared calls: _fastpath.py): the names, argument
names, layouts, causal alignment (bottom-right) and LSE conventions of flash_attn (FA2
positional order for flash_attn_func / flash_attn_varlen_func, FA3's for
flash_attn_with_kvcache), plus policy= (Dense() by default) and layer= (for statistics).

FP8 as FA3 takes it: torch.float8_e4m3fn q, k, v with optional float32 q_descale, k_descale,
v_descale [batch, h_kv] (attention on q * q_descale[b, h // group], k * k_descale[b, kv head],
v * v_descale[b, kv head]); out is bfloat16. Every policy on the CPU backend; on a compute
capability 9.0 GPU, the Hopper kernels: dense, block_sparse, exact_gate, softmax_skip and
estimate_select (with or without mean correction) at head_dim 128 and 256 (docs/semantics.md §1).

The model-family features as FlashAttention defines them (docs/semantics.md §1): window_size
(left, right) local attention (-1 no bound; (-1, 0) is causal attention), attention_chunk C > 0
(chunked local attention, Llama 4: each query sees only keys of its own chunk of C positions),
softcap, and v with a head dim of its own (out then has it); plus sinks=, gpt-oss's learned
sinks (float32 [h_q] on q's device, one logit per query head in every row's softmax
denominator). The reference and cpu backends run them; the CUDA backend runs window_size and
attention_chunk under dense and block_sparse policies and raises UnsupportedError naming the
feature otherwise, until its kernels take it.

Accepted and ignored (performance knobs): deterministic, num_splits, pack_gqa, sm_margin,
scheduler_metadata. Raised as UnsupportedError naming the argument: dropout_p != 0,
alibi_slopes, qv, rotary_cos/rotary_sin. Forward only."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

import torch

from . import _fastpath, ops  # noqa: F401  (ops registers torch.ops.sparseprefill.*)
from ._core import NO_FEATURES, Features, InvalidArgumentError, check_problem, check_scale, dtype_name, out_dtype
from ._ext import UnsupportedError
from .native import InPlaceMask, features_of, host_index, policy_parts
from .policy import Dense, EstimateSelect, Policy
from .stats import collecting

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "flash_attn_combine",
           "get_scheduler_metadata"]


def _features(causal: bool, window_size: Any, softcap: Any, sinks: Any, attention_chunk: Any) -> Tuple[bool, Features]:
    """(causal, features) by FA's rule: a window (-1, 0) is causal attention (the kernels' causal
    mask, no window); other windows and chunks are local attention, intersected with causal."""
    if window_size is None or (type(window_size) is tuple and window_size == (-1, -1)):
        if not softcap and sinks is None and not attention_chunk:
            return bool(causal), NO_FEATURES
        window_size = (-1, -1)
    features = features_of(window_size, softcap, sinks, attention_chunk)
    if features.window == (-1, 0):
        return True, features._replace(window=(-1, -1))
    return bool(causal), features


def _reject(dropout_p: float = 0.0, alibi_slopes: Any = None, qv: Any = None, rotary_cos: Any = None,
            rotary_sin: Any = None) -> None:
    if dropout_p:
        raise UnsupportedError(f"dropout_p: sparseprefill is inference-only; expected 0.0, got {dropout_p}")
    for name, value in (("alibi_slopes", alibi_slopes), ("qv", qv)):
        if value is not None:
            raise UnsupportedError(f"{name}: not supported; expected None")
    if rotary_cos is not None or rotary_sin is not None:
        raise UnsupportedError("rotary_cos, rotary_sin: rotary embedding is not applied here; rotate q and k before the call")


def _maybe_contiguous(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    # FlashAttention's own wrappers make the last dimension contiguous the same way.
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _call(q, k, v, *, causal: bool, softmax_scale: Optional[float], cu_seqlens_q=None, cu_seqlens_k=None,
          seqused_k=None, block_table=None, descales=(None, None, None), features: Features = NO_FEATURES,
          max_seqlen_q: Optional[int] = None, out=None, policy: Optional[Policy] = None,
          layer: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """One call: (out, lse). descales: (q_descale, k_descale, v_descale); features checked
    (_features). In eager mode the implementation runs here, as a prepared call when the cache
    holds one (_fastpath.py); under tracing, compiling, functorch or autograd the torch op runs
    it."""
    eager = _fastpath.eager(q, k, v)
    index = (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
    sinks = features.sinks
    key = hosts = None
    if eager and not collecting():
        key, hosts = _fastpath.fa_key(policy, causal, softmax_scale, q, k, v, out, descales, index, max_seqlen_q,
                                      features)
        entry = None if key is None else _fastpath.lookup(key)
        if entry is not None:
            if layer is not None and type(layer) is not int:
                int(layer)  # the conversion a full call makes: a bad layer raises alike
            o, lse = _fastpath.run(entry, q, k, v, out, None, descales, sinks)
            if out is not None:
                _fastpath.mark_written(out)
            return o, lse
    policy = Dense() if policy is None else policy
    given = tuple((n, x) for n, x in zip(("q_descale", "k_descale", "v_descale", "sinks"), (*descales, sinks))
                  if x is not None)
    for name, x in (("q", q), ("k", k), ("v", v)) + given:
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    geom = check_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, None, *descales, sinks)
    scale = check_scale(softmax_scale)
    if cu_seqlens_q is None:
        seq_q_max = q.shape[1]
    elif max_seqlen_q is not None:
        seq_q_max = int(max_seqlen_q)
    else:
        cu = cu_seqlens_q.to("cpu", torch.int64) if hosts is None else hosts[0].to(torch.int64)
        seq_q_max = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    thresholds, mask = policy_parts(policy, q, geom, seq_q_max)
    # estimate_select's chunked-prefill tensors (the cache of block means is written in place).
    chunked = policy.chunked() if isinstance(policy, EstimateSelect) else (None, None, None, None)
    for name, x in zip(("prompt_len", "k_block_means", "v_block_means", "block_means_valid"), chunked):
        if x is not None and not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if eager and _fastpath.plain(out, *descales, sinks, thresholds, *chunked):
        settings = policy.settings()
        layer = None if layer is None or int(layer) < 0 else int(layer)
        o = torch.empty(geom.out_shape, dtype=out_dtype(q), device=q.device) if out is None else out
        lse = torch.empty(geom.lse_shape, dtype=torch.float32, device=q.device)
        if hosts is None:
            hosts = tuple(host_index(x) for x in index)
        written = chunked[1:3]
        if any(x is not None for x in chunked):
            chunked = (host_index(chunked[0]), chunked[1], chunked[2], host_index(chunked[3]))
        else:
            chunked = None
        _fastpath.execute(key, _fastpath.identity_of(policy), q, k, v, hosts, descales, bool(causal), scale,
                          features, policy.name, settings, thresholds, mask, chunked, o, lse, layer,
                          _fastpath.watch_of(thresholds))
        # What the op's mutation bookkeeping does for the tensors it writes in place.
        _fastpath.mark_written(out, *written)
        return o, lse
    indptr = indices = None
    mask_block_q = mask_block_k = 0
    per_kv_head = False
    if isinstance(mask, InPlaceMask):
        # The op takes a host CSR mask (its schema has no device mask): read the tensors here.
        heads = geom.h_kv if policy.per_kv_head else geom.h_q
        mask = (*policy.csr(geom.batch, heads, math.ceil(seq_q_max / policy.block_q)), policy.block_q,
                policy.block_k, policy.per_kv_head)
    if mask is not None:
        indptr, indices = torch.from_numpy(mask[0]), torch.from_numpy(mask[1])
        mask_block_q, mask_block_k, per_kv_head = mask[2], mask[3], mask[4]
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, *descales, bool(causal), scale,
            *features.window, features.chunk, features.softcap, sinks, policy.name, policy.settings_string(), thresholds, indptr,
            indices, mask_block_q, mask_block_k, per_kv_head, -1 if layer is None else int(layer), *chunked)
    if out is None:
        return torch.ops.sparseprefill.attention(*args)
    lse = torch.empty(geom.lse_shape, dtype=torch.float32, device=q.device)
    torch.ops.sparseprefill.attention_out(*args, out, lse)
    return out, lse


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False, *, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, attention_chunk=0, num_splits=1, pack_gqa=None, sm_margin=0,
                    return_softmax_lse=False, out=None, policy=None, layer=None, sinks=None):
    """q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v] -> out [b, s_q, h_q, d_v];
    with return_softmax_lse (out, lse [b, h_q, s_q] float32); with return_attn_probs FA2's
    (out, lse, None) (no probabilities are materialised). FP8: float8_e4m3fn q, k, v with
    optional float32 q_descale, k_descale, v_descale [b, h_kv]; out is then bfloat16.
    window_size, softcap and sinks: the module's docstring."""
    _reject(dropout_p, alibi_slopes, qv)
    causal, features = _features(causal, window_size, softcap, sinks, attention_chunk)
    q, k, v = _maybe_contiguous(q), _maybe_contiguous(k), _maybe_contiguous(v)
    o, lse = _call(q, k, v, causal=causal, softmax_scale=softmax_scale, descales=(q_descale, k_descale, v_descale),
                   features=features, out=out, policy=policy, layer=layer)
    if return_attn_probs:
        return o, lse, None
    return (o, lse) if return_softmax_lse else o


def _index(x: Optional[torch.Tensor], name: str) -> Optional[torch.Tensor]:
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise InvalidArgumentError(f"{name}: expected an int32 torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise InvalidArgumentError(f"{name}: expected dtype int32, got {dtype_name(x)}")
    return x


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, seqused_q=None,
                           seqused_k=None, page_table=None, qv=None, q_descale=None, k_descale=None, v_descale=None,
                           attention_chunk=0, num_splits=1, pack_gqa=None, sm_margin=0, scheduler_metadata=None,
                           return_softmax_lse=False, out=None, policy=None, layer=None, sinks=None):
    """q [total_q, h_q, d] with cu_seqlens_q [b + 1]; k, v [total_k, h_kv, d] with cu_seqlens_k,
    or paged [num_pages, page_size, h_kv, d] with block_table (page_table) [b, max_pages] and
    seqused_k (or cu_seqlens_k, whose differences are then the lengths). seqused_q / seqused_k
    limit each sequence to its first entries. Returns out [total_q, h_q, d_v]; with
    return_softmax_lse (out, lse [h_q, total_q]); with return_attn_probs (out, lse, None). FP8,
    window_size, softcap and sinks as flash_attn_func (descales [b, h_kv], b = len(cu_seqlens_q) - 1)."""
    _reject(dropout_p, alibi_slopes, qv)
    causal, features = _features(causal, window_size, softcap, sinks, attention_chunk)
    cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = (
        _index(x, n) for x, n in ((cu_seqlens_q, "cu_seqlens_q"), (cu_seqlens_k, "cu_seqlens_k"),
                                  (seqused_q, "seqused_q"), (seqused_k, "seqused_k")))
    if page_table is not None and block_table is not None and page_table is not block_table:
        raise InvalidArgumentError("page_table: give page_table or block_table, not both")
    table = _index(block_table if block_table is not None else page_table, "block_table")
    if cu_seqlens_q is None:
        raise InvalidArgumentError("cu_seqlens_q: required, expected int32 [batch + 1]")
    if table is not None and cu_seqlens_k is not None:
        # FA2 passes paged lengths as cu_seqlens_k; the library takes them as seqused_k.
        if seqused_k is None:
            seqused_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32)
        cu_seqlens_k = None
    q, k, v = (_maybe_contiguous(x) for x in (q, k, v))
    descales = (q_descale, k_descale, v_descale)
    if seqused_q is not None:
        o, lse = _varlen_seqused_q(q, k, v, cu_seqlens_q, seqused_q, causal=causal, softmax_scale=softmax_scale,
                                   cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=table,
                                   descales=descales, features=features, out=out, policy=policy, layer=layer)
    else:
        o, lse = _call(q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
                       cu_seqlens_k=cu_seqlens_k, seqused_k=seqused_k, block_table=table, descales=descales,
                       features=features, max_seqlen_q=max_seqlen_q, out=out, policy=policy, layer=layer)
    if return_attn_probs:
        return o, lse, None
    return (o, lse) if return_softmax_lse else o


def _varlen_seqused_q(q, k, v, cu_seqlens_q, seqused_q, *, out, **kwargs):
    """seqused_q: sequence b uses the first seqused_q[b] of its rows. The used rows are packed,
    run, and scattered back; unused rows get out = 0 and lse = -inf."""
    cu = cu_seqlens_q.to("cpu", torch.int64)
    used = seqused_q.to("cpu", torch.int64)
    if used.shape != (cu.shape[0] - 1,):
        raise InvalidArgumentError(f"seqused_q: expected int32 [batch] = [{cu.shape[0] - 1}], got {list(used.shape)}")
    lengths = cu[1:] - cu[:-1]
    bad = (used < 0) | (used > lengths)
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise InvalidArgumentError(f"seqused_q[{b}]: expected 0..{int(lengths[b])}, got {int(used[b])}")
    rows = torch.cat([torch.arange(int(cu[b]), int(cu[b] + used[b])) for b in range(used.shape[0])]
                     + [torch.zeros(0, dtype=torch.int64)]).to(q.device)
    packed_cu = torch.cat([torch.zeros(1, dtype=torch.int64), used.cumsum(0)]).to(torch.int32)
    o_packed, lse_packed = _call(q.index_select(0, rows), k, v, cu_seqlens_q=packed_cu,
                                 max_seqlen_q=int(used.max()) if used.numel() else 0, **kwargs)
    o = torch.zeros(q.shape[:-1] + o_packed.shape[-1:], dtype=out_dtype(q), device=q.device) if out is None \
        else out.zero_()
    o.index_copy_(0, rows, o_packed)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    lse.index_copy_(1, rows, lse_packed)
    return o, lse


def _append_kv(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, page_table, cu_seqlens_k_new, batch):
    """Writes the new keys/values of each sequence at positions cache_seqlens[b].. of its
    cache (in place), as FlashAttention does. Returns the new lengths (int64, host)."""
    if (k is None) != (v is None):
        raise InvalidArgumentError("k, v: give both new keys and new values, or neither")
    lengths = cache_seqlens.to("cpu", torch.int64)
    if k is None:
        return lengths
    if k.dim() != v.dim() or k.shape[:-1] != v.shape[:-1] or v.shape[-1] != v_cache.shape[-1]:
        raise InvalidArgumentError(f"v: expected the shape of k {list(k.shape)} with v_cache's head dim "
                                   f"{v_cache.shape[-1]}, got {list(v.shape)}")
    if k.dtype != k_cache.dtype or k.device != k_cache.device:
        raise InvalidArgumentError(f"k: expected k_cache's dtype and device ({dtype_name(k_cache)}, {k_cache.device}), "
                                   f"got ({dtype_name(k)}, {k.device})")
    if cu_seqlens_k_new is not None:
        if k.dim() != 3:
            raise InvalidArgumentError(f"k: expected varlen [total_new, h_kv, d] with cu_seqlens_k_new, got {list(k.shape)}")
        cu = _index(cu_seqlens_k_new, "cu_seqlens_k_new").to("cpu", torch.int64)
        if cu.shape != (batch + 1,):
            raise InvalidArgumentError(f"cu_seqlens_k_new: expected int32 [batch + 1] = [{batch + 1}], got {list(cu.shape)}")
        starts, counts = cu[:-1], cu[1:] - cu[:-1]
        rows_k = k
    else:
        if k.dim() != 4 or k.shape[0] != batch:
            raise InvalidArgumentError(f"k: expected [batch, s_new, h_kv, d] with batch {batch}, got {list(k.shape)}")
        counts = torch.full((batch,), k.shape[1], dtype=torch.int64)
        starts = torch.arange(batch, dtype=torch.int64) * k.shape[1]
        rows_k, v = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
    paged = page_table is not None
    capacity = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    over = lengths + counts > capacity
    if bool(over.any()):
        b = int(over.nonzero()[0])
        raise InvalidArgumentError(f"cache_seqlens[{b}]: {int(lengths[b])} cached + {int(counts[b])} new keys exceed "
                                   f"the cache's {capacity} positions")
    src, seq, pos = [], [], []
    for b in range(batch):
        n = int(counts[b])
        src.append(torch.arange(int(starts[b]), int(starts[b]) + n))
        seq.append(torch.full((n,), b, dtype=torch.int64))
        pos.append(torch.arange(int(lengths[b]), int(lengths[b]) + n))
    src, seq, pos = (torch.cat(x).to(k_cache.device) for x in (src, seq, pos))
    if paged:
        pages = page_table.to(torch.int64)[seq, pos // k_cache.shape[1]]
        slot = (pages, pos % k_cache.shape[1])
    else:
        rows = seq if cache_batch_idx is None else cache_batch_idx.to(torch.int64)[seq]
        slot = (rows, pos)
    k_cache.index_put_(slot, rows_k.index_select(0, src))
    v_cache.index_put_(slot, v.index_select(0, src))
    return lengths + counts


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                            cu_seqlens_q=None, cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                            q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                            window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=0, pack_gqa=None, sm_margin=0,
                            return_softmax_lse=False, *, block_table=None, alibi_slopes=None, out=None, policy=None,
                            layer=None, sinks=None):
    """FA3's cache call (chunked / paged prefill). q [b, s_q, h_q, d], or varlen
    [total_q, h_q, d] with cu_seqlens_q and max_seqlen_q. k_cache, v_cache
    [b_cache, s_cache, h_kv, d], or paged [num_pages, page_size, h_kv, d] with page_table
    (block_table) [b, max_pages]. cache_seqlens (int or int32 [b]) counts the cached keys;
    new k, v (batched, or varlen with cu_seqlens_k_new) are first written into the cache at
    those positions, in place. cache_batch_idx picks cache rows; cache_leftpad makes
    sequence b's keys start at that position. Returns out, or (out, lse) with
    return_softmax_lse (lse [b, h_q, s_q], varlen [h_q, total_q]). FP8: float8_e4m3fn q, caches
    and new k, v, with descales [b, h_kv] indexed by q's batch, as flash_attn_func; window_size,
    softcap and sinks as flash_attn_func (v_cache may have a head dim of its own).

    Chunked prefill with estimate_select: give the policy prompt_len (each prompt's length, so
    the tail is the prompt's) and the cache of block means beside this K/V cache
    (EstimateSelect(k_block_means=, v_block_means=, block_means_valid=): [b, h_kv, max_blocks,
    d] in the cache's dtype on its device, written in place with the blocks each call
    completes); then every chunk makes the one-shot call's decisions and each block's mean is
    computed once (docs/semantics.md §1)."""
    _reject(0.0, alibi_slopes, qv, rotary_cos, rotary_sin)
    causal, features = _features(causal, window_size, softcap, sinks, attention_chunk)
    if page_table is not None and block_table is not None and page_table is not block_table:
        raise InvalidArgumentError("page_table: give page_table or block_table, not both")
    table = _index(page_table if page_table is not None else block_table, "page_table")
    cu_seqlens_q = _index(cu_seqlens_q, "cu_seqlens_q")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(x, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or v_cache.shape[:-1] != k_cache.shape[:-1]:
        raise InvalidArgumentError(f"k_cache, v_cache: expected one shape [b_cache, s_cache, h_kv, d] or "
                                   f"[num_pages, page_size, h_kv, d] (v_cache's head dim may differ), got "
                                   f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise InvalidArgumentError("k_cache, v_cache: the last dimension must be contiguous (stride 1)")
    varlen_q = q.dim() == 3
    if varlen_q and cu_seqlens_q is None:
        raise InvalidArgumentError("cu_seqlens_q: required when q is varlen [total_q, h_q, d]")
    batch = cu_seqlens_q.shape[0] - 1 if varlen_q else q.shape[0]
    paged = table is not None
    if paged and table.shape[0] != batch and cache_batch_idx is None:
        raise InvalidArgumentError(f"page_table: expected [batch, max_pages] with batch {batch}, got {list(table.shape)}")
    if cache_batch_idx is not None:
        cache_batch_idx = _index(cache_batch_idx, "cache_batch_idx")
        if cache_batch_idx.shape != (batch,):
            raise InvalidArgumentError(f"cache_batch_idx: expected int32 [batch] = [{batch}], got {list(cache_batch_idx.shape)}")
        if paged:
            table = table.index_select(0, cache_batch_idx.to(torch.int64))
    elif not paged and k_cache.shape[0] != batch:
        raise InvalidArgumentError(f"k_cache: expected batch {batch} (q's) without cache_batch_idx, got {k_cache.shape[0]}")
    capacity = table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if cache_seqlens is None:
        cache_seqlens = torch.full((batch,), capacity if k is None else 0, dtype=torch.int32)
    elif isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((batch,), cache_seqlens, dtype=torch.int32)
    cache_seqlens = _index(cache_seqlens, "cache_seqlens")
    if cache_seqlens.shape != (batch,):
        raise InvalidArgumentError(f"cache_seqlens: expected int32 [batch] = [{batch}], got {list(cache_seqlens.shape)}")
    lengths = _append_kv(k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, table, cu_seqlens_k_new, batch)
    if bool(((lengths < 0) | (lengths > capacity)).any()):
        b = int(((lengths < 0) | (lengths > capacity)).nonzero()[0])
        raise InvalidArgumentError(f"cache_seqlens[{b}]: expected 0..{capacity}, got {int(lengths[b])}")
    if cache_leftpad is not None:
        left = _index(cache_leftpad, "cache_leftpad").to("cpu", torch.int64)
        if left.shape != (batch,) or bool(((left < 0) | (left > lengths)).any()):
            raise InvalidArgumentError(f"cache_leftpad: expected int32 [batch] = [{batch}] with 0 <= leftpad <= cache length")
    else:
        left = None
    if paged and left is None:
        kk, vv = k_cache, v_cache
        layout = dict(block_table=table, seqused_k=lengths.to(torch.int32))
    else:
        # Rows [batch, s_cache, h_kv, d] of this call (gathered when picked or paged).
        if paged:
            pages = table.to(torch.int64)
            k_rows, v_rows = k_cache[pages].flatten(1, 2), v_cache[pages].flatten(1, 2)
        elif cache_batch_idx is not None:
            pick = cache_batch_idx.to(torch.int64)
            k_rows, v_rows = k_cache.index_select(0, pick), v_cache.index_select(0, pick)
        else:
            k_rows, v_rows = k_cache, v_cache
        if left is None and not varlen_q:
            kk, vv = k_rows, v_rows
            layout = dict(seqused_k=lengths.to(torch.int32))
        else:
            # A varlen view: sequence b's keys are rows b * s_cache + left[b] .. of the flattened
            # cache (varlen queries need varlen or paged keys).
            s_cache = k_rows.shape[1]
            left = torch.zeros(batch, dtype=torch.int64) if left is None else left
            cu_k = torch.cat([torch.arange(batch, dtype=torch.int64) * s_cache + left,
                              torch.tensor([batch * s_cache], dtype=torch.int64)])
            # cu_seqlens_k starts at 0: the view begins at sequence 0's first key.
            base = int(cu_k[0])
            kk = k_rows.reshape(-1, *k_rows.shape[2:])[base:]
            vv = v_rows.reshape(-1, *v_rows.shape[2:])[base:]
            layout = dict(cu_seqlens_k=(cu_k - base).to(torch.int32), seqused_k=(lengths - left).to(torch.int32))
    o, lse = _call(q, kk, vv, causal=causal, softmax_scale=softmax_scale, cu_seqlens_q=cu_seqlens_q,
                   descales=(q_descale, k_descale, v_descale), features=features, max_seqlen_q=max_seqlen_q, out=out,
                   policy=policy, layer=layer, **layout)
    return (o, lse) if return_softmax_lse else o


def flash_attn_combine(out_partial: torch.Tensor, lse_partial: torch.Tensor, out: Optional[torch.Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges split results by their LSEs: out_partial [splits, ..., d], lse_partial
    [splits, ...] -> (out [..., d], lse [...]). Splits with lse = -inf contribute nothing."""
    lse = torch.logsumexp(lse_partial.float(), dim=0)
    weight = torch.exp(lse_partial.float() - lse)
    weight = torch.where(torch.isfinite(weight), weight, torch.zeros_like(weight))
    merged = (weight.unsqueeze(-1) * out_partial.float()).sum(0)
    merged = merged.to(out_dtype or out_partial.dtype)
    if out is not None:
        out.copy_(merged)
        merged = out
    return merged, lse


def get_scheduler_metadata(*args: Any, **kwargs: Any) -> None:
    """Accepted for FA3 compatibility; the library plans its own work, so there is none."""
    return None
