# SPDX-License-Identifier: Apache-2.0
"""Work statistics: what each call kept, per (batch, query head), and collect_stats(), a
context manager that records every call made inside it (tagged with its layer) so that
density per layer and head can be read afterwards. Collecting synchronises the CUDA stream
once per call; calls made while a CUDA graph is being captured are not recorded."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import numpy as np

__all__ = ["CallStats", "StatsLog", "collect_stats", "collecting"]

# Column order of CallStats.heads.
COUNTERS = ("visible_blocks", "kept_blocks", "corrected_blocks", "visible_pairs", "computed_pairs")


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    # A head that sees no block (an empty sequence) counts as fully dense: nothing was skipped.
    num = np.asarray(num, dtype=np.float64)
    den = np.asarray(den, dtype=np.float64)
    return np.divide(num, den, out=np.ones_like(num), where=den > 0)


@dataclass(frozen=True)
class CallStats:
    """One call's accounting. heads is int64 [batch, h_q, 5] with the COUNTERS columns."""

    layer: Optional[int]
    policy: str
    density: float       # kept / visible blocks over the call
    pair_density: float  # computed / visible (query, key) pairs
    heads: np.ndarray

    @classmethod
    def from_ext(cls, raw: dict, layer: Optional[int], policy: str) -> "CallStats":
        heads = np.asarray(raw["heads"], dtype=np.int64).reshape(raw["batch"], raw["h_q"], len(COUNTERS))
        return cls(layer, policy, float(raw["density"]), float(raw["pair_density"]), heads)

    def head_density(self) -> np.ndarray:
        """float64 [batch, h_q]: kept / visible blocks per head."""
        return _ratio(self.heads[..., 1], self.heads[..., 0])


class StatsLog:
    """The calls recorded inside one collect_stats() block."""

    def __init__(self) -> None:
        self.calls: List[CallStats] = []

    def layers(self) -> List[Optional[int]]:
        seen: Dict[Optional[int], None] = {}
        for c in self.calls:
            seen.setdefault(c.layer, None)
        return list(seen)

    def _sum(self, layer: Optional[int]) -> np.ndarray:
        """int64 [h_q, 5]: counters of `layer`'s calls summed over calls and batch."""
        parts = [c.heads.sum(axis=0) for c in self.calls if c.layer == layer]
        if not parts:
            raise KeyError(f"no call recorded for layer {layer}")
        shapes = {p.shape for p in parts}
        if len(shapes) != 1:
            raise ValueError(f"layer {layer}: calls with different head counts {sorted(shapes)}")
        return np.sum(parts, axis=0)

    def density(self, layer: Optional[int] = None) -> float:
        """kept / visible blocks over the calls of `layer` (None: of every call)."""
        calls = self.calls if layer is None else [c for c in self.calls if c.layer == layer]
        visible = sum(int(c.heads[..., 0].sum()) for c in calls)
        kept = sum(int(c.heads[..., 1].sum()) for c in calls)
        return float(_ratio(kept, visible))

    def head_density(self, layer: Optional[int]) -> np.ndarray:
        """float64 [h_q]: kept / visible blocks per query head over `layer`'s calls."""
        s = self._sum(layer)
        return _ratio(s[:, 1], s[:, 0])

    def per_layer(self) -> Dict[Optional[int], float]:
        """{layer: density} in first-call order."""
        return {layer: self.density(layer) for layer in self.layers()}

    def summary(self) -> str:
        lines = [f"{len(self.calls)} calls, density {self.density():.4f}"]
        for layer, d in self.per_layer().items():
            heads = " ".join(f"{x:.3f}" for x in self.head_density(layer))
            lines.append(f"layer {layer}: density {d:.4f}; per head {heads}")
        return "\n".join(lines)


_lock = threading.Lock()
_active: List[StatsLog] = []


def collecting() -> bool:
    """Whether any collect_stats() block is open (any thread)."""
    return bool(_active)


def record(stats: CallStats) -> None:
    with _lock:
        for log in _active:
            log.calls.append(stats)


@contextlib.contextmanager
def collect_stats() -> Iterator[StatsLog]:
    """Records every call (native run, FlashAttention-style functions, torch ops, the
    transformers backend) made until the block ends; blocks may nest."""
    log = StatsLog()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)
