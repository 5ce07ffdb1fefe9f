# SPDX-License-Identifier: Apache-2.0
"""Policies: one dataclass per C++ params struct (include/sparseprefill/policy.h), with the
same field names and defaults. docs/semantics.md defines what each one keeps and skips; the
library checks every value and names the key it rejects."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Optional, Tuple

import numpy as np

from ._core import InvalidArgumentError, dtype_name, is_torch

__all__ = ["Policy", "Dense", "BlockSparse", "ExactGate", "SoftmaxSkip", "EstimateSelect", "PermuteStop"]


_UNSET = object()


def _setting(value: Any) -> str:
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    return str(value)


class Policy:
    """Base of every policy: its library name and key=value settings."""

    name: str = ""
    _tensor_fields: Tuple[str, ...] = ()

    def settings(self) -> List[Tuple[str, str]]:
        """The (key, value) strings the library parses (sp_policy_create)."""
        return [(f.name, _setting(getattr(self, f.name))) for f in fields(self)  # type: ignore[arg-type]
                if f.name not in self._tensor_fields]

    def settings_string(self) -> str:
        """The settings as 'key=value;key=value' (the torch op's encoding)."""
        return ";".join(f"{k}={v}" for k, v in self.settings())

    def call_key(self) -> Any:
        """What the checks of a call under this policy read from it, as a hashable value (calls
        with equal values validate alike; the prepared-call cache keys by it), or None when
        such calls are not cached. Computed once: policies are frozen."""
        key = self.__dict__.get("_call_key", _UNSET)
        if key is _UNSET:
            key = self._make_call_key()
            object.__setattr__(self, "_call_key", key)
        return key

    def _make_call_key(self) -> Any:
        # The settings strings the library parses, not the field values: True == 1, but they
        # are the settings "true" and "1".
        return (type(self), tuple(self.settings()))


@dataclass(frozen=True)
class Dense(Policy):
    """Nothing skipped (FlashAttention)."""

    name = "dense"


@dataclass(frozen=True)
class SoftmaxSkip(Policy):
    """BLASST: skip a block whose row maxima trail the running maxima by more than ln(a / s_k)."""

    name = "softmax_skip"
    block_q: int = 128
    block_k: int = 128
    a: float = 10.0


@dataclass(frozen=True)
class EstimateSelect(Policy):
    """FlashPrefill V2: mean-pooled key blocks scored by every query row of the tile; keep
    energy >= alpha * peak plus sink/window/tail blocks; optional mean correction. Causal only.

    Chunked prefill (docs/semantics.md §1 and §3.5), all optional: prompt_len, int32 [b], each
    prompt's whole length (tail then counts the prompt's last query tiles, so chunks force the
    one-shot tail once); and a cache of block means kept beside the K/V cache: k_block_means,
    v_block_means [b, h_kv, max_blocks, d] in the input dtype (bfloat16 for float8_e4m3fn inputs) on q's device, with
    block_means_valid, int32 [b], the leading blocks they hold (all three or none). A call reads
    the valid blocks' means, computes the rest, and writes the blocks it completes into the
    cache (in place); set block_means_valid to s_k // block before the next chunk. Index
    tensors are read on the host (CUDA ones are copied there first)."""

    name = "estimate_select"
    _tensor_fields = ("prompt_len", "k_block_means", "v_block_means", "block_means_valid")
    block: int = 128
    alpha: float = 0.1
    sink: int = 2
    window: int = 4
    tail: int = 2
    mean_correction: bool = False
    pack_gqa: bool = False
    prompt_len: Any = None
    k_block_means: Any = None
    v_block_means: Any = None
    block_means_valid: Any = None

    def chunked(self) -> Tuple[Any, Any, Any, Any]:
        """(prompt_len, k_block_means, v_block_means, block_means_valid), None where not given."""
        return self.prompt_len, self.k_block_means, self.v_block_means, self.block_means_valid

    def _make_call_key(self) -> Any:
        # The chunked-prefill tensors change between chunks (valid counts, the cache of means
        # written in place): such calls are validated in full each time.
        if any(x is not None for x in self.chunked()):
            return None
        return super()._make_call_key()


@dataclass(frozen=True)
class PermuteStop(Policy):
    """S2O: queries permuted inside segments, prefix keys visited in ranked order, stop when a
    chunk's share of the softmax mass falls below tau. Causal only."""

    name = "permute_stop"
    segment: int = 2048
    tau: float = 0.005
    block_q: int = 128
    block_k: int = 128


@dataclass(frozen=True, eq=False)
class ExactGate(Policy):
    """BSFA: skip a full block whose exact max of scale*QK^T is below the calibrated threshold
    T[h_q][position]. Give `thresholds` (float32 [h_q, positions]) or a calibration file (or a
    loaded Calibration) with `layer` and `budget` (a budget value of the file, not an index).
    Block sizes default to 128, or to the calibration's."""

    name = "exact_gate"
    _tensor_fields = ("thresholds", "calibration", "layer", "budget")
    block_q: Optional[int] = None
    block_k: Optional[int] = None
    thresholds: Any = None
    calibration: Any = None
    layer: Optional[int] = None
    budget: Optional[int] = None

    def __post_init__(self) -> None:
        if (self.thresholds is None) == (self.calibration is None):
            raise InvalidArgumentError(
                "thresholds: give either a threshold table or calibration= with layer= and budget=")
        if self.calibration is not None and (self.layer is None or self.budget is None):
            raise InvalidArgumentError("layer, budget: both are required with calibration=")
        object.__setattr__(self, "_on_device", {})

    def call_key(self) -> Any:
        # By identity (not memoised: self in its own __dict__ would keep a device table alive
        # until a garbage collection): its table is fixed per device once copied there, and a
        # prepared call checks on each use that the table is the one it was planned with.
        return self

    def _calibration(self) -> Any:
        from .calibration import load_calibration

        cal = self.calibration
        if isinstance(cal, (str, bytes)) or hasattr(cal, "__fspath__"):
            cal = load_calibration(cal)
        return cal

    def settings(self) -> List[Tuple[str, str]]:
        sizes = {"block_q": self.block_q, "block_k": self.block_k}
        if self.calibration is not None:
            cal = self._calibration()
            for key, fitted in (("block_q", cal.gate_block_q), ("block_k", cal.gate_block_k)):
                if sizes[key] is not None and sizes[key] != fitted:
                    raise InvalidArgumentError(
                        f"{key}: the calibration's thresholds were fitted for {fitted}, got {sizes[key]}")
                sizes[key] = fitted
        return [(key, _setting(128 if value is None else value)) for key, value in sizes.items()]

    def table(self) -> Any:
        """The float32 [h_q, positions] table, as given or sliced from the calibration."""
        if self.thresholds is not None:
            return self.thresholds
        return self._calibration().thresholds(self.layer, self.budget)

    def thresholds_like(self, q: Any, h_q: int) -> Any:
        """The table on q's framework and device (cached per device: the copy happens once,
        so that later calls, CUDA graph capture included, find it there)."""
        cache = self._on_device  # type: ignore[attr-defined]
        key = str(q.device) if is_torch(q) else "numpy"
        table = cache.get(key)
        if table is None:
            raw = self.table()
            if is_torch(q):
                import torch

                table = torch.as_tensor(raw).to(device=q.device, dtype=torch.float32).contiguous()
            else:
                if is_torch(raw):
                    raw = raw.detach().cpu().numpy()
                table = np.ascontiguousarray(raw, dtype=np.float32)
            cache[key] = table
        if len(table.shape) != 2 or int(table.shape[0]) != h_q:
            raise InvalidArgumentError(
                f"thresholds: expected float32 [h_q, positions] with h_q {h_q}, got {list(table.shape)}")
        return table


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if is_torch(x):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu" and arr.dtype != np.bool_:
        raise InvalidArgumentError(f"{name}: expected an integer tensor, got {dtype_name(arr)}")
    return arr


@dataclass(frozen=True, eq=False)
class BlockSparse(Policy):
    """Runs a given block mask: listed blocks computed (causal mask inside partial blocks),
    every other block skipped. The mask comes in FlexAttention/FA4 form (kv_num_blocks
    [B, H, num_q_blocks] + kv_indices [B, H, num_q_blocks, max_kv_blocks], with optional
    full_kv_num_blocks/full_kv_indices; B and H may be 1 to broadcast), as CSR (indptr over
    rows (b, h, q_block) row-major, indices), or as a dense bool map [B, H, num_q_blocks,
    num_k_blocks]. H is h_q, or h_kv with per_kv_head=True. Every listed block must be
    causally visible; the library checks the mask against the call's geometry."""

    name = "block_sparse"
    _tensor_fields = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                      "indptr", "indices", "dense", "block_q", "block_k", "per_kv_head")
    kv_num_blocks: Any = None
    kv_indices: Any = None
    full_kv_num_blocks: Any = None
    full_kv_indices: Any = None
    indptr: Any = None
    indices: Any = None
    dense: Any = None
    block_q: int = 128
    block_k: int = 128
    per_kv_head: bool = False

    def __post_init__(self) -> None:
        forms = [self.kv_num_blocks is not None or self.full_kv_num_blocks is not None,
                 self.indptr is not None, self.dense is not None]
        if sum(forms) != 1:
            raise InvalidArgumentError(
                "mask: give exactly one of kv_num_blocks/kv_indices (FlexAttention form), "
                "indptr/indices (CSR) or dense (bool map)")
        if (self.kv_num_blocks is None) != (self.kv_indices is None):
            raise InvalidArgumentError("kv_indices: kv_num_blocks and kv_indices go together")
        if (self.full_kv_num_blocks is None) != (self.full_kv_indices is None):
            raise InvalidArgumentError("full_kv_indices: full_kv_num_blocks and full_kv_indices go together")
        if (self.indptr is None) != (self.indices is None):
            raise InvalidArgumentError("indices: indptr and indices go together")
        object.__setattr__(self, "_csr_cache", {})

    def call_key(self) -> Any:
        # By identity: a call reads its mask through csr(), built once per geometry, or (in
        # place) through the same tensors, whose contents each call reads anew.
        return self

    @classmethod
    def from_block_mask(cls, block_mask: Any, per_kv_head: bool = False) -> "BlockSparse":
        """From a torch FlexAttention BlockMask (torch.nn.attention.flex_attention): its
        kv_num_blocks / kv_indices / full_kv_num_blocks / full_kv_indices and BLOCK_SIZE. On CUDA
        the library reads them in place (no copy, no synchronisation)."""
        block_q, block_k = (int(x) for x in block_mask.BLOCK_SIZE)
        return cls(kv_num_blocks=block_mask.kv_num_blocks, kv_indices=block_mask.kv_indices,
                   full_kv_num_blocks=block_mask.full_kv_num_blocks, full_kv_indices=block_mask.full_kv_indices,
                   block_q=block_q, block_k=block_k, per_kv_head=per_kv_head)

    def in_place(self, q: Any) -> Optional[Tuple[Any, ...]]:
        """For a CUDA call: the mask's tensors as the library reads them in place — (kv_num_blocks,
        kv_indices, full_kv_num_blocks, full_kv_indices, indptr, indices), None for absent ones —
        when they are int32 CUDA tensors on q's device (FlexAttention's are); else None, and the
        mask is read on the host, copied and checked there (a synchronising copy). In place, each
        call reads the tensors' current contents, and the device checks them as it runs
        (sparseprefill.check() reports an offence)."""
        tensors = (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                   self.indptr, self.indices)
        given = [t for t in tensors if t is not None]
        if self.dense is not None or not given or not is_torch(q) or q.device.type != "cuda":
            return None
        import torch

        if not all(is_torch(t) and t.device == q.device and t.dtype == torch.int32 for t in given):
            return None
        return tensors

    def csr(self, batch: int, heads: int, num_q_blocks: int) -> Tuple[np.ndarray, np.ndarray]:
        """(indptr, indices) as host int32 arrays over batch * heads * num_q_blocks rows."""
        key = (batch, heads, num_q_blocks)
        cached = self._csr_cache.get(key)  # type: ignore[attr-defined]
        if cached is None:
            cached = self._build_csr(batch, heads, num_q_blocks)
            self._csr_cache[key] = cached  # type: ignore[attr-defined]
        return cached

    def _build_csr(self, batch: int, heads: int, num_q_blocks: int) -> Tuple[np.ndarray, np.ndarray]:
        if self.indptr is not None:
            indptr = _to_numpy(self.indptr, "indptr").astype(np.int32).reshape(-1)
            indices = _to_numpy(self.indices, "indices").astype(np.int32).reshape(-1)
            rows = batch * heads * num_q_blocks
            if indptr.shape[0] != rows + 1:
                raise InvalidArgumentError(
                    f"indptr: expected {rows + 1} entries (batch {batch} x heads {heads} x "
                    f"num_q_blocks {num_q_blocks} rows + 1), got {indptr.shape[0]}")
            return np.ascontiguousarray(indptr), np.ascontiguousarray(indices)
        if self.dense is not None:
            mask = _to_numpy(self.dense, "dense").astype(bool)
            if mask.ndim != 4:
                raise InvalidArgumentError(
                    f"dense: expected [B, H, num_q_blocks, num_k_blocks], got rank {mask.ndim}")
            mask = self._broadcast(mask, "dense", batch, heads, num_q_blocks)
            rows = mask.reshape(-1, mask.shape[-1])
            counts = rows.sum(axis=1)
            indices = np.nonzero(rows)[1].astype(np.int32)
            indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            return indptr, np.ascontiguousarray(indices)
        parts = []
        for num_name, idx_name in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
            num = getattr(self, num_name)
            if num is None:
                continue
            num = _to_numpy(num, num_name).astype(np.int64)
            idx = _to_numpy(getattr(self, idx_name), idx_name).astype(np.int64)
            if num.ndim != 3:
                raise InvalidArgumentError(f"{num_name}: expected [B, H, num_q_blocks], got rank {num.ndim}")
            if idx.ndim != 4 or idx.shape[:3] != num.shape:
                raise InvalidArgumentError(
                    f"{idx_name}: expected [B, H, num_q_blocks, max_kv_blocks] matching {num_name} "
                    f"{list(num.shape)}, got {list(idx.shape)}")
            if num.min(initial=0) < 0 or num.max(initial=0) > idx.shape[3]:
                raise InvalidArgumentError(f"{num_name}: counts must lie in [0, {idx.shape[3]}]")
            num = self._broadcast(num, num_name, batch, heads, num_q_blocks)
            idx = self._broadcast(idx, idx_name, batch, heads, num_q_blocks)
            valid = np.arange(idx.shape[3]) < num[..., None]
            parts.append(np.where(valid, idx, np.iinfo(np.int64).max))
        sentinel = np.iinfo(np.int64).max
        merged = np.sort(np.concatenate(parts, axis=-1), axis=-1)
        dup = np.zeros_like(merged, dtype=bool)
        dup[..., 1:] = (merged[..., 1:] == merged[..., :-1]) & (merged[..., 1:] != sentinel)
        if dup.any():
            which = "kv_indices and full_kv_indices" if len(parts) > 1 else "kv_indices"
            raise InvalidArgumentError(f"{which}: a key block is listed twice in one row")
        keep = merged != sentinel
        counts = keep.reshape(-1, merged.shape[-1]).sum(axis=1)
        indices = merged[keep]
        if indices.size and (indices.min() < 0 or indices.max() > np.iinfo(np.int32).max):
            raise InvalidArgumentError("kv_indices: block indices must be non-negative int32 values")
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        return indptr, np.ascontiguousarray(indices.astype(np.int32))

    def _broadcast(self, arr: np.ndarray, name: str, batch: int, heads: int, num_q_blocks: int) -> np.ndarray:
        which = "h_kv" if self.per_kv_head else "h_q"
        if arr.shape[0] not in (1, batch):
            raise InvalidArgumentError(f"{name}: expected batch 1 or {batch}, got {arr.shape[0]}")
        if arr.shape[1] not in (1, heads):
            raise InvalidArgumentError(f"{name}: expected 1 or {heads} heads ({which}), got {arr.shape[1]}")
        if arr.shape[2] != num_q_blocks:
            raise InvalidArgumentError(
                f"{name}: expected num_q_blocks {num_q_blocks} (ceil(max s_q / block_q {self.block_q})), "
                f"got {arr.shape[2]}")
        return np.broadcast_to(arr, (batch, heads) + arr.shape[2:])
