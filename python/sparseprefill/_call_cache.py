# SPDX-License-Identifier: Apache-2.0
"""The cache of prepared calls behind the eager fast path of the FlashAttention-style functions,
the transformers backend and the torch ops (docs/python.md, "Prepared calls").

A key is everything a call's checks read (policy, shapes, strides, dtypes, devices, causal,
scale, index-tensor contents, the output's layout); the key's builders live with the callers
(_fastpath.py). An entry holds a library plan (device memory on CUDA) bound to that call's
descriptors, so a hit runs with the data pointers patched and nothing re-checked. A key is
planned the second time it is validated: calls made once (random shapes, a test) never plan.
LRU over at most `capacity` entries; an entry used under CUDA graph capture is pinned (never
evicted: a graph that replays it reads the plan's memory) until clear_call_cache().

Torch-free, so that `import sparseprefill` stays so; thread-safe."""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, NamedTuple, Optional

from ._ext import InvalidArgumentError

__all__ = ["CallCacheInfo", "call_cache_info", "clear_call_cache", "set_call_cache_size"]

# Enough for one entry per layer of the largest common models (a per-layer policy such as a
# calibrated ExactGate is one key per layer): a cap under the number of keys a step cycles
# through would evict every entry before its next use.
DEFAULT_CAPACITY = 128

_UNSEEN = object()


class CallCacheInfo(NamedTuple):
    """hits / misses: lookups that ran a prepared call / that validated and ran the call in
    full; plans: entries made; evictions: entries dropped by the LRU; size: entries now
    (pinned included); pinned: entries used under CUDA graph capture (also those whose key was
    since replanned, kept until clear_call_cache()); capacity: the cap."""

    hits: int
    misses: int
    plans: int
    evictions: int
    size: int
    pinned: int
    capacity: int


class CallCache:
    def __init__(self, capacity: int) -> None:
        self._lock = threading.Lock()
        self._entries: "OrderedDict[Any, Any]" = OrderedDict()
        # The keys validated once and not planned yet (admission on the second validation), by
        # hash, with a weak reference to the object a key names by identity (None: none).
        # Hashes, not keys: a key holds its policy, which should not outlive its caller's use
        # here; the reference tells a new object at a dead one's address (the same hash) from
        # the object seen. A collision otherwise only plans a key one call early.
        self._seen: dict = {}
        # Pinned entries whose key now names another entry (or none): a graph may still replay
        # their plans, which live until clear().
        self._retired: list = []
        self._capacity = capacity
        self._hits = self._misses = self._plans = self._evictions = 0

    def get(self, key: Any) -> Optional[Any]:
        """The entry of `key` (most recently used from now on), or None: a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += self._capacity > 0  # an off cache (size 0) counts no lookup
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def admit(self, key: Any, owner: Any = None) -> bool:
        """Whether a validated miss of `key` should make an entry now: on its second validation.
        owner: the object the key names by identity (an ExactGate, a BlockSparse, a threshold
        table), or None."""
        with self._lock:
            if self._capacity <= 0:
                return False
            seen = hash(key)
            ref = self._seen.pop(seen, _UNSEEN)
            if ref is not _UNSEEN and (ref is None or ref() is owner):
                return True
            if len(self._seen) >= 4 * self._capacity:
                self._seen.clear()
            self._seen[seen] = None if owner is None else weakref.ref(owner)
            return False

    def put(self, key: Any, entry: Any) -> None:
        with self._lock:
            replaced = self._retire(self._entries.pop(key, None))
            self._entries[key] = entry
            self._plans += 1
            evicted = self._shrink()
        del evicted, replaced  # the plans' memory is released here, outside the lock

    def drop(self, key: Any) -> None:
        with self._lock:
            dropped = self._retire(self._entries.pop(key, None))
        del dropped

    def _retire(self, entry: Any) -> Any:
        # An entry leaving its key: kept when pinned, else returned for release.
        if entry is not None and entry.pinned:
            self._retired.append(entry)
            return None
        return entry

    def pin(self, entry: Any) -> None:
        with self._lock:
            entry.pinned = True

    def _shrink(self) -> list:
        # Oldest unpinned entries first, until at most `capacity` unpinned remain.
        evicted = []
        unpinned = [k for k, e in self._entries.items() if not e.pinned]
        for key in unpinned[:max(0, len(unpinned) - self._capacity)]:
            evicted.append(self._entries.pop(key))
            self._evictions += 1
        return evicted

    def clear(self) -> None:
        with self._lock:
            dropped = list(self._entries.values()) + self._retired
            self._entries.clear()
            self._retired = []
            self._seen.clear()
            self._hits = self._misses = self._plans = self._evictions = 0
        del dropped

    def resize(self, capacity: int) -> None:
        with self._lock:
            self._capacity = capacity
            self._seen.clear()
            evicted = self._shrink()
        del evicted

    def info(self) -> CallCacheInfo:
        with self._lock:
            pinned = sum(1 for e in self._entries.values() if e.pinned) + len(self._retired)
            return CallCacheInfo(self._hits, self._misses, self._plans, self._evictions, len(self._entries), pinned,
                                 self._capacity)


def _capacity_from_environment() -> int:
    raw = os.environ.get("SPARSEPREFILL_CALL_CACHE", "")
    if not raw:
        return DEFAULT_CAPACITY
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise InvalidArgumentError(f"SPARSEPREFILL_CALL_CACHE: expected a number of entries >= 0, got {raw!r}")
    return value


CACHE = CallCache(_capacity_from_environment())


def clear_call_cache() -> None:
    """Drops every prepared call, pinned ones included, freeing their plans (on CUDA after the
    work already enqueued with them), and zeroes the counters. A CUDA graph captured with
    cached calls must not be replayed afterwards."""
    CACHE.clear()


def set_call_cache_size(entries: int) -> None:
    """At most `entries` unpinned prepared calls (least recently used evicted first); 0 turns the
    cache off (every call is then validated and run in full). The environment variable
    SPARSEPREFILL_CALL_CACHE sets the size at import (default 128)."""
    if isinstance(entries, bool) or not isinstance(entries, int) or entries < 0:
        raise InvalidArgumentError(f"entries: expected an int >= 0, got {entries!r}")
    CACHE.resize(entries)


def call_cache_info() -> CallCacheInfo:
    """Counters and size of the prepared-call cache."""
    return CACHE.info()
