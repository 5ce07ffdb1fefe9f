# SPDX-License-Identifier: Apache-2.0
"""How one vLLM step's batch is split between FLASH_ATTN and our policy (pure: NumPy only).

vLLM hands every attention layer one varlen batch: request r has the queries
[query_start_loc[r], query_start_loc[r + 1]) of the step's token rows and seq_lens[r] keys in
the paged cache (its context - prefix-cache hit or earlier chunks - plus its new tokens). Its
queries are the last ones of its keys: bottom-right causal, with context = seq_len - query_len.

A request is *sparse* (our policy, one paged call per run of such requests) when it is not a
decode (query_len > decode_threshold) and has at least min_sparse_len keys; every other one is
*dense* (FLASH_ATTN through vLLM's own metadata). Requests with no query (padding) join their
neighbour's run and are never computed. Runs are maximal stretches of consecutive requests of
one kind, so any batch order is served; vLLM's model runner sorts decodes first, then by query
length, which gives one dense and one sparse run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

__all__ = ["DenseRun", "SparseRun", "BatchSplit", "split_batch", "synthetic_mask", "flex_lists"]


@dataclass(frozen=True)
class DenseRun:
    """Requests [rows[0], rows[1]) on token rows [tokens[0], tokens[1]): FLASH_ATTN's batch."""

    rows: Tuple[int, int]
    tokens: Tuple[int, int]


@dataclass(frozen=True, eq=False)
class SparseRun:
    """One paged call of our policy over token rows [tokens[0], tokens[1]). rows: the requests,
    int64 [n] (those with queries); cu_seqlens_q: int32 [n + 1], relative to tokens[0];
    seqused_k: int32 [n], each request's keys (context + queries)."""

    tokens: Tuple[int, int]
    rows: np.ndarray
    cu_seqlens_q: np.ndarray
    seqused_k: np.ndarray
    max_seqlen_q: int

    @property
    def query_lens(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_q)

    @property
    def context_lens(self) -> np.ndarray:
        """Keys before each request's first query (chunked prefill, prefix-cache hits)."""
        return self.seqused_k - self.query_lens


@dataclass(frozen=True)
class BatchSplit:
    dense: Tuple[DenseRun, ...]
    sparse: Tuple[SparseRun, ...]

    @property
    def all_dense(self) -> bool:
        """No request runs our policy: the step is FLASH_ATTN's alone (its CUDA graphs too)."""
        return not self.sparse


def _host(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: expected a 1-D integer array, got {arr.dtype} {list(arr.shape)}")
    return arr.astype(np.int64)


def split_batch(query_start_loc: Any, seq_lens: Any, min_sparse_len: int, decode_threshold: int = 1) -> BatchSplit:
    """query_start_loc: int [num_reqs + 1] (host), seq_lens: int [>= num_reqs] (host; entries past
    num_reqs are ignored) -> the runs. Raises ValueError for metadata that is not a batch
    (decreasing starts, fewer keys than queries)."""
    qsl = _host(query_start_loc, "query_start_loc")
    n = qsl.shape[0] - 1
    if n < 0:
        raise ValueError("query_start_loc: expected num_reqs + 1 entries, got none")
    lens = _host(seq_lens, "seq_lens")
    if lens.shape[0] < n:
        raise ValueError(f"seq_lens: expected at least {n} entries (num_reqs), got {lens.shape[0]}")
    lens = lens[:n]
    q_lens = np.diff(qsl)
    if n and (qsl[0] < 0 or (q_lens < 0).any()):
        raise ValueError(f"query_start_loc: expected non-decreasing starts from >= 0, got {qsl.tolist()}")
    short = lens < q_lens
    if short.any():
        r = int(np.flatnonzero(short)[0])
        raise ValueError(f"seq_lens[{r}]: {int(lens[r])} keys for {int(q_lens[r])} queries (keys include the queries)")

    sparse = (q_lens > decode_threshold) & (lens >= min_sparse_len)
    # Requests with no query take their left neighbour's kind (the first ones their right's), so
    # padding never splits a run.
    empty = q_lens == 0
    real = np.flatnonzero(~empty)
    kind = sparse
    if real.size:
        previous = np.maximum.accumulate(np.where(empty, -1, np.arange(n)))  # last real request <= r
        kind = np.where(previous >= 0, sparse[np.maximum(previous, 0)], sparse[real[0]])

    dense_runs, sparse_runs = [], []
    start = 0
    for r in range(1, n + 1):
        if r < n and kind[r] == kind[start]:
            continue
        tokens = (int(qsl[start]), int(qsl[r]))
        if kind[start]:
            rows = np.arange(start, r)[~empty[start:r]]
            cu = np.concatenate([[0], np.cumsum(q_lens[rows])]).astype(np.int32)
            sparse_runs.append(SparseRun(tokens, rows, cu, lens[rows].astype(np.int32), int(q_lens[rows].max())))
        elif tokens[1] > tokens[0]:
            dense_runs.append(DenseRun((start, r), tokens))
        start = r
    return BatchSplit(tuple(dense_runs), tuple(sparse_runs))


def synthetic_mask(query_lens: Any, key_lens: Any, block: int, density: float) -> np.ndarray:
    """The benchmark setting's block mask, bool [batch, 1, num_q_blocks, num_k_blocks] (one row
    for every head) over blocks of `block` queries and keys, bottom-right causal: each query
    block of sequence b keeps k = max(1, round(density * v)) of its v causally visible key
    blocks - the last (diagonal) one and k - 1 spread evenly over the others from block 0 - so
    work per query block is `density` of dense up to rounding, whatever the data. Query blocks
    past a sequence's queries keep nothing."""
    q = _host(query_lens, "query_lens")
    k = _host(key_lens, "key_lens")
    if q.shape != k.shape or (k < q).any() or (q < 0).any():
        raise ValueError(f"query_lens, key_lens: expected equal lengths with 0 <= query_len <= key_len, got "
                         f"{q.tolist()} and {k.tolist()}")
    if block < 1 or not 0.0 < density <= 1.0:
        raise ValueError(f"block {block}, density {density}: expected block >= 1 and density in (0, 1]")
    nqb = max(1, math.ceil(int(q.max(initial=0)) / block))
    nkb = max(1, math.ceil(int(k.max(initial=0)) / block))
    mask = np.zeros((q.shape[0], 1, nqb, nkb), dtype=bool)
    for b in range(q.shape[0]):
        for qb in range(math.ceil(int(q[b]) / block)):
            last_row = min((qb + 1) * block, int(q[b])) - 1
            visible = (last_row + int(k[b] - q[b])) // block + 1  # key blocks 0 .. diagonal
            keep = max(1, int(round(density * visible)))
            # The diagonal, then keep - 1 of blocks 0 .. visible - 2 at even spacing (distinct,
            # since keep - 1 <= visible - 1).
            others = np.floor(np.arange(keep - 1) * ((visible - 1) / max(keep - 1, 1))).astype(np.int64)
            mask[b, 0, qb, others] = True
            mask[b, 0, qb, visible - 1] = True
    return mask


def flex_lists(mask: Any) -> Tuple[np.ndarray, np.ndarray]:
    """A bool block map [B, H, Q, K] in FlexAttention's list form, which the library reads in
    place on the device (no host planning of the mask): (kv_num_blocks int32 [B, H, Q], each
    row's count of True; kv_indices int32 [B, H, Q, W], a row's key blocks ascending in its
    first count entries and 0 after them), W = max(1, the largest count)."""
    m = np.asarray(mask)
    if m.dtype != np.bool_ or m.ndim != 4:
        raise ValueError(f"mask: expected a bool block map [B, H, Q, K], got {m.dtype} of shape {m.shape}")
    counts = m.sum(axis=-1, dtype=np.int32)
    width = max(1, int(counts.max(initial=0)))
    # A stable sort of "not selected" puts a row's selected blocks first, in ascending order.
    order = np.argsort(~m, axis=-1, kind="stable")[..., :width].astype(np.int32)
    indices = np.where(np.arange(width, dtype=np.int32) < counts[..., None], order, np.int32(0))
    return counts, np.ascontiguousarray(indices, dtype=np.int32)
