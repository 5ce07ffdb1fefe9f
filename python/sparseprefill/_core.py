# SPDX-License-Identifier: Apache-2.0
"""Tensors of either framework (NumPy arrays, torch tensors) as C ABI descriptors, and the
data-free argument checks every entry point runs first (also inside torch's fake mode), with
messages that name the argument and what was expected."""

from __future__ import annotations

import math
import operator
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from . import _ext
from ._ext import InvalidArgumentError

# FP8 inputs (torch.float8_e4m3fn) may carry descales and give a bfloat16 output
# (docs/semantics.md §1).
FP8 = "float8_e4m3fn"
_FLOAT_CODES = {"bfloat16": _ext.DTYPE_BF16, "float16": _ext.DTYPE_FP16, "float32": _ext.DTYPE_FP32,
                FP8: _ext.DTYPE_FP8_E4M3}
_INT32_CODE = _ext.DTYPE_INT32


def is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_name(x: Any) -> str:
    """'bfloat16', 'float16', 'float32', 'int32', ... for either framework."""
    return str(x.dtype).replace("torch.", "")


def out_dtype(q: Any) -> Any:
    """O's dtype in q's framework: bfloat16 for float8_e4m3fn inputs, else q's dtype."""
    if is_torch(q) and dtype_name(q) == FP8:
        return sys.modules["torch"].bfloat16
    return q.dtype


def device_of(x: Any) -> Tuple[str, int]:
    """('cpu', 0) or ('cuda', ordinal)."""
    if is_torch(x):
        if x.device.type == "cuda":
            return ("cuda", x.device.index if x.device.index is not None else 0)
        return (x.device.type, 0)
    return ("cpu", 0)


def device_str(x: Any) -> str:
    kind, index = device_of(x)
    return f"cuda:{index}" if kind == "cuda" else kind


def strides_of(x: Any) -> Tuple[int, ...]:
    """Strides in elements."""
    if is_torch(x):
        return tuple(x.stride())
    item = x.itemsize
    for s in x.strides:
        if s % item != 0:
            raise InvalidArgumentError(f"array strides {x.strides} are not multiples of the item size {item}")
    return tuple(s // item for s in x.strides)


def descriptor(x: Any, name: str) -> Optional[tuple]:
    """The C ABI's sp_tensor as a tuple (data_ptr, dtype, device_type, device_index, shape,
    strides), or None for an absent tensor. The caller keeps `x` alive during the call."""
    if x is None:
        return None
    dt = dtype_name(x)
    code = _FLOAT_CODES.get(dt, _INT32_CODE if dt == "int32" else None)
    if code is None:
        raise InvalidArgumentError(f"{name}: dtype {dt} is not supported (bfloat16, float16, float32, {FP8} or int32)")
    kind, index = device_of(x)
    if kind not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{name}: expected a CPU or CUDA tensor, got device {device_str(x)}")
    if is_torch(x):
        ptr = x.data_ptr()
    else:
        ptr = x.__array_interface__["data"][0]
    device_type = _ext.DEVICE_CUDA if kind == "cuda" else _ext.DEVICE_CPU
    return (ptr, code, device_type, index, tuple(int(s) for s in x.shape), strides_of(x))


@dataclass(frozen=True)
class Geometry:
    """What the shapes alone say about a call (no index data read)."""

    batch: int  # -1 when only cu_seqlens_q's length could tell and it is absent
    h_q: int
    h_kv: int
    d: int
    d_v: int  # v's head dim (out's last dimension)
    varlen_q: bool
    kv_layout: str  # "batched", "varlen" or "paged"
    lse_shape: Tuple[int, ...]
    out_shape: Tuple[int, ...]  # q's shape with d_v last


def _shape(x: Any) -> Tuple[int, ...]:
    # No int(): under torch.compile the sizes may be symbolic, and int() would specialise them.
    return tuple(x.shape)


def _check_float(x: Any, name: str, ranks: Sequence[int], expected: str) -> None:
    if x is None:
        raise InvalidArgumentError(f"{name}: required, expected {expected}")
    if len(x.shape) not in ranks:
        raise InvalidArgumentError(f"{name}: expected {expected}, got rank {len(x.shape)} {list(_shape(x))}")
    if dtype_name(x) not in _FLOAT_CODES:
        raise InvalidArgumentError(f"{name}: expected dtype bfloat16, float16, float32 or {FP8}, got {dtype_name(x)}")
    if x.shape[-1] > 1 and strides_of(x)[-1] != 1:
        raise InvalidArgumentError(
            f"{name}: the last dimension (head_dim) must be contiguous (stride 1), got stride {strides_of(x)[-1]}")


def _check_index(x: Any, name: str, rank: int, expected: str, device: Tuple[str, int]) -> None:
    if len(x.shape) != rank:
        raise InvalidArgumentError(f"{name}: expected {expected}, got rank {len(x.shape)} {list(_shape(x))}")
    if dtype_name(x) != "int32":
        raise InvalidArgumentError(f"{name}: expected dtype int32, got {dtype_name(x)}")
    where = device_of(x)
    if where != ("cpu", 0) and where != device:
        raise InvalidArgumentError(f"{name}: expected the CPU or q's device, got {device_str(x)}")


def _check_descale(x: Any, name: str, q: Any, batch: Any, h_kv: int) -> None:
    if dtype_name(q) != FP8:
        raise InvalidArgumentError(f"{name}: only with {FP8} inputs, got {dtype_name(q)} inputs")
    if _shape(x) != (batch, h_kv) or dtype_name(x) != "float32":
        raise InvalidArgumentError(
            f"{name}: expected float32 [batch, h_kv] = [{batch}, {h_kv}], got {dtype_name(x)} {list(_shape(x))}")
    if device_of(x) != device_of(q):
        raise InvalidArgumentError(f"{name}: expected q's device {device_str(q)}, got {device_str(x)}")


def check_problem(q: Any, k: Any, v: Any, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
                  seqused_k: Any = None, block_table: Any = None, out: Any = None,
                  lse: Any = None, q_descale: Any = None, k_descale: Any = None,
                  v_descale: Any = None, sinks: Any = None) -> Geometry:
    """Shape, dtype, device and layout checks that need no index data (nor descale or sink
    values). v has k's shape but for its head dim d_v, which out then has."""
    _check_float(q, "q", (3, 4), "[b, s_q, h_q, d] or varlen [total_q, h_q, d]")
    _check_float(k, "k", (3, 4), "[b, s_k, h_kv, d], varlen [total_k, h_kv, d] or paged [num_pages, page_size, h_kv, d]")
    _check_float(v, "v", (3, 4), "the shape of k but for its head dim d_v")
    if dtype_name(k) != dtype_name(q) or dtype_name(v) != dtype_name(q):
        raise InvalidArgumentError(
            f"k, v: expected q's dtype {dtype_name(q)}, got k {dtype_name(k)} and v {dtype_name(v)}")
    dev = device_of(q)
    for name, x in (("k", k), ("v", v)):
        if device_of(x) != dev:
            raise InvalidArgumentError(f"{name}: expected q's device {device_str(q)}, got {device_str(x)}")
    if len(v.shape) != len(k.shape) or _shape(v)[:-1] != _shape(k)[:-1]:
        raise InvalidArgumentError(
            f"v: expected the shape of k {list(_shape(k))} but for its head dim d_v, got {list(_shape(v))}")
    h_q, d = int(q.shape[-2]), int(q.shape[-1])
    h_kv, d_k, d_v = int(k.shape[-2]), int(k.shape[-1]), int(v.shape[-1])
    if d <= 0:
        raise InvalidArgumentError(f"q: head_dim must be positive, got {d}")
    if d_v <= 0:
        raise InvalidArgumentError(f"v: head_dim must be positive, got {d_v}")
    if d_k != d:
        raise InvalidArgumentError(f"k: expected head_dim {d} (q's), got {d_k}")
    if h_q <= 0 or h_kv <= 0:
        raise InvalidArgumentError(f"q, k: head counts must be positive, got h_q {h_q} and h_kv {h_kv}")
    if h_q % h_kv != 0:
        raise InvalidArgumentError(f"k: h_kv ({h_kv}) must divide h_q ({h_q})")

    varlen_q = len(q.shape) == 3
    if varlen_q:
        if cu_seqlens_q is None:
            raise InvalidArgumentError("cu_seqlens_q: required when q is varlen [total_q, h_q, d]")
        _check_index(cu_seqlens_q, "cu_seqlens_q", 1, "int32 [batch + 1]", dev)
        batch = cu_seqlens_q.shape[0] - 1
        if batch < 0:
            raise InvalidArgumentError("cu_seqlens_q: expected int32 [batch + 1], got an empty tensor")
    else:
        if cu_seqlens_q is not None:
            raise InvalidArgumentError(
                "cu_seqlens_q: given, but q is batched [b, s_q, h_q, d]; pass q as [total_q, h_q, d]")
        batch = q.shape[0]

    if block_table is not None:
        if len(k.shape) != 4:
            raise InvalidArgumentError(
                f"k: expected paged [num_pages, page_size, h_kv, d] with block_table, got {list(_shape(k))}")
        if cu_seqlens_k is not None:
            raise InvalidArgumentError("cu_seqlens_k: not allowed with block_table (use seqused_k)")
        _check_index(block_table, "block_table", 2, f"int32 [batch, max_pages] with batch {batch}", dev)
        if block_table.shape[0] != batch:
            raise InvalidArgumentError(
                f"block_table: expected int32 [batch, max_pages] with batch {batch}, got {list(_shape(block_table))}")
        if seqused_k is None:
            raise InvalidArgumentError("seqused_k: required with block_table")
        kv_layout = "paged"
    elif cu_seqlens_k is not None:
        if len(k.shape) != 3:
            raise InvalidArgumentError(
                f"k: expected varlen [total_k, h_kv, d] with cu_seqlens_k, got {list(_shape(k))}")
        _check_index(cu_seqlens_k, "cu_seqlens_k", 1, f"int32 [batch + 1] = [{batch + 1}]", dev)
        if cu_seqlens_k.shape[0] != batch + 1:
            raise InvalidArgumentError(
                f"cu_seqlens_k: expected int32 [batch + 1] = [{batch + 1}], got {list(_shape(cu_seqlens_k))}")
        kv_layout = "varlen"
    else:
        if len(k.shape) != 4:
            if varlen_q:
                raise InvalidArgumentError(
                    "k: expected cu_seqlens_k (varlen [total_k, h_kv, d]) or block_table (paged) when q is varlen")
            raise InvalidArgumentError(f"k: expected [b, s_k, h_kv, d], got {list(_shape(k))}")
        if k.shape[0] != batch:
            raise InvalidArgumentError(f"k: expected batch {batch} (q's), got {k.shape[0]}")
        kv_layout = "batched"
    if seqused_k is not None:
        _check_index(seqused_k, "seqused_k", 1, f"int32 [batch] with batch {batch}", dev)
        if seqused_k.shape[0] != batch:
            raise InvalidArgumentError(
                f"seqused_k: expected int32 [batch] with batch {batch}, got {list(_shape(seqused_k))}")

    for name, x in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if x is not None:
            _check_descale(x, name, q, batch, h_kv)

    if sinks is not None:
        if len(sinks.shape) != 1 or sinks.shape[0] != h_q or dtype_name(sinks) != "float32":
            raise InvalidArgumentError(
                f"sinks: expected float32 [h_q] = [{h_q}], got {dtype_name(sinks)} {list(_shape(sinks))}")
        if device_of(sinks) != dev:
            raise InvalidArgumentError(f"sinks: expected q's device {device_str(q)}, got {device_str(sinks)}")

    lse_shape = (h_q, q.shape[0]) if varlen_q else (batch, h_q, q.shape[1])
    out_shape = _shape(q)[:-1] + (v.shape[-1],)
    if out is not None:
        if _shape(out) != out_shape:
            raise InvalidArgumentError(
                f"out: expected q's shape with v's head dim {list(out_shape)}, got {list(_shape(out))}")
        want = str(out_dtype(q)).replace("torch.", "")
        if dtype_name(out) != want:
            fp8 = dtype_name(q) == FP8
            expected = f"dtype {want} ({FP8} inputs give a {want} output)" if fp8 else f"q's dtype {want}"
            raise InvalidArgumentError(f"out: expected {expected}, got {dtype_name(out)}")
        if device_of(out) != dev:
            raise InvalidArgumentError(f"out: expected q's device {device_str(q)}, got {device_str(out)}")
        if out.shape[-1] > 1 and strides_of(out)[-1] != 1:
            raise InvalidArgumentError("out: the last dimension must be contiguous (stride 1)")
    if lse is not None:
        if _shape(lse) != lse_shape:
            layout = "[h_q, total_q]" if varlen_q else "[b, h_q, s_q]"
            raise InvalidArgumentError(f"lse: expected float32 {layout} = {list(lse_shape)}, got {list(_shape(lse))}")
        if dtype_name(lse) != "float32":
            raise InvalidArgumentError(f"lse: expected dtype float32, got {dtype_name(lse)}")
        if device_of(lse) != dev:
            raise InvalidArgumentError(f"lse: expected q's device {device_str(q)}, got {device_str(lse)}")
    return Geometry(batch, h_q, h_kv, d, d_v, varlen_q, kv_layout, lse_shape, out_shape)


def check_scale(softmax_scale: Optional[float]) -> float:
    """None -> 0.0 (the library's 1/sqrt(d)); otherwise a finite positive float."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    if not (scale > 0.0 and scale != float("inf")):
        raise InvalidArgumentError(f"softmax_scale: expected a finite positive number or None, got {softmax_scale!r}")
    return scale


class Features(NamedTuple):
    """The model-family features of a call (docs/semantics.md §1), checked: window is
    FlashAttention's window_size (left, right), -1 no bound on that side; softcap 0 is none;
    sinks a float32 [h_q] tensor of q's framework and device, or None; chunk FlashAttention's
    attention_chunk (0: none)."""

    window: Tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    sinks: Any = None
    chunk: int = 0

    def fields(self) -> tuple:
        """sp_problem's fields after scale: (local, window_left, window_right, attention_chunk,
        softcap, sinks)."""
        left, right = self.window
        local = left != -1 or right != -1
        return (local, left if local else 0, right if local else 0, self.chunk, self.softcap,
                descriptor(self.sinks, "sinks"))

    def signature(self) -> tuple:
        """What a prepared call's key holds of them: the sinks' layout, not their address (each
        call patches it) nor their values (read as the call runs)."""
        s = self.sinks
        return self.window, self.chunk, self.softcap, None if s is None else (s.shape, s.stride(), s.dtype, s.device)


NO_FEATURES = Features()


def _as_integer(x: Any) -> Optional[int]:
    """x as an int when it is one exactly (operator.index: numpy integers, one-element integer
    tensors: FlashAttention's own tests pass torch.randint(0, s_k, (2,))), not a bool; else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def check_window(window_size: Any) -> Tuple[int, int]:
    """FlashAttention's window_size: None or (left, right), each -1 (no bound) or >= 0 keys."""
    if window_size is None:
        return (-1, -1)
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"window_size: expected (left, right), got {window_size!r}") from None
    bounds = []
    for side, w in (("left", left), ("right", right)):
        w = _as_integer(w)
        if w is None:
            raise InvalidArgumentError(f"window_size: expected integers (left, right), got {window_size!r}")
        if w < -1:
            raise InvalidArgumentError(
                f"window_size: {side} must be -1 (no bound) or a number of keys >= 0, got {window_size!r}")
        bounds.append(w)
    return bounds[0], bounds[1]


def check_chunk(attention_chunk: Any) -> int:
    """FlashAttention's attention_chunk: None or 0 (none), or a chunk of positions > 0."""
    if attention_chunk is None:
        return 0
    chunk = _as_integer(attention_chunk)
    if chunk is None:
        raise InvalidArgumentError(f"attention_chunk: expected an integer, got {attention_chunk!r}")
    if chunk < 0:
        raise InvalidArgumentError(f"attention_chunk: expected 0 (none) or a chunk of positions > 0, got {chunk}")
    return chunk


def check_softcap(softcap: Any) -> float:
    """None or 0 -> 0.0 (none); otherwise a finite positive float."""
    if softcap is None:
        return 0.0
    cap = float(softcap)
    if not (cap >= 0.0 and math.isfinite(cap)):
        raise InvalidArgumentError(f"softcap: expected 0 (none) or a finite positive number, got {softcap!r}")
    return cap


def backend_code(backend: str) -> int:
    try:
        return _ext.BACKENDS[backend]
    except KeyError:
        known = ", ".join(sorted(_ext.BACKENDS))
        raise InvalidArgumentError(f"backend: expected one of {known}, got {backend!r}") from None
