# SPDX-License-Identifier: Apache-2.0
"""The eager fast path of the torch front ends (docs/python.md, "Prepared calls").

In eager mode the FlashAttention-style functions (and the transformers backend over them) run
the implementation directly instead of dispatching the torch.library op, whose Python dispatch
costs more than the rest of a call; tracing, compiling, functorch transforms, dispatch modes,
tensor subclasses and autograd see the op as before (eager() says which). Calls then go through
the prepared-call cache (_call_cache.py): a key holds everything the checks read, and a hit
runs a library plan bound to the validated call's descriptors with only the data pointers
patched (_ext.PlanCall.run_ptrs). The ops' implementation uses the same cache (its own keys),
and run(plan, ...) the same kind of entry, kept by its plan. Keys are made conservatively: anything whose effect a key cannot capture (a block
mask or chunked-prefill tensors given to the op, statistics collection) bypasses the cache,
and an input the checks would reject never forms a key."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from . import _ext, native
from ._call_cache import CACHE
from ._core import Features, descriptor
from .policy import Dense, Policy

_Tensor = torch.Tensor
_FP32 = torch.float32
_empty = torch.empty
_grad_enabled = torch.is_grad_enabled
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_functorch_transform = torch._C._functorch.peek_interpreter_stack
_jit_tracing = torch._C._get_tracing_state
_increment_version = torch._C._increment_version
# CUDA builds only; used for CUDA tensors alone. The raw stream handle and the current ordinal
# without building torch.cuda.Stream or torch.device objects.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)

# Distinguish the keys of each front end: their calls differ in what is allocated and checked.
_FA, _OP, _PLAN = "flash_attn", "op", "plan"
_DENSE_KEY = Dense().call_key()


def eager(q: Any, k: Any, v: Any) -> bool:
    """Whether a call may bypass the torch op: plain CPU or CUDA tensors, no torch.compile or
    export, no FX, jit or functorch tracing, no dispatch or torch-function mode, and no input
    that autograd tracks (the op records a backward that raises when used)."""
    if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
        return False
    if _compiling() or _dispatch_modes() or _function_modes() or _functorch_transform() is not None:
        return False
    if _jit_tracing() is not None or not (q.is_cuda or q.is_cpu):
        return False
    return not (_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def plain(*tensors: Any) -> bool:
    """Each of `tensors` is None or a plain tensor that autograd does not track."""
    grad = _grad_enabled()
    for x in tensors:
        if x is not None and (type(x) is not _Tensor or (grad and x.requires_grad)):
            return False
    return True


def policy_key(policy: Optional[Policy]) -> Any:
    if policy is None or type(policy) is Dense:
        return _DENSE_KEY
    return policy.call_key() if isinstance(policy, Policy) else None


def identity_of(policy: Policy) -> Optional[Policy]:
    """The policy when keys name it by identity (CallCache.admit's owner), else None."""
    return policy if type(policy) is not Dense and policy.call_key() is policy else None


def _sig(x: Any) -> Optional[tuple]:
    return None if x is None else (x.shape, x.stride(), x.dtype, x.device)


def _index_key(index: tuple) -> Tuple[Optional[tuple], Optional[tuple]]:
    """(host copies, key part) of the index tensors (cu_seqlens_q, cu_seqlens_k, seqused_k,
    block_table): the library reads their contents, so the key holds them (a CUDA tensor is
    copied to the host, as a full call does)."""
    if index[0] is None and index[1] is None and index[2] is None and index[3] is None:
        return None, None
    hosts = []
    parts = []
    for x in index:
        if x is None:
            hosts.append(None)
            parts.append(None)
            continue
        if type(x) is not _Tensor:
            raise TypeError("not a plain tensor")
        host = native.host_index(x)
        hosts.append(host)
        parts.append((x.dtype, x.device, x.shape, host.numpy().tobytes()))
    return tuple(hosts), tuple(parts)


def _descales_key(descales: tuple) -> Optional[tuple]:
    if descales[0] is None and descales[1] is None and descales[2] is None:
        return None
    if not plain(*descales):
        raise TypeError("not a plain tensor")
    return _sig(descales[0]), _sig(descales[1]), _sig(descales[2])


def _features_key(features: Features) -> tuple:
    if not plain(features.sinks):
        raise TypeError("not a plain tensor")
    return features.signature()


def fa_key(policy: Optional[Policy], causal: bool, softmax_scale: Any, q: Any, k: Any, v: Any, out: Any,
           descales: tuple, index: tuple, max_seqlen_q: Any, features: Features) -> Tuple[Any, Optional[tuple]]:
    """(key, host copies of the index tensors) of a FlashAttention-style call (see _call in
    flash_attn_interface.py), or (None, None) when it is not cached. max_seqlen_q counts
    with varlen q (it sizes a block mask)."""
    try:
        pk = policy_key(policy)
        if pk is None or (out is not None and not plain(out)):
            return None, None
        hosts, idx = _index_key(index)
        return (_FA, pk, causal, softmax_scale, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype,
                k.device, v.shape, v.stride(), v.dtype, v.device, None if out is None else _sig(out),
                _descales_key(descales), idx, None if index[0] is None else max_seqlen_q,
                _features_key(features)), hosts
    except Exception:  # an input the checks reject: the full call raises their error
        return None, None


def op_key(policy: str, settings: str, causal: bool, softmax_scale: float, thresholds: Any, q: Any, k: Any, v: Any,
           out: Any, lse: Any, descales: tuple, index: tuple, features: Features) -> Tuple[Any, Optional[tuple]]:
    """(key, host copies) of a call of the torch ops' implementation (ops.py) without a block
    mask or chunked-prefill tensors. The plan views the threshold table: its address counts."""
    try:
        if not (type(q) is _Tensor and type(k) is _Tensor and type(v) is _Tensor and plain(out, lse, thresholds)):
            return None, None
        table = None if thresholds is None else (_sig(thresholds), thresholds.data_ptr())
        hosts, idx = _index_key(index)
        return (_OP, policy, settings, causal, softmax_scale, table, q.shape, q.stride(), q.dtype, q.device, k.shape,
                k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device, _sig(out), _sig(lse),
                _descales_key(descales), idx, _features_key(features)), hosts
    except Exception:
        return None, None


class Entry:
    """A prepared call: the plan bound to one validated call (call), what a hit allocates (out
    and lse shapes and dtype, on device), q's CUDA ordinal (-1 on the CPU), whether descales
    or sinks are bound (their pointers are patched per call), and the threshold tables whose
    identity and layout the call was checked with (watch: (tensor, data_ptr, shape, stride,
    dtype, device))."""

    __slots__ = ("call", "out_shape", "out_dtype", "lse_shape", "device", "cuda", "descales", "sinks", "watch",
                 "pinned")

    def __init__(self, call: "_ext.PlanCall", q: Any, out: Any, lse: Any, descales: tuple, sinks: Any,
                 watch: tuple) -> None:
        self.call = call
        self.out_shape = out.shape
        self.out_dtype = out.dtype
        self.lse_shape = lse.shape
        self.device = q.device
        self.cuda = q.device.index if q.is_cuda else -1
        self.descales = any(x is not None for x in descales)
        self.sinks = sinks is not None
        self.watch = watch
        self.pinned = False


def watch_of(thresholds: Any) -> tuple:
    if thresholds is None:
        return ()
    return ((thresholds, thresholds.data_ptr(), thresholds.shape, thresholds.stride(), thresholds.dtype,
             thresholds.device),)


def lookup(key: Any) -> Optional[Entry]:
    """The entry of `key` when it still describes the call: a threshold table replaced or
    resized since (ExactGate(thresholds=t) with t changed in place) drops the entry, and one that
    autograd now tracks sends the call through the op."""
    entry = CACHE.get(key)
    if entry is None or not entry.watch:
        return entry
    grad = _grad_enabled()
    for t, ptr, shape, stride, dtype, device in entry.watch:
        if t.data_ptr() != ptr or t.shape != shape or t.stride() != stride or t.dtype != dtype or t.device != device:
            CACHE.drop(key)
            return None
        if grad and t.requires_grad:
            return None
    return entry


def run(entry: Entry, q: Any, k: Any, v: Any, out: Any, lse: Any, descales: tuple, sinks: Any) -> Tuple[Any, Any]:
    """Runs a prepared call on q's device and current stream; allocates out and lse when None."""
    device = entry.device
    if out is None:
        out = _empty(entry.out_shape, dtype=entry.out_dtype, device=device)
    if lse is None:
        lse = _empty(entry.lse_shape, dtype=_FP32, device=device)
    index = entry.cuda
    if index < 0:
        stream = 0
    else:
        if _current_device() != index:
            with torch.cuda.device(index):
                return run(entry, q, k, v, out, lse, descales, sinks)
        stream = _raw_stream(index)
        if not entry.pinned and _capturing():
            CACHE.pin(entry)
    if entry.descales or entry.sinks:
        qd, kd, vd, sk = (0 if x is None else x.data_ptr() for x in (*descales, sinks))
        entry.call.run_ptrs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), stream, qd, kd,
                            vd, sk)
    else:
        entry.call.run_ptrs(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), stream)
    return out, lse


def bind(plan: "_ext.PlanHandle", q: Any, k: Any, v: Any, hosts: tuple, descales: tuple, causal: bool, scale: float,
         features: Features, out: Any, lse: Any, backend: int, num_threads: int, watch: tuple) -> Entry:
    """An entry running `plan` for calls like this validated one. The index descriptors point
    into private copies of the host index tensors, which the entry keeps."""
    private = tuple(None if h is None else h.clone() for h in hosts)
    problem = native.problem_tuple(q, k, v, *private, causal, scale, *descales, features)
    call = plan.bind(problem, descriptor(out, "out"), descriptor(lse, "lse"), backend, num_threads, private)
    return Entry(call, q, out, lse, descales, features.sinks, watch)


def _prepare(key: Any, owner: Any, q: Any, k: Any, v: Any, hosts: tuple, descales: tuple, causal: bool,
             scale: float, features: Features, handle: "_ext.PolicyHandle", thresholds: Any, out: Any, lse: Any,
             watch: tuple) -> Optional[Entry]:
    """A new entry for a validated call when its key is admitted (owner: see CallCache.admit),
    else None. Never under CUDA graph capture (a plan allocates and uploads device memory)."""
    if native.capturing(q) or not CACHE.admit(key, owner):
        return None
    problem = native.problem_tuple(q, k, v, *hosts, causal, scale, *descales, features)
    try:
        with native.device_guard(q) as stream:
            plan = _ext.PlanHandle(problem, handle, 0, stream, thresholds)
        return bind(plan, q, k, v, hosts, descales, causal, scale, features, out, lse, 0, 0, watch)
    except _ext.Error:  # not plannable: the call runs in full and raises what it raises
        return None


def execute(key: Any, owner: Any, q: Any, k: Any, v: Any, hosts: tuple, descales: tuple, causal: bool,
            scale: float, features: Features, policy: str, settings: list, thresholds: Any, mask: Any, chunked: Any,
            out: Any, lse: Any, layer: Optional[int], watch: tuple) -> None:
    """Runs a validated call (hosts: host copies of its index tensors) into out and lse: through
    a new prepared call when `key` (None: not cached; owner: what it names by identity) is
    admitted, else in full (sp_run). An entry is kept once its first run succeeded."""
    problem = native.problem_tuple(q, k, v, *hosts, causal, scale, *descales, features)
    handle = native.make_handle(policy, settings, problem, thresholds, mask, chunked)
    entry = None if key is None else _prepare(key, owner, q, k, v, hosts, descales, causal, scale, features, handle,
                                              thresholds, out, lse, watch)
    if entry is None:
        native.execute(problem, handle, q, out, lse, 0, 0, False, layer)
        return
    run(entry, q, k, v, out, lse, descales, features.sinks)
    CACHE.put(key, entry)


def mark_written(*tensors: Any) -> None:
    """Bumps the version counters of tensors written in place, as the op's mutation
    bookkeeping does (autograd then detects a use of their old contents)."""
    _increment_version(tuple(x for x in tensors if x is not None))


def plan_key(q: Any, k: Any, v: Any, index: tuple, descales: tuple, out: Any, lse: Any, num_threads: Any) -> Any:
    """The key of a run(plan, ...) call on torch tensors, or None (not one the lean path runs)."""
    try:
        if type(q) is not _Tensor or type(k) is not _Tensor or type(v) is not _Tensor:
            return None
        if (out is not None and type(out) is not _Tensor) or (lse is not None and type(lse) is not _Tensor):
            return None
        _, idx = _index_key(index)
        return (_PLAN, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape,
                v.stride(), v.dtype, v.device, None if out is None else _sig(out), None if lse is None else _sig(lse),
                _descales_key(descales), idx, num_threads)
    except Exception:
        return None
