# SPDX-License-Identifier: Apache-2.0
"""The vLLM 0.26 attention backend (registered as CUSTOM by sparseprefill.vllm.register).

It is vLLM's FlashAttention backend (same KV cache shape, layout and cache write, the same
FLASH_ATTN kernels for decodes and short prefills) with one change: in steps that hold long
prefills (or prefill chunks), those requests run the configured policy through
sparseprefill.flash_attn_interface.flash_attn_varlen_func over views of vLLM's paged cache
(no copy), writing vLLM's output rows in place. Every decision lives in the pure modules:
config (the configuration, which layers run ours) and batch (which requests do).

Per step, the metadata builder splits the batch (batch.split_batch) and builds FLASH_ATTN's
metadata for the dense runs - or for the whole batch when no request is sparse, which leaves
FLASH_ATTN's decode path and its CUDA graphs as they are - plus host copies of the sparse runs'
index tensors (one device-to-host copy per run and step, instead of one per layer). Attention
runs eagerly in mixed steps (the builder declares UNIFORM_SINGLE_TOKEN_DECODE, so FULL CUDA
graphs are captured for pure-decode steps only), as our calls read those indices on the host.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl, FlashAttentionMetadata,
                                                   FlashAttentionMetadataBuilder)
from vllm.v1.kv_cache_interface import AttentionSpec

import sparseprefill as sp
from sparseprefill.flash_attn_interface import flash_attn_varlen_func

from .batch import SparseRun, flex_lists, split_batch, synthetic_mask
from .config import LayerDecision, LayerSpec, SyntheticDensity, decide_layer, layer_policy, parse_config

__all__ = ["SparsePrefillBackend", "SparsePrefillImpl", "SparsePrefillMetadataBuilder", "SparsePrefillMetadata",
           "current_config", "use_config"]

logger = init_logger("vllm.sparseprefill")


class _State:
    """The process's configuration (every layer of a process reads one), and a generation that
    use_config() bumps so that layers decide again."""

    raw: Any = None
    config = parse_config(None)
    generation = 0


def use_config(additional_config: Any, force: bool = False, num_layers: Optional[int] = None) -> None:
    """Makes additional_config["sparseprefill"] the process's configuration (raising ValueError
    naming the bad key, before anything changes), when it differs from the current one or with
    force; num_layers: the model's, to check the layers it names. The impls call it with the
    engine's additional_config at model construction; the worker extension
    (sparseprefill.vllm.worker) calls it between steps to switch settings in a running engine."""
    raw = (additional_config or {}).get("sparseprefill") if isinstance(additional_config, dict) else additional_config
    if not force and raw == _State.raw and _State.generation:
        return
    config = parse_config(additional_config)
    if num_layers is not None:
        config.check_model(num_layers)
    _State.raw, _State.config, _State.generation = raw, config, _State.generation + 1
    logger.setLevel(config.log_level.upper())


def current_config() -> Any:
    """The process's SparsePrefillConfig."""
    return _State.config


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class _LayerPlan:
    """One layer's decision on this rank, and what it runs when sparse: a Policy (its
    per-rank thresholds included), or SyntheticDensity (masks made per step)."""

    generation: int
    decision: LayerDecision
    policy: Any = None


@dataclass(frozen=True)
class _SparseCall:
    """One sparse run as our call takes it: host int32 index tensors."""

    run: SparseRun
    cu_seqlens_q: torch.Tensor  # [n + 1]
    seqused_k: torch.Tensor  # [n]
    block_table: torch.Tensor  # [n, pages]


@dataclass
class SparsePrefillMetadata:
    """fa_full: FLASH_ATTN's metadata for the whole batch (when no request is sparse, or when a
    layer of this group runs FLASH_ATTN for every row); dense: ((token rows, FLASH_ATTN's metadata
    of that run)); sparse: our calls. masks: the benchmark setting's masks, made by the first
    layer of the step that needs one and shared by the rest (key: run index, density, block)."""

    fa_full: Optional[FlashAttentionMetadata]
    dense: Tuple[Tuple[Tuple[int, int], FlashAttentionMetadata], ...] = ()
    sparse: Tuple[_SparseCall, ...] = ()
    masks: Dict[Tuple[int, float, int], sp.BlockSparse] = field(default_factory=dict)

    def synthetic(self, index: int, setting: SyntheticDensity, device: torch.device) -> sp.BlockSparse:
        """The run's mask on `device` in FlexAttention's form, which the library reads in place: a
        host mask would be planned on the host by the step's first layer while the GPU waits (33 ms
        at 130K tokens; record vllm/2026-12-02-h200-session-a)."""
        key = (index, setting.density, setting.block)
        mask = self.masks.get(key)
        if mask is None:
            run = self.sparse[index].run
            counts, indices = flex_lists(synthetic_mask(run.query_lens, run.seqused_k, setting.block, setting.density))
            on_device = [torch.from_numpy(x).pin_memory().to(device, non_blocking=True) for x in (counts, indices)]
            mask = self.masks[key] = sp.BlockSparse(kv_num_blocks=on_device[0], kv_indices=on_device[1],
                                                    block_q=setting.block, block_k=setting.block)
        return mask


def _attention_chunk(layer: torch.nn.Module) -> Optional[int]:
    """A ChunkedLocalAttention layer's chunk (vLLM sets attention_chunk_size on it), else None."""
    chunk = getattr(layer, "attention_chunk_size", None)
    return int(chunk) if chunk else None


def _kv_views(kv_cache: torch.Tensor, head_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM's (num_blocks, h_kv, block_size, 2 d) cache -> K, V views [num_blocks, block_size,
    h_kv, d] (no copy: head stride 2 d, V at offset d), size-1 strides made canonical as FLASH_ATTN
    makes them (h_kv = 1 under wide tensor parallelism)."""
    k, v = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return canonicalize_singleton_dim_strides(k), canonicalize_singleton_dim_strides(v)


class SparsePrefillImpl(FlashAttentionImpl):
    """FLASH_ATTN's impl (its KV cache write included) whose forward hands the sparse runs of a
    step to our policy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is not None:
            use_config(vllm_config.additional_config)
            self._model = vllm_config.model_config
        else:
            self._model = None
        self._plan: Optional[_LayerPlan] = None

    def layer_spec(self, layer_name: str, dtype: torch.dtype, attention_chunk: Optional[int] = None) -> LayerSpec:
        window = None if self.sliding_window in (None, (-1, -1)) else self.sliding_window[0] + 1
        model = self._model
        return LayerSpec(index=extract_layer_index(layer_name), head_size=self.head_size, dtype=_dtype_name(dtype),
                         kv_cache_dtype=str(self.kv_cache_dtype), sliding_window=window,
                         attn_type=getattr(self.attn_type, "value", str(self.attn_type)),
                         logits_soft_cap=float(self.logits_soft_cap or 0.0), alibi=self.alibi_slopes is not None,
                         sinks=self.sinks is not None, dcp_world_size=self.dcp_world_size,
                         rswa_window=getattr(model, "rswa_window", None) if model is not None else None,
                         mm_prefix=bool(getattr(model, "is_mm_prefix_lm", False)) if model is not None else False,
                         attention_chunk=attention_chunk)

    def plan(self, layer_name: str, dtype: torch.dtype, device: torch.device, block_size: int,
             attention_chunk: Optional[int] = None) -> _LayerPlan:
        """This layer's decision (made once per configuration, logged in one line); attention_chunk:
        the layer's (ChunkedLocalAttention.attention_chunk_size), which the impl does not see."""
        if self._plan is not None and self._plan.generation == _State.generation:
            return self._plan
        config = _State.config
        spec = self.layer_spec(layer_name, dtype, attention_chunk)
        built: Dict[str, Any] = {}

        def probe() -> Optional[str]:
            built["policy"], _ = layer_policy(config, spec.index, self.num_heads,
                                              get_tensor_model_parallel_world_size(),
                                              get_tensor_model_parallel_rank())
            return self._refusal(built["policy"], dtype, device, block_size)

        decision = decide_layer(config, spec, probe)
        (logger.info if decision.sparse else logger.warning)(decision.log_line())
        self._plan = _LayerPlan(_State.generation, decision, built.get("policy") if decision.sparse else None)
        return self._plan

    def _refusal(self, policy: Any, dtype: torch.dtype, device: torch.device, block_size: int) -> Optional[str]:
        """The library's answer (sp.can_run) for a one-token paged call laid out as this layer's
        cache: dtype, head dim, heads, page size and strides, under this layer's policy."""
        shape = SparsePrefillBackend.get_kv_cache_shape(1, block_size, self.num_kv_heads, self.head_size)
        order = SparsePrefillBackend.get_kv_cache_stride_order()
        raw = torch.zeros([shape[i] for i in order], dtype=dtype, device=device)
        k, v = _kv_views(raw.permute(*[order.index(i) for i in range(len(order))]), self.head_size)
        q = torch.zeros(1, self.num_heads, self.head_size, dtype=dtype, device=device)
        if isinstance(policy, SyntheticDensity):
            policy = sp.BlockSparse(dense=np.ones((1, 1, 1, 1), dtype=bool), block_q=policy.block, block_k=policy.block)
        one = torch.ones(1, dtype=torch.int32)
        ok, message = sp.can_run(q, k, v, policy, causal=True, softmax_scale=self.scale,
                                 cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seqused_k=one,
                                 block_table=torch.zeros(1, 1, dtype=torch.int32))
        return None if ok else message

    def forward(self, layer: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Optional[SparsePrefillMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query [tokens, h_q, d], key/value [tokens, h_kv, d] (already in the cache), output
        [tokens, h_q, d] written in place; kv_cache [num_blocks, h_kv, block_size, 2 d]."""
        if attn_metadata is None:  # vLLM's profiling run
            return super().forward(layer, query, key, value, kv_cache, None, output, output_scale, output_block_scale)
        m = attn_metadata
        plan = self.plan(layer.layer_name, query.dtype, query.device, kv_cache.shape[2], _attention_chunk(layer))
        if not m.sparse or not plan.decision.sparse:
            return super().forward(layer, query, key, value, kv_cache, m.fa_full, output, output_scale,
                                   output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("sparseprefill: fused output quantization is not supported")
        for (t0, t1), fa in m.dense:
            super().forward(layer, query[t0:t1], key[t0:t1], value[t0:t1], kv_cache, fa, output[t0:t1])
        k, v = _kv_views(kv_cache, self.head_size)
        for i, call in enumerate(m.sparse):
            t0, t1 = call.run.tokens
            policy = m.synthetic(i, plan.policy, query.device) if isinstance(plan.policy, SyntheticDensity) \
                else plan.policy
            flash_attn_varlen_func(query[t0:t1], k, v, call.cu_seqlens_q, None, call.run.max_seqlen_q,
                                   softmax_scale=self.scale, causal=True, block_table=call.block_table,
                                   seqused_k=call.seqused_k, out=output[t0:t1], policy=policy,
                                   layer=plan.decision.layer)
        return output


def _own_schedule(meta: FlashAttentionMetadata, builder: FlashAttentionMetadataBuilder) -> FlashAttentionMetadata:
    # With FULL CUDA graphs FLASH_ATTN's builder writes every schedule into one persistent
    # buffer and returns a view of it; a step that builds several metadata (one per dense run,
    # and the whole batch's) must keep a copy of each but the last, or they would share it.
    persistent = getattr(builder, "scheduler_metadata", None)
    sched = meta.scheduler_metadata
    if persistent is not None and sched is not None and sched.untyped_storage().data_ptr() == \
            persistent.untyped_storage().data_ptr():
        meta.scheduler_metadata = sched.clone()
    return meta


class SparsePrefillMetadataBuilder(AttentionMetadataBuilder[SparsePrefillMetadata]):
    """FLASH_ATTN's builder for what runs dense, plus the batch split for what runs ours."""

    _cudagraph_support = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list, vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.fa = FlashAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes (one query) first in the V1 model runner's order; MRV2 sorts them first anyway.
        self._init_reorder_batch_threshold(1)
        use_config(vllm_config.additional_config)
        current_config().check_model(vllm_config.model_config.get_total_num_hidden_layers())
        self._layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        self._dtype = kv_cache_spec.dtype
        # The layers decide now, at engine start: the log lines and any configuration error come
        # before the first request.
        self._plans()

    def _plans(self) -> list:
        return [layer.impl.plan(name, self._dtype, self.device, self.kv_cache_spec.block_size, _attention_chunk(layer))
                for name, layer in self._layers.items() if isinstance(layer.impl, SparsePrefillImpl)]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> SparsePrefillMetadata:
        cm = common_attn_metadata
        plans = self._plans()
        sparse_layers = any(p.decision.sparse for p in plans)
        if not sparse_layers or cm.causal is not True or cm.max_query_len <= self.reorder_batch_threshold:
            return SparsePrefillMetadata(self.fa.build(common_prefix_len, cm, fast_build))
        n = cm.num_reqs
        qsl = cm.query_start_loc_cpu[:n + 1]
        # Exact for prefill rows, the only ones our calls read (decode rows run FLASH_ATTN on the
        # device's seq_lens); without it, one synchronising copy.
        lens = cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens.cpu()
        split = split_batch(qsl, lens[:n], _State.config.min_sparse_len, self.reorder_batch_threshold)
        if split.all_dense:
            return SparsePrefillMetadata(self.fa.build(common_prefix_len, cm, fast_build))
        dense = tuple((run.tokens, _own_schedule(self.fa.build(0, self._sub_batch(cm, run.rows, run.tokens),
                                                               fast_build), self.fa))
                      for run in split.dense)
        sparse = tuple(self._sparse_call(cm, run) for run in split.sparse)
        fa_full = None
        if not all(p.decision.sparse for p in plans):
            fa_full = self.fa.build(common_prefix_len, cm, fast_build)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sparseprefill: step of %d requests: dense runs (token rows) %s; sparse runs (token rows, "
                         "keys) %s", n, [t for t, _ in dense], [(c.run.tokens, c.run.seqused_k.tolist()) for c in sparse])
        return SparsePrefillMetadata(fa_full, dense, sparse)

    def _sub_batch(self, cm: CommonAttentionMetadata, rows: Tuple[int, int],
                   tokens: Tuple[int, int]) -> CommonAttentionMetadata:
        """Requests [a, b) as a batch of their own for FLASH_ATTN's builder."""
        a, b = rows
        t0, t1 = tokens
        qsl_cpu = cm.query_start_loc_cpu[a:b + 1] - t0
        upper = cm.seq_lens_cpu_upper_bound
        max_seq = int(upper[a:b].max()) if upper is not None else cm.max_seq_len
        return CommonAttentionMetadata(
            query_start_loc=cm.query_start_loc[a:b + 1] - t0, query_start_loc_cpu=qsl_cpu,
            seq_lens=cm.seq_lens[a:b], num_reqs=b - a, num_actual_tokens=t1 - t0,
            max_query_len=int((qsl_cpu[1:] - qsl_cpu[:-1]).max()), max_seq_len=max_seq,
            block_table_tensor=cm.block_table_tensor[a:b], slot_mapping=cm.slot_mapping[t0:t1], causal=True,
            seq_lens_cpu_upper_bound=upper[a:b] if upper is not None else None,
            is_prefilling=cm.is_prefilling[a:b] if cm.is_prefilling is not None else None)

    def _sparse_call(self, cm: CommonAttentionMetadata, run: SparseRun) -> _SparseCall:
        # Only the rows and the pages the run reads leave the device (one copy per run).
        pages = math.ceil(int(run.seqused_k.max()) / self.kv_cache_spec.block_size)
        rows = torch.from_numpy(run.rows).to(cm.block_table_tensor.device)
        table = cm.block_table_tensor.index_select(0, rows)[:, :pages].to("cpu").contiguous()
        return _SparseCall(run, torch.from_numpy(run.cu_seqlens_q), torch.from_numpy(run.seqused_k), table)

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> SparsePrefillMetadata:
        # Captured batches are decode-only (UNIFORM_SINGLE_TOKEN_DECODE): FLASH_ATTN's alone.
        return SparsePrefillMetadata(self.fa.build_for_cudagraph_capture(common_attn_metadata))


class SparsePrefillBackend(FlashAttentionBackend):
    """FLASH_ATTN's backend (what it supports, its KV cache shape and stride order, its cache
    write) with our impl and builder; layers it accepts and we cannot run fall back to FLASH_ATTN
    inside our impl, with one log line each."""

    @staticmethod
    def get_name() -> str:
        # Attention.__init__ looks the backend up as AttentionBackendEnum[get_name()].
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type:
        return SparsePrefillImpl

    @staticmethod
    def get_builder_cls() -> type:
        return SparsePrefillMetadataBuilder
