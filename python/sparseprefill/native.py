# SPDX-License-Identifier: Apache-2.0
"""The native calls on NumPy arrays (CPU backend) or torch tensors (CPU or CUDA, on the current
stream): run(q, k, v, policy) -> (out, lse, stats, decisions); select(q, k, v, policy) -> the
policy's selection alone (BlockMask) with its density; plan(q, k, v, policy) -> a Plan checked
once and run(plan, q, k, v) many times. Plus the pieces the torch ops and the
FlashAttention-style functions share: host copies of index tensors, policy handles."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _ext, stats as _stats
from ._core import (NO_FEATURES, Features, Geometry, InvalidArgumentError, backend_code, check_problem, check_scale,
                    check_chunk, check_softcap, check_window, descriptor, device_of, is_torch, out_dtype)
from ._ext import UnsupportedError
from .policy import BlockSparse, Dense, EstimateSelect, ExactGate, Policy

__all__ = ["BlockMask", "Decisions", "Plan", "Result", "Selection", "build_info", "can_run", "plan", "run",
           "select"]


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A selection of key blocks as CSR over rows (b, h, q_block) in row-major order: indptr
    int32 [rows + 1], indices int32 (each row's key blocks ascending), rows = batch * heads *
    num_q_blocks, heads = h_q, or h_kv with per_kv_head. density is kept / causally visible
    blocks of the call that produced the mask (None when not known)."""

    indptr: np.ndarray
    indices: np.ndarray
    batch: int
    heads: int
    num_q_blocks: int
    num_k_blocks: int
    block_q: int
    block_k: int
    per_kv_head: bool
    density: Optional[float] = None

    @classmethod
    def from_ext(cls, raw: Optional[dict], density: Optional[float] = None) -> Optional["BlockMask"]:
        if raw is None:
            return None
        return cls(np.frombuffer(raw["indptr"], dtype=np.int32).copy(),
                   np.frombuffer(raw["indices"], dtype=np.int32).copy(), int(raw["batch"]), int(raw["heads"]),
                   int(raw["num_q_blocks"]), int(raw["num_k_blocks"]), int(raw["block_q"]), int(raw["block_k"]),
                   bool(raw["per_kv_head"]), density)

    def counts(self) -> np.ndarray:
        """int32 [batch, heads, num_q_blocks]: blocks selected per row."""
        return np.diff(self.indptr).astype(np.int32).reshape(self.batch, self.heads, self.num_q_blocks)

    def to_dense(self) -> np.ndarray:
        """bool [batch, heads, num_q_blocks, num_k_blocks]: True where a block is selected."""
        dense = np.zeros((self.batch * self.heads * self.num_q_blocks, self.num_k_blocks), dtype=bool)
        rows = np.repeat(np.arange(dense.shape[0]), np.diff(self.indptr))
        dense[rows, self.indices] = True
        return dense.reshape(self.batch, self.heads, self.num_q_blocks, self.num_k_blocks)

    def to_policy(self) -> BlockSparse:
        """A BlockSparse policy that runs exactly this selection."""
        return BlockSparse(indptr=self.indptr, indices=self.indices, block_q=self.block_q, block_k=self.block_k,
                           per_kv_head=self.per_kv_head)


# Columns of Decisions.tiles (sparseprefill::PermuteTile).
TILE_COLUMNS = ("batch", "head", "segment", "tile", "chunks_visited", "chunks_total")


class Decisions(NamedTuple):
    """What a policy decided (sparseprefill::Decisions). kept: the blocks whose keys entered the
    softmax (None for dense runs and for permute_stop); corrected: estimate_select's mean-
    correction blocks (else None); tiles: permute_stop's int32 [n, 6] with TILE_COLUMNS;
    query_order: permute_stop's int32 [batch, h_q, max s_q] (each slot's call-relative row, -1
    past a sequence's end). Both are empty for other policies."""

    policy: str
    kept: Optional[BlockMask]
    corrected: Optional[BlockMask]
    tiles: np.ndarray
    query_order: np.ndarray

    @classmethod
    def from_ext(cls, raw: Optional[dict], geom: Geometry, seq_q_max: int,
                 density: Optional[float] = None) -> Optional["Decisions"]:
        if raw is None:
            return None
        order = np.frombuffer(raw["query_order"], dtype=np.int32).copy()
        if order.size and order.size == geom.batch * geom.h_q * seq_q_max:
            order = order.reshape(geom.batch, geom.h_q, seq_q_max)
        tiles = np.frombuffer(raw["tiles"], dtype=np.int32).copy().reshape(-1, len(TILE_COLUMNS))
        return cls(raw["policy"], BlockMask.from_ext(raw["kept"], density), BlockMask.from_ext(raw["corrected"]),
                   tiles, order)


class Result(NamedTuple):
    out: Any
    lse: Any
    stats: Optional[_stats.CallStats]
    decisions: Optional[Decisions] = None


class Selection(NamedTuple):
    """select()'s answer: the selected blocks (mask.density = kept / visible blocks), the
    mean-correction blocks (estimate_select with mean_correction, else None) and the work
    statistics attending with the selection would have."""

    mask: BlockMask
    corrected: Optional[BlockMask]
    stats: _stats.CallStats


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
                  causal: bool, scale: float, q_descale: Any = None, k_descale: Any = None,
                  v_descale: Any = None, features: Features = NO_FEATURES) -> tuple:
    """The binding's problem tuple: sp_problem's fields in order."""
    return (descriptor(q, "q"), descriptor(k, "k"), descriptor(v, "v"),
            descriptor(cu_q, "cu_seqlens_q"), descriptor(cu_k, "cu_seqlens_k"),
            descriptor(seqused_k, "seqused_k"), descriptor(block_table, "block_table"),
            descriptor(q_descale, "q_descale"), descriptor(k_descale, "k_descale"),
            descriptor(v_descale, "v_descale"), bool(causal), float(scale), *features.fields())


def features_of(window_size: Any = None, softcap: Any = 0.0, sinks: Any = None, attention_chunk: Any = 0) -> Features:
    """The checked model-family features of a call (the sinks' shape and device are checked with
    the problem: check_problem)."""
    return Features(check_window(window_size), check_softcap(softcap), sinks, check_chunk(attention_chunk))


def make_handle(name: str, settings: list, problem: tuple, thresholds: Any = None,
                mask: Optional[Tuple[Any, Any, int, int, bool]] = None,
                chunked: Optional[Tuple[Any, Any, Any, Any]] = None) -> "_ext.PolicyHandle":
    """A library policy handle with its threshold table, block mask and chunked-prefill tensors
    attached. `mask` is (indptr, indices, block_q, block_k, per_kv_head) as host int32 arrays or
    tensors; `chunked` is estimate_select's (prompt_len, k_block_means, v_block_means,
    block_means_valid) as chunked_parts returns them."""
    handle = _ext.PolicyHandle(name, settings)
    if thresholds is not None:
        handle.set_thresholds(descriptor(thresholds, "thresholds"), thresholds)
    if chunked is not None:
        names = ("prompt_len", "k_block_means", "v_block_means", "block_means_valid")
        handle.set_chunked(*(descriptor(x, n) for x, n in zip(chunked, names)), chunked)
    if isinstance(mask, InPlaceMask):
        names = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "indptr", "indices")
        handle.set_device_block_mask(*(descriptor(x, n) for x, n in zip(mask.tensors, names)), int(mask.block_q),
                                     int(mask.block_k), bool(mask.per_kv_head), mask.tensors)
    elif mask is not None:
        indptr, indices, block_q, block_k, per_kv_head = mask
        handle.set_block_mask(problem, int(block_q), int(block_k), bool(per_kv_head),
                              int(indptr.shape[0]) - 1, _ptr(indptr), int(indices.shape[0]), _ptr(indices))
    return handle


class InPlaceMask(NamedTuple):
    """A BlockSparse mask the library reads where it is (BlockSparse.in_place)."""

    tensors: tuple
    block_q: int
    block_k: int
    per_kv_head: bool


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
        in_place = policy.in_place(q)
        if in_place is not None:
            return thresholds, InPlaceMask(in_place, policy.block_q, policy.block_k, policy.per_kv_head)
        heads = geom.h_kv if policy.per_kv_head else geom.h_q
        num_q_blocks = math.ceil(seq_q_max / policy.block_q)
        indptr, indices = policy.csr(geom.batch, heads, num_q_blocks)
        mask = (indptr, indices, policy.block_q, policy.block_k, policy.per_kv_head)
    return thresholds, mask


def chunked_parts(policy: Policy) -> Optional[Tuple[Any, Any, Any, Any]]:
    """estimate_select's chunked-prefill tensors as the library reads them: (prompt_len,
    k_block_means, v_block_means, block_means_valid) with the index tensors as host copies, or
    None when the policy gives none."""
    if not isinstance(policy, EstimateSelect) or all(x is None for x in policy.chunked()):
        return None
    prompt_len, k_means, v_means, valid = policy.chunked()
    return host_index(prompt_len), k_means, v_means, host_index(valid)


@contextlib.contextmanager
def device_guard(q: Any):
    """Makes q's CUDA device current (when another one is) and yields the current stream's raw
    handle (0 on the CPU)."""
    if is_torch(q) and q.is_cuda:
        import torch

        index = q.get_device()
        if torch.cuda.current_device() == index:
            yield torch._C._cuda_getCurrentRawStream(index)
        else:
            with torch.cuda.device(index):
                yield torch._C._cuda_getCurrentRawStream(index)
    else:
        yield 0


def capturing(q: Any) -> bool:
    if is_torch(q) and q.device.type == "cuda":
        import torch

        return torch.cuda.is_current_stream_capturing()
    return False


def _call(q: Any, want_stats: bool, want_decisions: bool, layer: Optional[int], describe: Any,
          launch: Any) -> Tuple[Optional[_stats.CallStats], Optional[dict]]:
    """Runs launch(stream, read_stats) on q's device and current stream, where launch returns
    (raw stats or None, raw decisions or None); records the stats into open collectors. Under
    CUDA graph capture nothing is read back (that would need a host synchronisation): no
    statistics, collectors record nothing, and decisions raise UnsupportedError."""
    capture = capturing(q)
    if capture and want_decisions:
        raise UnsupportedError("decisions: cannot be read back while a CUDA graph is being captured")
    record = _stats.collecting() and not capture
    with device_guard(q) as stream:
        raw, decisions = launch(stream, (want_stats or record) and not capture)
    if raw is None:
        return None, decisions
    call = _stats.CallStats.from_ext(raw, layer, describe())
    if record:
        _stats.record(call)
    return (call if want_stats else None), decisions


def execute(problem: tuple, handle: "_ext.PolicyHandle", q: Any, out: Any, lse: Any, backend: int,
            num_threads: int, want_stats: bool, layer: Optional[int]) -> Optional[_stats.CallStats]:
    """One sp_run on q's device and current stream; records stats into open collectors. Under
    CUDA graph capture no statistics are read back (that would need a host synchronisation):
    the call returns None and collectors record nothing. A captured call needs an earlier,
    uncaptured call of the same shapes and tensors (its metadata is then cached on the device);
    otherwise the library raises UnsupportedError."""
    def launch(stream: int, read_stats: bool) -> tuple:
        return _ext.run(problem, handle, descriptor(out, "out"), descriptor(lse, "lse"), backend, num_threads,
                        stream, read_stats), None

    return _call(q, want_stats, False, layer, handle.describe, launch)[0]


def _empty(like: Any, shape: Tuple[int, ...], float32: bool) -> Any:
    if is_torch(like):
        import torch

        return torch.empty(shape, dtype=torch.float32 if float32 else out_dtype(like), device=like.device)
    return np.empty(shape, dtype=np.float32 if float32 else out_dtype(like))


def _prepare(q: Any, k: Any, v: Any, policy: Optional[Policy], causal: bool, softmax_scale: Optional[float],
             cu_seqlens_q: Any, cu_seqlens_k: Any, seqused_k: Any, block_table: Any, descales: tuple,
             features: Features, out: Any = None, lse: Any = None) -> tuple:
    """(geometry, problem tuple, policy handle, host index copies, thresholds, max s_q): the
    checks and conversions every native entry point runs first. descales: (q_descale,
    k_descale, v_descale)."""
    policy = Dense() if policy is None else policy
    geom = check_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, block_table, out, lse, *descales,
                         features.sinks)
    scale = check_scale(softmax_scale)
    hosts = tuple(host_index(x) for x in (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table))
    problem = problem_tuple(q, k, v, *hosts, causal, scale, *descales, features)
    seq_q_max = max_seq_q(q, hosts[0])
    thresholds, mask = policy_parts(policy, q, geom, seq_q_max)
    handle = make_handle(policy.name, policy.settings(), problem, thresholds, mask, chunked_parts(policy))
    return geom, problem, handle, hosts, thresholds, seq_q_max


def _threads(num_threads: int) -> int:
    if int(num_threads) < 0:
        raise InvalidArgumentError(f"num_threads: expected >= 0 (0 = every core), got {num_threads}")
    return int(num_threads)


def _outputs(q: Any, geom: Geometry, out: Any, lse: Any) -> Tuple[Any, Any]:
    return (_empty(q, tuple(geom.out_shape), False) if out is None else out,
            _empty(q, geom.lse_shape, True) if lse is None else lse)


def _run(q: Any, k: Any, v: Any, policy: Optional[Policy] = None, *, causal: bool = True,
         softmax_scale: Optional[float] = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
         seqused_k: Any = None, block_table: Any = None, q_descale: Any = None, k_descale: Any = None,
         v_descale: Any = None, window_size: Any = (-1, -1), softcap: float = 0.0, sinks: Any = None,
         attention_chunk: int = 0, out: Any = None, lse: Any = None, backend: str = "auto", num_threads: int = 0,
         stats: bool = True,
         decisions: bool = False, layer: Optional[int] = None) -> Result:
    code = backend_code(backend)
    threads = _threads(num_threads)
    geom, problem, handle, _, _, seq_q_max = _prepare(q, k, v, policy, causal, softmax_scale, cu_seqlens_q,
                                                      cu_seqlens_k, seqused_k, block_table,
                                                      (q_descale, k_descale, v_descale),
                                                      features_of(window_size, softcap, sinks, attention_chunk), out,
                                                      lse)
    out, lse = _outputs(q, geom, out, lse)
    if not decisions:
        return Result(out, lse, execute(problem, handle, q, out, lse, code, threads, stats, layer))

    def launch(stream: int, read_stats: bool) -> tuple:
        return _ext.run_decisions(problem, handle, descriptor(out, "out"), descriptor(lse, "lse"), code, threads,
                                  stream, read_stats)

    call, raw = _call(q, stats, True, layer, handle.describe, launch)
    return Result(out, lse, call, Decisions.from_ext(raw, geom, seq_q_max, call.density if call else None))


def run(*args: Any, **kwargs: Any) -> Result:
    """Attention, in two call styles:

    run(q, k, v, policy=None, *, causal=True, softmax_scale=None, cu_seqlens_q=None,
        cu_seqlens_k=None, seqused_k=None, block_table=None, q_descale=None, k_descale=None,
        v_descale=None, window_size=(-1, -1), softcap=0.0, sinks=None, attention_chunk=0, out=None,
        lse=None, backend="auto", num_threads=0, stats=True, decisions=False, layer=None)
      under `policy` (Dense() by default) in FlashAttention's layouts: batched q [b, s_q, h_q, d]
      with k [b, s_k, h_kv, d] and v [b, s_k, h_kv, d_v]; varlen q [total_q, h_q, d] with
      cu_seqlens_q, and k, v [total_k, h_kv, d or d_v] with cu_seqlens_k or paged
      [num_pages, page_size, h_kv, d or d_v] with block_table and seqused_k; out has q's shape
      with d_v last. Causal is bottom-right aligned. The model-family features
      (docs/semantics.md §1; the reference and cpu backends run them, CUDA runs window_size
      under Dense and BlockSparse and raises UnsupportedError naming each other one):
      window_size FlashAttention's (left, right), -1 no bound,
      intersected with causal; softcap c > 0 caps every score to c * tanh(s / c); sinks float32
      [h_q] on q's device, one logit per query head added to every row's softmax denominator
      (gpt-oss), in out and lse; attention_chunk C > 0 (FlashAttention's, Llama 4) keeps each
      query to the keys of its own chunk of C positions (CUDA: under Dense and BlockSparse, as
      window_size). backend is "auto",
      "reference" (the fp64 oracle), "cpu" or "cuda". FP8 inputs (torch.float8_e4m3fn q, k and
      v; every policy on the host backends; on CUDA, a 9.0 device: dense, block_sparse,
      exact_gate and softmax_skip at head_dim 128 and 256, estimate_select without mean
      correction at 128) may take float32 descales [b, h_kv]: attention
      runs on q * q_descale[b, h // group], k * k_descale[b, kv head], v * v_descale[b, kv head]
      (an absent descale is 1), and out is bfloat16.

    run(plan, q, k, v, *, cu_seqlens_q=None, ..., q_descale=None, ..., out=None, lse=None,
        num_threads=0, stats=True, decisions=False, layer=None)
      with a Plan from plan(): same shapes as the plan's (checked), the plan's policy, causal,
      scale, window, softcap, sinks and backend, no re-validation of the policy and (CUDA) no
      mask upload.

    Returns (out, lse, stats, decisions): out in q's layout with d_v last and q's dtype
    (bfloat16 for FP8), lse float32 [b, h_q, s_q] (varlen: [h_q, total_q]), stats a CallStats
    (None with stats=False or under CUDA graph capture), decisions a Decisions with
    decisions=True (reading them back synchronises the CUDA stream, and is refused under
    capture), else None."""
    if args and isinstance(args[0], Plan):
        return args[0].run(*args[1:], **kwargs)
    return _run(*args, **kwargs)


def select(q: Any, k: Any, v: Any, policy: Optional[Policy] = None, *, causal: bool = True,
           softmax_scale: Optional[float] = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
           seqused_k: Any = None, block_table: Any = None, q_descale: Any = None, k_descale: Any = None,
           v_descale: Any = None, window_size: Any = (-1, -1), softcap: float = 0.0, sinks: Any = None,
           attention_chunk: int = 0, backend: str = "auto", num_threads: int = 0, layer: Optional[int] = None,
           device: bool = False) -> Any:
    """The policy's selector alone, no attention: Selection(mask, corrected, stats). Dense
    selects every visible block (128 x 128 blocks), BlockSparse its own mask, EstimateSelect
    what its selector keeps (on CUDA the GPU selector's device mask, copied back: this
    synchronises the stream). ExactGate, SoftmaxSkip and PermuteStop decide during attention:
    UnsupportedError (use run(..., decisions=True)). Arguments as run().

    device=True (EstimateSelect, CUDA tensors): a DeviceSelection instead, the selection left on
    the device in FlexAttention's form with no synchronisation (capturable)."""
    code = backend_code(backend)
    threads = _threads(num_threads)
    geom, problem, handle, _, _, seq_q_max = _prepare(q, k, v, policy, causal, softmax_scale, cu_seqlens_q,
                                                      cu_seqlens_k, seqused_k, block_table,
                                                      (q_descale, k_descale, v_descale),
                                                      features_of(window_size, softcap, sinks, attention_chunk))
    if device:
        return _select_on_device(q, geom, problem, handle, policy, code, seq_q_max, cu_seqlens_k, seqused_k,
                                 block_table, k)
    if capturing(q):
        raise UnsupportedError("select: reads its mask back to the host, which CUDA graph capture forbids")
    with device_guard(q) as stream:
        raw_stats, raw = _ext.select(problem, handle, code, threads, stream)
    call = _stats.CallStats.from_ext(raw_stats, layer, handle.describe())
    found = Decisions.from_ext(raw, geom, seq_q_max, call.density)
    return Selection(found.kept, found.corrected, call)


class DeviceSelection(NamedTuple):
    """select(..., device=True)'s answer: estimate_select's selection on the device in
    FlexAttention's form, int32 (blocks of 128: q_blocks = ceil(max s_q / 128), k_blocks =
    ceil(max s_k / 128); heads = h_q, or h_kv with pack_gqa): kv_num_blocks / kv_indices the
    blocks the causal mask cuts, full_kv_* the others; entries past a row's count undefined."""

    kv_num_blocks: Any      # [batch, heads, q_blocks]
    kv_indices: Any         # [batch, heads, q_blocks, k_blocks]
    full_kv_num_blocks: Any
    full_kv_indices: Any
    block: int
    per_kv_head: bool

    def to_policy(self) -> BlockSparse:
        """A BlockSparse policy that runs this selection where it is (no copy)."""
        return BlockSparse(kv_num_blocks=self.kv_num_blocks, kv_indices=self.kv_indices,
                           full_kv_num_blocks=self.full_kv_num_blocks, full_kv_indices=self.full_kv_indices,
                           block_q=128, block_k=self.block, per_kv_head=self.per_kv_head)

    def to_host(self) -> BlockMask:
        """The selection as a host BlockMask (CSR; copies and synchronises)."""
        batch, heads, q_blocks = (int(x) for x in self.kv_num_blocks.shape)
        indptr, indices = self.to_policy().csr(batch, heads, q_blocks)
        return BlockMask(indptr, indices, batch, heads, q_blocks, int(self.kv_indices.shape[3]), 128, self.block,
                         self.per_kv_head)

    def block_mask(self, q_len: int, kv_len: int) -> Any:
        """The selection as torch's FlexAttention BlockMask (BlockMask.from_kv_blocks), for
        flex_attention with the same blocks."""
        from torch.nn.attention.flex_attention import BlockMask as FlexBlockMask

        return FlexBlockMask.from_kv_blocks(self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks,
                                            self.full_kv_indices, BLOCK_SIZE=(128, self.block),
                                            seq_lengths=(q_len, kv_len))


def _select_on_device(q: Any, geom: Geometry, problem: tuple, handle: Any, policy: Any, code: int, seq_q_max: int,
                      cu_seqlens_k: Any, seqused_k: Any, block_table: Any, k: Any) -> DeviceSelection:
    if not isinstance(policy, EstimateSelect):
        raise UnsupportedError("select(device=True): estimate_select's selection only (dense and block_sparse need "
                               "none; the gates and permute_stop decide inside attention)")
    if not is_torch(q) or q.device.type != "cuda":
        raise InvalidArgumentError("q: select(device=True) needs CUDA tensors")
    import torch

    heads = geom.h_kv if policy.pack_gqa else geom.h_q
    block = policy.block
    max_k = _max_keys(k, geom, cu_seqlens_k, seqused_k, block_table)
    q_blocks, k_blocks = math.ceil(seq_q_max / block), math.ceil(max_k / block)
    counts = [torch.empty((geom.batch, heads, q_blocks), dtype=torch.int32, device=q.device) for _ in range(2)]
    indices = [torch.empty((geom.batch, heads, q_blocks, k_blocks), dtype=torch.int32, device=q.device)
               for _ in range(2)]
    with device_guard(q) as stream:
        _ext.select_into(problem, handle, code, stream, descriptor(counts[0], "kv_num_blocks"),
                         descriptor(indices[0], "kv_indices"), descriptor(counts[1], "full_kv_num_blocks"),
                         descriptor(indices[1], "full_kv_indices"), bool(policy.pack_gqa), int(block))
    return DeviceSelection(counts[0], indices[0], counts[1], indices[1], int(block), bool(policy.pack_gqa))


def _max_keys(k: Any, geom: Geometry, cu_seqlens_k: Any, seqused_k: Any, block_table: Any) -> int:
    """The longest sequence's keys (host index tensors are read; CUDA ones are copied)."""
    if seqused_k is not None:
        return int(host_index(seqused_k).max()) if geom.batch else 0
    if cu_seqlens_k is not None:
        cu = host_index(cu_seqlens_k)
        return int((cu[1:] - cu[:-1]).max()) if geom.batch else 0
    return int(k.shape[1])


def check() -> None:
    """Raises InvalidArgumentError for the first offence a device check of a block mask read in
    place found on the current CUDA device since the last report (then clears it); synchronises
    the device. Calls that synchronise anyway (decisions, select to the host, plans) report one
    too."""
    import torch

    _ext.check_device_errors(torch.cuda.current_device() if torch.cuda.is_available() else 0)


class Plan:
    """A problem shape and a policy checked once (plan()), for many run(plan, q, k, v) calls:
    on CUDA a BlockSparse mask is compacted and uploaded once into device memory the plan owns,
    so a call does no host work on the mask, and a batched call with contiguous out and lse can
    be captured into a CUDA graph without a warm-up call of its shape (dense on Hopper
    excepted: its tensor maps are cached by a first uncaptured call). The plan keeps the policy and its threshold
    table alive. Immutable; calls from several threads may share it.

    With torch tensors, stats=False and decisions=False, the plan also keeps the last call it
    checked in full (its key: shapes, strides, dtypes, devices, index contents, out and lse
    layouts, num_threads) bound to its descriptors: a call with that key skips every check and
    conversion and runs with the data pointers patched (docs/python.md, "Prepared calls")."""

    def __init__(self, handle: "_ext.PlanHandle", geom: Geometry, policy: Policy, causal: bool, scale: float,
                 features: Features, backend: int, device: Tuple[str, int]) -> None:
        self._handle = handle
        self._geom = geom
        self.policy = policy
        self.causal = causal
        self._scale = scale
        self._features = features
        self._backend = backend
        self._device = device
        # (key, _fastpath.Entry) of the last call checked in full on the lean path.
        self._prepared: Optional[tuple] = None

    def describe(self) -> str:
        """The plan's policy in one line (its name and every parameter)."""
        return self._handle.describe()

    def run(self, q: Any, k: Any, v: Any, *, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
            seqused_k: Any = None, block_table: Any = None, q_descale: Any = None, k_descale: Any = None,
            v_descale: Any = None, out: Any = None, lse: Any = None, num_threads: int = 0, stats: bool = True,
            decisions: bool = False, layer: Optional[int] = None) -> Result:
        """run(plan, q, k, v, ...): see run()."""
        descales = (q_descale, k_descale, v_descale)
        index = (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table)
        lean = not stats and not decisions and not _stats.collecting() and is_torch(q)
        key = None
        if lean:
            fast = _fastpath()
            key = fast.plan_key(q, k, v, index, descales, out, lse, num_threads)
            prepared = self._prepared
            if prepared is not None and key == prepared[0]:
                out, lse = fast.run(prepared[1], q, k, v, out, lse, descales, self._features.sinks)
                return Result(out, lse, None, None)
        threads = _threads(num_threads)
        geom = check_problem(q, k, v, *index, out, lse, *descales)
        if device_of(q) != self._device:
            raise InvalidArgumentError(f"q: the plan was made for device {self._device}, got {device_of(q)}")
        hosts = tuple(host_index(x) for x in index)
        problem = problem_tuple(q, k, v, *hosts, self.causal, self._scale, *descales, self._features)
        out, lse = _outputs(q, geom, out, lse)

        def launch(stream: int, read_stats: bool) -> tuple:
            return self._handle.run(problem, descriptor(out, "out"), descriptor(lse, "lse"), self._backend, threads,
                                    stream, read_stats, decisions)

        call, raw = _call(q, stats, decisions, layer, self._handle.describe, launch)
        if key is not None:
            # Checked in full and run: calls with this key may skip both from now on.
            entry = fast.bind(self._handle, q, k, v, hosts, descales, self.causal, self._scale, self._features, out,
                              lse, self._backend, threads, ())
            self._prepared = (key, entry)
        found = Decisions.from_ext(raw, geom, max_seq_q(q, hosts[0]), call.density if call else None)
        return Result(out, lse, call, found)


_FAST: Any = None


def _fastpath() -> Any:
    """The torch side of the fast path (_fastpath.py), imported on first use: the module
    imports torch, which a NumPy-only caller never loads."""
    global _FAST
    if _FAST is None:
        from . import _fastpath as fast

        _FAST = fast
    return _FAST


def plan(q: Any, k: Any, v: Any, policy: Optional[Policy] = None, *, causal: bool = True,
         softmax_scale: Optional[float] = None, cu_seqlens_q: Any = None, cu_seqlens_k: Any = None,
         seqused_k: Any = None, block_table: Any = None, q_descale: Any = None, k_descale: Any = None,
         v_descale: Any = None, window_size: Any = (-1, -1), softcap: float = 0.0, sinks: Any = None,
         attention_chunk: int = 0, backend: str = "auto") -> Plan:
    """A Plan for calls shaped like (q, k, v) under `policy`: shapes, layout, sequence lengths,
    dtype and device are fixed (run(plan, ...) checks them and names the first difference);
    the tensors' contents are not read. Arguments as run(); the plan keeps the window, chunks,
    softcap and sinks (whose values its calls read as they run). Make plans outside CUDA graph
    capture."""
    code = backend_code(backend)
    scale = check_scale(softmax_scale)
    features = features_of(window_size, softcap, sinks, attention_chunk)
    geom, problem, handle, _, thresholds, _ = _prepare(q, k, v, policy, causal, softmax_scale, cu_seqlens_q,
                                                       cu_seqlens_k, seqused_k, block_table,
                                                       (q_descale, k_descale, v_descale), features)
    if capturing(q):
        raise UnsupportedError("plan: allocates and uploads device memory; make plans before CUDA graph capture")
    with device_guard(q) as stream:
        plan_handle = _ext.PlanHandle(problem, handle, code, stream, thresholds)
    return Plan(plan_handle, geom, Dense() if policy is None else policy, bool(causal), scale, features, code,
                device_of(q))


def can_run(q: Any, k: Any, v: Any, policy: Optional[Policy] = None, *, causal: bool = True,
            backend: str = "auto", **layout: Any) -> Tuple[bool, str]:
    """(True, "") when `backend` runs this call; otherwise (False, what is compiled). layout: the
    index tensors, softmax_scale, the FP8 descales, window_size, softcap, sinks and
    attention_chunk, as run()
    takes them."""
    policy = Dense() if policy is None else policy
    names = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "block_table")
    descale_names = ("q_descale", "k_descale", "v_descale")
    feature_names = ("window_size", "softcap", "sinks", "attention_chunk")
    unknown = set(layout) - set(names) - set(descale_names) - set(feature_names) - {"softmax_scale"}
    if unknown:
        raise InvalidArgumentError(f"{sorted(unknown)[0]}: unexpected argument")
    descales = tuple(layout.get(n) for n in descale_names)
    features = features_of(layout.get("window_size"), layout.get("softcap"), layout.get("sinks"),
                           layout.get("attention_chunk"))
    geom = check_problem(q, k, v, *(layout.get(n) for n in names), None, None, *descales, features.sinks)
    host = [host_index(layout.get(n)) for n in names]
    problem = problem_tuple(q, k, v, *host, causal, check_scale(layout.get("softmax_scale")), *descales, features)
    thresholds, mask = policy_parts(policy, q, geom, max_seq_q(q, host[0]))
    handle = make_handle(policy.name, policy.settings(), problem, thresholds, mask, chunked_parts(policy))
    code, message = _ext.can_run(problem, handle, backend_code(backend))
    return code == 0, message
