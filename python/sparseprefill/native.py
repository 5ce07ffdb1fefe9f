# SPDX-License-Identifier: Apache-2.0
"""The native call: run(q, k, v, policy) -> (out, lse, stats) on NumPy arrays (CPU backend)
or torch tensors (CPU or CUDA, on the current stream), plus the pieces the torch ops and the
FlashAttention-style functions share: host copies of index tensors, policy handles."""

from __future__ import annotations

import contextlib
import math
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _ext, stats as _stats
from ._core import Geometry, InvalidArgumentError, backend_code, check_problem, check_scale, descriptor, is_torch
from ._ext import UnsupportedError
from .policy import BlockSparse, Dense, ExactGate, Policy

__all__ = ["Result", "run", "can_run", "build_info"]


class Result(NamedTuple):
    out: Any
    lse: Any
    stats: Optional[_stats.CallStats]


def build_info() -> str:
    """Version, compiled backends, CUDA architectures and kernel variants, one per line."""
    return _ext.build_info()


def host_index(x: Any) -> Any:
    """An int32 index tensor as a contiguous host array of its framework. A CUDA tensor is
    copied with a synchronising device-to-host copy (this is what keeps varlen and paged
    calls out of CUDA graphs: the library reads these on the host)."""
    if x is None:
        return None
    if is_torch(x):
        return x.detach().to("cpu").contiguous()
    return np.ascontiguousarray(x)


def _ptr(x: Any) -> int:
    return x.data_ptr() if is_torch(x) else x.__array_interface__["data"][0]


def _values(x: Any) -> np.ndarray:
    return x.numpy() if is_torch(x) else np.asarray(x)


def max_seq_q(q: Any, cu_seqlens_q_host: Any) -> int:
    if cu_seqlens_q_host is None:
        return int(q.shape[1])
    cu = _values(cu_seqlens_q_host).astype(np.int64)
    return int(np.max(cu[1:] - cu[:-1])) if cu.shape[0] > 1 else 0


def problem_tuple(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, seqused_k: Any, block_table: Any,
                  causal: bool, scale: float) -> tuple:
    return (descriptor(q, "q"), descriptor(k, "k"), descriptor(v, "v"),
            descriptor(cu_q, "cu_seqlens_q"), descriptor(cu_k, "cu_seqlens_k"),
            descriptor(seqused_k, "seqused_k"), descriptor(block_table, "block_table"),
            bool(causal), float(scale))


def make_handle(name: str, settings: list, problem: tuple, thresholds: Any = None,
                mask: Optional[Tuple[Any, Any, int, int, bool]] = None) -> "_ext.PolicyHandle":
    """A library policy handle with its threshold table and block mask attached. `mask` is
    (indptr, indices, block_q, block_k, per_kv_head) as host int32 arrays or tensors."""
    handle = _ext.PolicyHandle(name, settings)
    if thresholds is not None:
        handle.set_thresholds(descriptor(thresholds, "thresholds"), thresholds)
    if mask is not None:
        indptr, indices, block_q, block_k, per_kv_head = mask
        handle.set_block_mask(problem, int(block_q), int(block_k), bool(per_kv_head),
                              int(indptr.shape[0]) - 1, _ptr(indptr), int(indices.shape[0]), _ptr(indices))
    return handle


def policy_parts(policy: Policy, q: Any, geom: Geometry, seq_q_max: int) -> Tuple[Any, Any]:
    """(thresholds, mask) a policy attaches: thresholds on q's device for exact_gate, a host
    CSR mask for block_sparse, else None."""
    if not isinstance(policy, Policy):
        raise InvalidArgumentError(
            f"policy: expected a sparseprefill policy (Dense(), ExactGate(...), ...), got {type(policy).__name__}")
    thresholds = policy.thresholds_like(q, geom.h_q) if isinstance(policy, ExactGate) else None
    mask = None
    if isinstance(policy, BlockSparse):
        if policy.block_q <= 0 or policy.block_k <= 0:
            raise InvalidArgumentError(
                f"block_q, block_k: expected positive block sizes, got {policy.block_q} and {policy.block_k}")
        heads = geom.h_kv if policy.per_kv_head else geom.h_q
        num_q_blocks = math.ceil(seq_q_max / policy.block_q)
        indptr, indices = policy.csr(geom.batch, heads, num_q_blocks)
        mask = (indptr, indices, policy.block_q, policy.block_k, policy.per_kv_head)
    return thresholds, mask


@contextlib.contextmanager
def device_guard(q: Any):
    """Makes q's CUDA device current and yields the current stream's handle (0 on the CPU)."""
    if is_torch(q) and q.device.type == "cuda":
        import torch

        with torch.cuda.device(q.device):
            yield torch.cuda.current_stream(q.device).cuda_stream
    else:
        yield 0


def capturing(q: Any) -> bool:
    if is_torch(q) and q.device.type == "cuda":
        import torch

        return torch.cuda.is_current_stream_capturing()
    return False


def execute(problem: tuple, handle: "_ext.PolicyHandle", q: Any, out: Any, lse: Any, backend: int,
            num_threads: int, want_stats: bool, layer: Optional[int]) -> Optional[_stats.CallStats]:
    """One sp_run on q's device and current stream; records stats into open collectors. Under
    CUDA graph capture no statistics are read back (that would need a host synchronisation):
    the call returns None and collectors record nothing. A captured call needs an earlier,
    uncaptured call of the same shapes and tensors (its metadata is then cached on the device);
    otherwise the library raises UnsupportedError."""
    capture = capturing(q)
    record = _stats.collecting() and not capture
    with device_guard(q) as stream:
        raw = _ext.run(problem, handle, descriptor(out, "out"), descriptor(lse, "lse"), backend,
                       num_threads, stream, (want_stats or record) and not capture)
    if raw is None:
        return None
    call = _stats.CallStats.from_ext(raw, layer, handle.describe())
    if record:
        _stats.record(call)
    return call if want_stats else None


def _empty(like: Any, shape: Tuple[int, ...], float32: bool) -> Any:
    if is_torch(like):
        import torch

        return torch.empty(shape, dtype=torch.float32 if float32 else like.dtype, device=like.device)
    return np.empty(shape, dtype=np.float32 if float32 else like.dtype)


def run(q: Any, k: Any, v: Any, policy: Optional[Policy] = None, *, causal: bool = True,
        softmax_scale: Optional[float] = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
        seqused_k: Any = None, block_table: Any = None, out: Any = None, lse: Any = None,
        backend: str = "auto", num_threads: int = 0, stats: bool = True,
        layer: Optional[int] = None) -> Result:
    """Attention under `policy` (Dense() by default) in FlashAttention's layouts:
    batched q [b, s_q, h_q, d] with k, v [b, s_k, h_kv, d]; varlen q [total_q, h_q, d] with
    cu_seqlens_q, and k, v [total_k, h_kv, d] with cu_seqlens_k or paged
    [num_pages, page_size, h_kv, d] with block_table and seqused_k. Causal is bottom-right
    aligned. Returns (out, lse, stats): out in q's layout and dtype, lse float32 [b, h_q, s_q]
    (varlen: [h_q, total_q]), stats a CallStats (None with stats=False). backend is "auto",
    "reference" (the fp64 oracle), "cpu" or "cuda"."""
    policy = Dense() if policy is None else policy
    geom = check_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, lse)
    scale = check_scale(softmax_scale)
    code = backend_code(backend)
    if int(num_threads) < 0:
        raise InvalidArgumentError(f"num_threads: expected >= 0 (0 = every core), got {num_threads}")
    cu_q, cu_k, used, table = (host_index(x) for x in (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table))
    out = _empty(q, tuple(q.shape), False) if out is None else out
    lse = _empty(q, geom.lse_shape, True) if lse is None else lse
    problem = problem_tuple(q, k, v, cu_q, cu_k, used, table, causal, scale)
    thresholds, mask = policy_parts(policy, q, geom, max_seq_q(q, cu_q))
    handle = make_handle(policy.name, policy.settings(), problem, thresholds, mask)
    call = execute(problem, handle, q, out, lse, code, int(num_threads), stats, layer)
    return Result(out, lse, call)


def can_run(q: Any, k: Any, v: Any, policy: Optional[Policy] = None, *, causal: bool = True,
            backend: str = "auto", **layout: Any) -> Tuple[bool, str]:
    """(True, "") when `backend` runs this call; otherwise (False, what is compiled)."""
    policy = Dense() if policy is None else policy
    names = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table")
    unknown = set(layout) - set(names) - {"softmax_scale"}
    if unknown:
        raise InvalidArgumentError(f"{sorted(unknown)[0]}: unexpected argument")
    geom = check_problem(q, k, v, *(layout.get(n) for n in names))
    host = [host_index(layout.get(n)) for n in names]
    problem = problem_tuple(q, k, v, *host, causal, check_scale(layout.get("softmax_scale")))
    thresholds, mask = policy_parts(policy, q, geom, max_seq_q(q, host[0]))
    handle = make_handle(policy.name, policy.settings(), problem, thresholds, mask)
    code, message = _ext.can_run(problem, handle, backend_code(backend))
    return code == 0, message
