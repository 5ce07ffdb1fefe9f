# SPDX-License-Identifier: Apache-2.0
"""sparseprefill: sparse prefill attention with FlashAttention's layouts.

Three ways to call it:
  * native: sparseprefill.run(q, k, v, policy) -> (out, lse, stats, decisions) on NumPy arrays or
    torch tensors; select(q, k, v, policy) -> the selection alone (BlockMask, density);
    plan(q, k, v, policy) once, then run(plan, q, k, v) per call;
  * sparseprefill.flash_attn_interface: flash_attn_func, flash_attn_varlen_func,
    flash_attn_with_kvcache with FlashAttention's names and a policy= argument (torch);
  * sparseprefill.transformers.register(): attn_implementation="sparseprefill".
Policies: Dense, BlockSparse, ExactGate, SoftmaxSkip, EstimateSelect, PermuteStop.
Eager torch calls reuse prepared calls (plans bound to a checked call): call_cache_info(),
clear_call_cache(), set_call_cache_size() (docs/python.md, "Prepared calls")."""

from ._ext import (
    CorruptDataError,
    CudaError,
    Error,
    FileError,
    InternalError,
    InvalidArgumentError,
    UnsupportedError,
)
from ._call_cache import CallCacheInfo, call_cache_info, clear_call_cache, set_call_cache_size
from .calibration import Calibration, Calibrator, load_calibration
from .native import (BlockMask, Decisions, DeviceSelection, Plan, Result, Selection, build_info, can_run, check, plan,
                     run, select)
from .policy import BlockSparse, Dense, EstimateSelect, ExactGate, PermuteStop, Policy, SoftmaxSkip
from .stats import CallStats, StatsLog, collect_stats

__version__ = "0.1.0"

__all__ = [
    "BlockMask", "BlockSparse", "Calibration", "Calibrator", "CallCacheInfo", "CallStats", "CorruptDataError", "CudaError",
    "Decisions", "Dense", "DeviceSelection", "Error", "EstimateSelect", "ExactGate", "FileError", "InternalError", "InvalidArgumentError",
    "PermuteStop", "Plan", "Policy", "Result", "Selection", "SoftmaxSkip", "StatsLog", "UnsupportedError",
    "build_info", "call_cache_info", "can_run", "check", "clear_call_cache", "collect_stats", "load_calibration", "plan", "run",
    "select", "set_call_cache_size",
]
