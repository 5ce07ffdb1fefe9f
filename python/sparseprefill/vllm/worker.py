# SPDX-License-Identifier: Apache-2.0
"""A vLLM worker extension for benchmarks and checks: switch the backend's settings in a
running engine and read the density our calls had, without an engine restart.

    llm = LLM(..., attention_backend="CUSTOM",
              worker_extension_cls="sparseprefill.vllm.worker.SparsePrefillWorkerExtension")
    llm.collective_rpc("sparseprefill_configure", args=({"sparseprefill": {"policy": "synthetic",
                                                                           "density": 0.05}},))
    llm.collective_rpc("sparseprefill_collect", args=(True,))    # start recording our calls
    llm.generate(...)
    llm.collective_rpc("sparseprefill_collect", args=(False,))   # -> one summary per worker
    llm.collective_rpc("sparseprefill_profile", args=(True,))    # torch.profiler over the steps
    llm.generate(...)
    llm.collective_rpc("sparseprefill_profile", args=(False,))   # -> the tables, per worker

Recording statistics synchronises once per call, and profiling slows the host: time with both
off."""

from __future__ import annotations

from typing import Any, Dict, Optional

import sparseprefill as sp

__all__ = ["SparsePrefillWorkerExtension"]


class SparsePrefillWorkerExtension:
    """Mixed into vLLM's worker class (so `self` is the worker); runs between steps."""

    _collecting: Any = None
    _profiling: Any = None

    def sparseprefill_configure(self, additional_config: Dict[str, Any]) -> str:
        """Replaces the configuration (additional_config's form); the layers decide again at the
        next step and log their lines. Returns the parsed configuration."""
        from .backend import current_config, use_config

        use_config(additional_config, force=True,
                   num_layers=self.vllm_config.model_config.get_total_num_hidden_layers())
        return repr(current_config())

    def sparseprefill_collect(self, start: bool) -> Optional[Dict[str, Any]]:
        """start=True opens sp.collect_stats() in this worker; start=False closes it and returns
        {"calls", "density" (kept / visible blocks over our calls), "per_layer"}."""
        if start:
            if self._collecting is not None:
                raise RuntimeError("sparseprefill_collect: already collecting")
            block = sp.collect_stats()
            self._collecting = (block, block.__enter__())
            return None
        if self._collecting is None:
            raise RuntimeError("sparseprefill_collect: not collecting (call with start=True first)")
        block, log = self._collecting
        self._collecting = None
        block.__exit__(None, None, None)
        if not log.calls:
            return {"calls": 0, "density": None, "per_layer": {}}
        return {"calls": len(log.calls), "density": log.density(),
                "per_layer": {str(k): v for k, v in log.per_layer().items()}}

    def sparseprefill_profile(self, start: bool, rows: int = 25) -> Optional[str]:
        """start=True starts torch.profiler (host and CUDA activity) in this worker; start=False
        stops it and returns its operator tables: the `rows` costliest by self CUDA time, then by
        self CPU time (where a step's time goes: kernels, or host work between them)."""
        import torch

        if start:
            if self._profiling is not None:
                raise RuntimeError("sparseprefill_profile: already profiling")
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self._profiling = torch.profiler.profile(activities=activities)
            self._profiling.__enter__()
            return None
        if self._profiling is None:
            raise RuntimeError("sparseprefill_profile: not profiling (call with start=True first)")
        prof, self._profiling = self._profiling, None
        torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        averages = prof.key_averages()
        return "\n".join([averages.table(sort_by="self_cuda_time_total", row_limit=rows),
                          averages.table(sort_by="self_cpu_time_total", row_limit=rows)])
