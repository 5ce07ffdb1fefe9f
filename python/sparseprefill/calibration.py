# SPDX-License-Identifier: Apache-2.0
"""Reads the calibration files the C++ library writes (src/core/calibration.cpp): a
safetensors file with metadata format=sparseprefill.calibration, format_version=1, and up to
three sections (exact_gate thresholds, softmax_skip factors, estimate_select alphas). Every
malformed, truncated or inconsistent file raises CorruptDataError saying what is wrong.
Calibrator writes them: it feeds each layer's q/k to the library's calibrators (on the GPU for
CUDA tensors, seconds for a 128K-token sample; on the CPU for NumPy arrays and CPU tensors)."""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _ext
from ._ext import CorruptDataError, FileError, InvalidArgumentError
from .policy import EstimateSelect, ExactGate, SoftmaxSkip

__all__ = ["Calibration", "Calibrator", "load_calibration", "read_safetensors"]

_FORMAT = "sparseprefill.calibration"
_VERSION = "1"
_MAX_DIM = 1 << 20
_DTYPES = {"F32": np.dtype("<f4"), "I32": np.dtype("<i4"), "F16": np.dtype("<f2"), "BF16": None}
_GATE_META = ("exact_gate.layers", "exact_gate.heads", "exact_gate.positions", "exact_gate.block_q",
              "exact_gate.block_k")
_SKIP_META = ("softmax_skip.block_q", "softmax_skip.block_k")
_SELECT_META = ("estimate_select.block", "estimate_select.sink", "estimate_select.window",
                "estimate_select.tail", "estimate_select.mean_correction", "estimate_select.pack_gqa")
_TENSORS = ("exact_gate.thresholds", "exact_gate.budgets", "softmax_skip.targets", "softmax_skip.a",
            "estimate_select.targets", "estimate_select.alpha")


def read_safetensors(data: bytes) -> Tuple[Dict[str, str], Dict[str, np.ndarray]]:
    """(metadata, tensors) of an in-memory safetensors file. BF16 tensors come back as their
    raw uint16 bit patterns (NumPy has no bfloat16)."""
    if len(data) < 8:
        raise CorruptDataError(f"safetensors: file of {len(data)} bytes is shorter than the 8-byte header length")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise CorruptDataError(f"safetensors: header length {header_len} exceeds the {len(data) - 8} bytes after it")
    try:
        header = json.loads(data[8:8 + header_len].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptDataError(f"safetensors: header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise CorruptDataError("safetensors: header is not a JSON object")
    body = memoryview(data)[8 + header_len:]
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CorruptDataError("safetensors: __metadata__ must map strings to strings")
    tensors: Dict[str, np.ndarray] = {}
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise CorruptDataError(f"safetensors: tensor '{name}': expected dtype, shape and data_offsets")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES:
            raise CorruptDataError(f"safetensors: tensor '{name}': unsupported dtype {dtype!r}")
        if (not isinstance(shape, list) or not all(isinstance(s, int) and 0 <= s <= _MAX_DIM for s in shape)):
            raise CorruptDataError(f"safetensors: tensor '{name}': bad shape {shape!r}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= len(body)):
            raise CorruptDataError(
                f"safetensors: tensor '{name}': data_offsets {offsets!r} outside the {len(body)}-byte data section")
        np_dtype = _DTYPES[dtype] or np.dtype("<u2")
        count = math.prod(shape)
        if offsets[1] - offsets[0] != count * np_dtype.itemsize:
            raise CorruptDataError(
                f"safetensors: tensor '{name}': {offsets[1] - offsets[0]} bytes for shape {shape} {dtype}")
        tensors[name] = np.frombuffer(body[offsets[0]:offsets[1]], dtype=np_dtype).reshape(shape).copy()
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise CorruptDataError(f"safetensors: tensors '{a}' and '{b}' overlap")
    return metadata, tensors


@dataclass
class Calibration:
    """A loaded calibration file. Empty arrays mean "not calibrated"."""

    layers: int = 0
    metadata: Dict[str, str] = field(default_factory=dict)
    # exact_gate: values [layers, budgets, heads, positions]; -inf keeps everything.
    gate_values: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0, 0), np.float32))
    gate_budgets: List[int] = field(default_factory=list)
    gate_block_q: int = 128
    gate_block_k: int = 128
    skip_targets: List[float] = field(default_factory=list)
    skip_a: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [layers, targets]
    skip_block_q: int = 128
    skip_block_k: int = 128
    density_targets: List[float] = field(default_factory=list)
    alpha: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [layers, targets]
    estimate_base: Optional[EstimateSelect] = None

    def _layer(self, layer: int, rows: int, what: str) -> int:
        if not 0 <= layer < rows:
            raise InvalidArgumentError(f"layer: expected 0 .. {rows - 1} for {what}, got {layer}")
        return layer

    def thresholds(self, layer: int, budget: int) -> np.ndarray:
        """exact_gate's float32 [heads, positions] table for `layer` at budget value `budget`."""
        if not self.gate_budgets:
            raise InvalidArgumentError("calibration: the file has no exact_gate section")
        layer = self._layer(layer, self.gate_values.shape[0], "exact_gate")
        if budget not in self.gate_budgets:
            raise InvalidArgumentError(f"budget: expected one of {self.gate_budgets}, got {budget}")
        return np.ascontiguousarray(self.gate_values[layer, self.gate_budgets.index(budget)])

    def exact_gate(self, layer: int, budget: int) -> ExactGate:
        return ExactGate(block_q=self.gate_block_q, block_k=self.gate_block_k,
                         thresholds=self.thresholds(layer, budget))

    @staticmethod
    def _pick(targets: List[float], target: float, name: str) -> int:
        for i, t in enumerate(targets):
            if math.isclose(t, target, rel_tol=1e-6, abs_tol=1e-7):
                return i
        raise InvalidArgumentError(f"target: expected one of the calibrated {name} {targets}, got {target}")

    def softmax_skip(self, layer: int, target: float) -> SoftmaxSkip:
        """softmax_skip with the factor a fitted for skip fraction `target` at `layer`."""
        if not self.skip_targets:
            raise InvalidArgumentError("calibration: the file has no softmax_skip section")
        i = self._pick(self.skip_targets, target, "skip fractions")
        a = float(self.skip_a[self._layer(layer, self.layers, "softmax_skip"), i])
        return SoftmaxSkip(block_q=self.skip_block_q, block_k=self.skip_block_k, a=a)

    def estimate_select(self, layer: int, target: float) -> EstimateSelect:
        """estimate_select with the alpha fitted for density `target` at `layer`."""
        if self.estimate_base is None:
            raise InvalidArgumentError("calibration: the file has no estimate_select section")
        i = self._pick(self.density_targets, target, "densities")
        alpha = float(self.alpha[self._layer(layer, self.layers, "estimate_select"), i])
        b = self.estimate_base
        return EstimateSelect(block=b.block, alpha=alpha, sink=b.sink, window=b.window, tail=b.tail,
                              mean_correction=b.mean_correction, pack_gqa=b.pack_gqa)


def _is_reserved(key: str) -> bool:
    return key in ("format", "format_version", "layers") or key.startswith(
        ("exact_gate.", "softmax_skip.", "estimate_select."))


class _Reader:
    def __init__(self, metadata: Dict[str, str], tensors: Dict[str, np.ndarray]):
        self.meta, self.tensors = metadata, tensors

    def int(self, key: str, min_value: int) -> int:
        if key not in self.meta:
            raise CorruptDataError(f"metadata '{key}' is missing")
        s = self.meta[key]
        if not (s.isdigit() and s.isascii() and len(s) <= 9) or not min_value <= int(s) <= _MAX_DIM:
            raise CorruptDataError(f"metadata '{key}': expected an integer in {min_value} .. {_MAX_DIM}, got '{s}'")
        return int(s)

    def bool(self, key: str) -> bool:
        s = self.meta[key]
        if s not in ("true", "false"):
            raise CorruptDataError(f"metadata '{key}': expected 'true' or 'false', got '{s}'")
        return s == "true"

    def f32(self, name: str, shape: Tuple[int, ...]) -> np.ndarray:
        t = self.tensors[name]
        if t.dtype != np.float32 or t.shape != shape:
            raise CorruptDataError(f"{name}: expected {list(shape)} fp32 (from the metadata), got {list(t.shape)} {t.dtype}")
        return t

    def targets(self, name: str) -> List[float]:
        t = self.tensors[name]
        if t.dtype != np.float32 or t.ndim != 1 or t.size < 1:
            raise CorruptDataError(f"{name}: expected fp32 [targets] with at least one target, got {list(t.shape)} {t.dtype}")
        values = [float(x) for x in t]
        for i, x in enumerate(values):
            if not (math.isfinite(x) and 0.0 <= x <= 1.0):
                raise CorruptDataError(f"{name}[{i}]: expected a fraction in [0, 1], got {x}")
            if i and not values[i - 1] < x:
                raise CorruptDataError(f"{name}: must be strictly ascending, got {values[i - 1]} then {x}")
        return values

    def section(self, name: str, tensors: Tuple[str, ...], meta: Tuple[str, ...]) -> bool:
        have = [n for n in tensors if n in self.tensors] + [k for k in meta if k in self.meta]
        missing = [n for n in tensors if n not in self.tensors] + [k for k in meta if k not in self.meta]
        if have and missing:
            raise CorruptDataError(f"{name}: '{missing[0]}' is missing ('{have[0]}' is present)")
        return bool(have)


def _parse(metadata: Dict[str, str], tensors: Dict[str, np.ndarray]) -> Calibration:
    if "format" not in metadata:
        raise CorruptDataError("metadata 'format' is missing: not a sparseprefill calibration file")
    if metadata["format"] != _FORMAT:
        raise CorruptDataError(f"metadata 'format' is '{metadata['format']}', expected '{_FORMAT}'")
    if metadata.get("format_version") != _VERSION:
        raise CorruptDataError(f"format_version {metadata.get('format_version')!r} is not supported (this build reads {_VERSION})")
    for name in tensors:
        if name not in _TENSORS:
            raise CorruptDataError(f"unexpected tensor '{name}'")
    known = {"format", "format_version", "layers", *_GATE_META, *_SKIP_META, *_SELECT_META}
    for key in metadata:
        if _is_reserved(key) and key not in known:
            raise CorruptDataError(f"unexpected metadata key '{key}'")
    r = _Reader(metadata, tensors)
    c = Calibration(layers=r.int("layers", 0))
    c.metadata = {k: v for k, v in metadata.items() if not _is_reserved(k)}
    if r.section("exact_gate", ("exact_gate.thresholds", "exact_gate.budgets"), _GATE_META):
        layers, heads, positions = (r.int(f"exact_gate.{k}", 1) for k in ("layers", "heads", "positions"))
        c.gate_block_q, c.gate_block_k = r.int("exact_gate.block_q", 1), r.int("exact_gate.block_k", 1)
        budgets = tensors["exact_gate.budgets"]
        if budgets.dtype != np.int32 or budgets.ndim != 1 or budgets.size < 1:
            raise CorruptDataError("exact_gate.budgets: expected I32 [budgets] with at least one budget")
        c.gate_budgets = [int(b) for b in budgets]
        for i, b in enumerate(c.gate_budgets):
            if b < 1:
                raise CorruptDataError(f"exact_gate.budgets[{i}]: expected a block count >= 1, got {b}")
            if i and not c.gate_budgets[i - 1] < b:
                raise CorruptDataError(f"exact_gate.budgets: must be strictly ascending, got {c.gate_budgets[i - 1]} then {b}")
        c.gate_values = r.f32("exact_gate.thresholds", (layers, len(c.gate_budgets), heads, positions))
        bad = np.isnan(c.gate_values) | (c.gate_values == np.inf)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise CorruptDataError(f"exact_gate.thresholds: {c.gate_values[where]} at [layer, budget, head, position] "
                                   f"{list(where)} (finite or -inf expected)")
        if c.layers and c.layers != layers:
            raise CorruptDataError(f"layers: {c.layers} disagrees with exact_gate.layers {layers}")
    if r.section("softmax_skip", ("softmax_skip.targets", "softmax_skip.a"), _SKIP_META):
        c.skip_block_q, c.skip_block_k = r.int("softmax_skip.block_q", 1), r.int("softmax_skip.block_k", 1)
        c.skip_targets = r.targets("softmax_skip.targets")
        c.skip_a = r.f32("softmax_skip.a", (c.layers, len(c.skip_targets)))
    if r.section("estimate_select", ("estimate_select.targets", "estimate_select.alpha"), _SELECT_META):
        c.estimate_base = EstimateSelect(
            block=r.int("estimate_select.block", 1), sink=r.int("estimate_select.sink", 0),
            window=r.int("estimate_select.window", 0), tail=r.int("estimate_select.tail", 0),
            mean_correction=r.bool("estimate_select.mean_correction"), pack_gqa=r.bool("estimate_select.pack_gqa"))
        c.density_targets = r.targets("estimate_select.targets")
        c.alpha = r.f32("estimate_select.alpha", (c.layers, len(c.density_targets)))
    if (c.skip_targets or c.density_targets) and c.layers < 1:
        raise CorruptDataError("layers: expected >= 1 with softmax_skip or estimate_select results, got 0")
    return c


_CACHE: Dict[Tuple[str, int, int], Calibration] = {}


def load_calibration(path: "str | os.PathLike[str]") -> Calibration:
    """Loads (and caches, by path, size and modification time) a calibration file."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)
        if key in _CACHE:
            return _CACHE[key]
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FileError(f"{path}: {e.strerror or e}") from None
    try:
        cal = _parse(*read_safetensors(data))
    except CorruptDataError as e:
        raise CorruptDataError(f"{path}: {e}") from None
    _CACHE[key] = cal
    return cal


class Calibrator:
    """One calibration run (the library's CalibrationRun through the C ABI): add(layer, q, k)
    for every layer of every sample, then save(path). q [b, s, h_q, d] and k [b, s_k, h_kv, d]
    (causal, the model's layout after RoPE) as torch tensors (CUDA: statistics on the GPU, on
    the current stream, which is synchronised) or NumPy arrays / CPU tensors (CPU route).
    Empty target lists leave their policy out; estimate_select's other parameters are the
    policy defaults (as `sparseprefill calibrate`)."""

    def __init__(self, layers: int, heads: int, *, budgets: Sequence[int] = (), skip_targets: Sequence[float] = (),
                 density_targets: Sequence[float] = (), block_q: int = 128, block_k: int = 128,
                 select_block: int = 128):
        self._handle = _ext.CalibratorHandle(int(layers), int(heads), int(block_q), int(block_k), int(select_block),
                                             [int(b) for b in budgets], [float(t) for t in skip_targets],
                                             [float(t) for t in density_targets])

    def add(self, layer: int, q: Any, k: Any) -> None:
        from .native import device_guard, problem_tuple

        problem = problem_tuple(q, k, k, None, None, None, None, True, 0.0)
        with device_guard(q) as stream:
            self._handle.add(int(layer), problem, stream)

    def save(self, path: "str | os.PathLike[str]", metadata: Optional[Dict[str, str]] = None) -> None:
        self._handle.save(os.fspath(path), [(str(k), str(v)) for k, v in (metadata or {}).items()])
