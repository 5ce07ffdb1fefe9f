# SPDX-License-Identifier: Apache-2.0
"""The vLLM backend's configuration and per-layer decisions, as pure functions (no vLLM, no
torch, no device):

* parse_config(additional_config) reads vLLM's additional_config["sparseprefill"] into a
  frozen SparsePrefillConfig. Every unknown key and bad value raises ValueError naming its path
  (sparseprefill.layers.12.alpha); policy values are checked by the library's own policy parser
  (the one sp_policy_create runs), so the rules are the library's.
* decide_layer(config, spec, probe) says whether a layer runs our policy or FLASH_ATTN for every
  row, with the reason, as one log line.
* rank_heads / rank_thresholds slice per-query-head data for a tensor-parallel rank.
* layer_policy(config, layer, ...) builds the Policy a layer runs on this rank.

The schema (docs/vllm.md lists every key with its type and default):

    {"sparseprefill": {"policy": "estimate_select", "alpha": 0.1,      # the policy and its settings
                       "dense_layers": [0, 1, "30-31"],                # these run Dense()
                       "min_sparse_len": 4096,                         # shorter prefills: FLASH_ATTN
                       "layers": {"12": {"alpha": 0.2},                # per-layer overrides
                                  "20-23": {"policy": "softmax_skip", "a": 20}},
                       "calibration": "cal.safetensors", "budget": 16, # exact_gate's thresholds
                       "log_level": "info"}}

With a calibration file, estimate_select may take "density_target" and softmax_skip
"skip_target" instead of alpha / a: each layer runs the value the file fitted for it (its
estimate_select block, sink, window, tail and pack_gqa, its softmax_skip blocks).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Dict, FrozenSet, Mapping, Optional, Tuple

import numpy as np

from .. import _ext
from ..calibration import load_calibration
from ..policy import Dense, EstimateSelect, ExactGate, PermuteStop, Policy, SoftmaxSkip

__all__ = ["PolicySpec", "SyntheticDensity", "SparsePrefillConfig", "LayerSpec", "LayerDecision", "parse_config",
           "decide_layer", "layer_policy", "rank_heads", "rank_thresholds", "ROOT", "SYNTHETIC"]

ROOT = "sparseprefill"
# A benchmark setting, not a policy of the library: a synthetic block mask of a fixed density
# (BlockSparse). Dummy weights make attention uniform, so no real policy can be set to a density
# there; this one can (docs/vllm.md, "Benchmark setting").
SYNTHETIC = "synthetic"
_LIBRARY_POLICIES: Dict[str, type] = {cls.name: cls for cls in (Dense, EstimateSelect, ExactGate, SoftmaxSkip,
                                                               PermuteStop)}
_SYNTHETIC_SETTINGS = {"density": float, "block": int}
# The calibrated target each policy may take from the calibration file, and the settings the file
# then fixes (those the fit depends on; mean_correction stays the configuration's).
_TARGETS = {EstimateSelect.name: ("density_target", ("alpha", "block", "sink", "window", "tail", "pack_gqa")),
            SoftmaxSkip.name: ("skip_target", ("a", "block_q", "block_k"))}
_TARGET_KEYS = tuple(key for key, _ in _TARGETS.values())
_TOP_KEYS = ("policy", "dense_layers", "min_sparse_len", "layers", "calibration", "budget") + _TARGET_KEYS + (
    "log_level",)
_LAYER_KEYS = ("policy", "budget") + _TARGET_KEYS
_LOG_LEVELS = ("debug", "info", "warning", "error")
_DEFAULT_MIN_SPARSE_LEN = 4096


def _settable(cls: type) -> Dict[str, type]:
    """{setting: JSON type} of a policy class: its dataclass fields that the library parses (not
    tensors), typed by their annotations (Optional[int] counts as int)."""
    hints = typing.get_type_hints(cls)
    out: Dict[str, type] = {}
    for f in fields(cls):
        if f.name in cls._tensor_fields:
            continue
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[f.name] = args[0] if args else hint
    return out


_SETTINGS: Dict[str, Dict[str, type]] = {name: _settable(cls) for name, cls in _LIBRARY_POLICIES.items()}
_SETTINGS[SYNTHETIC] = _SYNTHETIC_SETTINGS
POLICY_NAMES = tuple(_SETTINGS)


def _fail(path: str, message: str) -> ValueError:
    return ValueError(f"{path}: {message}")


def _typed(path: str, value: Any, kind: type) -> Any:
    # JSON has no separate bool/int/float checks; bool is an int in Python, so refuse it first.
    if kind is bool:
        if not isinstance(value, bool):
            raise _fail(path, f"expected true or false, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(path, f"expected a number, got {value!r}")
    if kind is int:
        if isinstance(value, float):
            if not value.is_integer():
                raise _fail(path, f"expected an integer, got {value!r}")
            value = int(value)
        return value
    value = float(value)
    if not math.isfinite(value):
        raise _fail(path, f"expected a finite number, got {value!r}")
    return value


@dataclass(frozen=True)
class PolicySpec:
    """A policy as the configuration names it: the library's name (or SYNTHETIC), its settings
    as checked values, exact_gate's budget (a budget value of the calibration file), and
    estimate_select's density_target or softmax_skip's skip_target (a target of the file)."""

    name: str
    settings: Tuple[Tuple[str, Any], ...] = ()
    budget: Optional[int] = None
    target: Optional[float] = None

    def describe(self) -> str:
        parts = [self.name] + [f"{k}={v}" for k, v in self.settings]
        if self.budget is not None:
            parts.append(f"budget={self.budget}")
        if self.target is not None:
            parts.append(f"{_TARGETS[self.name][0]}={self.target}")
        return " ".join(parts)


@dataclass(frozen=True)
class SyntheticDensity:
    """The benchmark setting: every sparse call runs a BlockSparse mask keeping `density` of each
    query block's causally visible key blocks (batch.synthetic_mask), blocks of `block` keys."""

    density: float
    block: int = 128


@dataclass(frozen=True)
class SparsePrefillConfig:
    """additional_config["sparseprefill"], checked. `layers` maps a layer index to its override;
    `sources` names where each overridden layer's policy came from (for the log lines)."""

    policy: PolicySpec = PolicySpec(Dense.name)
    dense_layers: FrozenSet[int] = frozenset()
    layers: Tuple[Tuple[int, PolicySpec, str], ...] = ()
    min_sparse_len: int = _DEFAULT_MIN_SPARSE_LEN
    calibration: Optional[str] = None
    log_level: str = "info"

    def spec_for(self, layer: int) -> Tuple[PolicySpec, str]:
        """(the layer's policy, where the configuration says it: 'dense_layers', 'layers.K' or
        'policy')."""
        if layer in self.dense_layers:
            return PolicySpec(Dense.name), "dense_layers"
        for index, spec, source in self.layers:
            if index == layer:
                return spec, source
        return self.policy, "policy"

    def check_model(self, num_layers: int) -> None:
        """Every layer the configuration names exists in a model of `num_layers` layers."""
        for layer in sorted(self.dense_layers):
            if layer >= num_layers:
                raise _fail(f"{ROOT}.dense_layers", f"layer {layer}: the model has {num_layers} layers "
                            f"(0 .. {num_layers - 1})")
        for layer, _, source in self.layers:
            if layer >= num_layers:
                raise _fail(f"{ROOT}.{source}", f"layer {layer}: the model has {num_layers} layers "
                            f"(0 .. {num_layers - 1})")


def _layer_set(path: str, value: Any) -> Tuple[int, ...]:
    """A layer index (int, or its decimal string) or an inclusive range 'a-b' -> the layers."""
    if isinstance(value, bool):
        raise _fail(path, f"expected a layer index or a range 'a-b', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise _fail(path, f"expected a layer index >= 0, got {value}")
        return (value,)
    if isinstance(value, str):
        text = value.strip()
        lo, sep, hi = text.partition("-")
        if lo.isdigit() and lo.isascii() and (not sep or (hi.isdigit() and hi.isascii())):
            a, b = int(lo), int(hi) if sep else int(lo)
            if a > b:
                raise _fail(path, f"range {value!r} is empty (its start is after its end)")
            return tuple(range(a, b + 1))
    raise _fail(path, f"expected a layer index or a range 'a-b', got {value!r}")


def _spec(path: str, raw: Mapping[str, Any], allowed: Tuple[str, ...], base: Optional[PolicySpec]) -> PolicySpec:
    """Reads a policy name and its settings from `raw` (keys outside `allowed` are settings).
    With `base` (the global policy), an override without 'policy' (or naming base's) changes only
    the settings it gives; one naming another policy starts from that policy's defaults."""
    name = raw.get("policy", base.name if base is not None else Dense.name)
    if not isinstance(name, str) or name not in _SETTINGS:
        raise _fail(f"{path}.policy", f"expected one of {', '.join(POLICY_NAMES)}, got {name!r}")
    inherit = base is not None and name == base.name
    settings: Dict[str, Any] = dict(base.settings) if inherit else {}
    known = _SETTINGS[name]
    for key, value in raw.items():
        if key in allowed:
            continue
        if key not in known:
            extra = f"; settings of {name}: {', '.join(known)}" if known else f"; {name} has no settings"
            raise _fail(f"{path}.{key}", f"unknown key (expected one of {', '.join(allowed)}{extra})")
        settings[key] = _typed(f"{path}.{key}", value, known[key])
    budget = raw.get("budget", base.budget if inherit else None)
    if "budget" in raw:
        if name != ExactGate.name:
            raise _fail(f"{path}.budget", f"only with policy exact_gate (this one is {name})")
        budget = _typed(f"{path}.budget", raw["budget"], int)
    target = base.target if inherit else None
    if target is not None and _TARGETS[name][0] not in raw and any(s in raw for s in _TARGETS[name][1]):
        target = None  # an override giving its own alpha (or a, blocks) replaces the inherited target
    for key in _TARGET_KEYS:
        if key in raw:
            owner = next(p for p, (k, _) in _TARGETS.items() if k == key)
            if name != owner:
                raise _fail(f"{path}.{key}", f"only with policy {owner} (this one is {name})")
            target = _typed(f"{path}.{key}", raw[key], float)
            if not 0.0 < target <= 1.0:
                raise _fail(f"{path}.{key}", f"expected a fraction in (0, 1], got {target}")
    if target is not None:
        key, fitted = _TARGETS[name]
        for setting in fitted:
            if setting in settings:
                raise _fail(f"{path}.{setting}", f"the calibration file fits it with {key}; give one or the other")
    spec = PolicySpec(name, tuple(sorted(settings.items())), budget, target)
    _check_values(path, spec)
    return spec


def _library_error(path: str, error: Exception) -> ValueError:
    # The library names the setting it refuses first ("alpha: expected ..."): put the path in
    # front of it, so the message reads sparseprefill.layers.12.alpha: expected ...
    return ValueError(f"{path}.{error}")


def _check_values(path: str, spec: PolicySpec) -> None:
    """The library's checks of the settings (sp_policy_create through policy.settings()), except
    exact_gate's, which need its calibration (_calibrated)."""
    values = dict(spec.settings)
    if spec.name == SYNTHETIC:
        if "density" not in values:
            raise _fail(f"{path}.density", "required with policy synthetic (a fraction in (0, 1])")
        if not 0.0 < values["density"] <= 1.0:
            raise _fail(f"{path}.density", f"expected a fraction in (0, 1], got {values['density']}")
        if values.get("block", 128) < 1:
            raise _fail(f"{path}.block", f"expected a positive block size, got {values['block']}")
        return
    if spec.name == ExactGate.name:
        return
    policy = _LIBRARY_POLICIES[spec.name](**values)
    try:
        _ext.PolicyHandle(policy.name, policy.settings())
    except _ext.Error as e:
        raise _library_error(path, e) from None


def _calibrated(path: str, file: str, spec: PolicySpec) -> None:
    """Checks a spec that reads the calibration file against it: the file loads (FileError and
    CorruptDataError become ValueErrors naming the key) and has the spec's section and value (an
    exact_gate budget, whose block sizes, given ones the file's, pass the library's checks; a
    density or skip target)."""
    try:
        cal = load_calibration(file)
    except _ext.Error as e:
        raise _fail(f"{ROOT}.calibration", str(e)) from None
    if spec.target is not None:
        key, _ = _TARGETS[spec.name]
        targets = cal.density_targets if spec.name == EstimateSelect.name else cal.skip_targets
        if not targets:
            raise _fail(f"{ROOT}.calibration", f"{file} has no {spec.name} section (needed by {path}.{key})")
        if not any(math.isclose(t, spec.target, rel_tol=1e-6, abs_tol=1e-7) for t in targets):
            raise _fail(f"{path}.{key}", f"expected one of the file's targets {targets}, got {spec.target}")
        return
    if not cal.gate_budgets:
        raise _fail(f"{ROOT}.calibration", f"{file} has no exact_gate section")
    if spec.budget is None:
        raise _fail(f"{path}.budget", f"required with policy exact_gate: one of the file's budgets {cal.gate_budgets}")
    if spec.budget not in cal.gate_budgets:
        raise _fail(f"{path}.budget", f"expected one of the file's budgets {cal.gate_budgets}, got {spec.budget}")
    gate = ExactGate(calibration=cal, layer=0, budget=spec.budget, **dict(spec.settings))
    try:
        _ext.PolicyHandle(gate.name, gate.settings())
    except _ext.Error as e:
        raise _library_error(path, e) from None


def parse_config(additional_config: Optional[Mapping[str, Any]]) -> SparsePrefillConfig:
    """vLLM's additional_config (a dict; None or without 'sparseprefill': the defaults) ->
    SparsePrefillConfig. Raises ValueError naming the key or value at fault."""
    if additional_config is None:
        return SparsePrefillConfig()
    if not isinstance(additional_config, Mapping):
        raise _fail("additional_config", f"expected a JSON object, got {type(additional_config).__name__}")
    raw = additional_config.get(ROOT)
    if raw is None:
        return SparsePrefillConfig()
    if not isinstance(raw, Mapping):
        raise _fail(ROOT, f"expected a JSON object, got {raw!r}")

    policy = _spec(ROOT, raw, _TOP_KEYS, None)

    dense_layers = raw.get("dense_layers", [])
    if not isinstance(dense_layers, (list, tuple)):
        raise _fail(f"{ROOT}.dense_layers", f"expected a list of layer indices and ranges 'a-b', got {dense_layers!r}")
    dense: set = set()
    for i, item in enumerate(dense_layers):
        dense.update(_layer_set(f"{ROOT}.dense_layers.{i}", item))

    min_sparse_len = _typed(f"{ROOT}.min_sparse_len", raw.get("min_sparse_len", _DEFAULT_MIN_SPARSE_LEN), int)
    if min_sparse_len < 1:
        raise _fail(f"{ROOT}.min_sparse_len", f"expected a key count >= 1, got {min_sparse_len}")

    log_level = raw.get("log_level", "info")
    if log_level not in _LOG_LEVELS:
        raise _fail(f"{ROOT}.log_level", f"expected one of {', '.join(_LOG_LEVELS)}, got {log_level!r}")

    overrides = raw.get("layers", {})
    if not isinstance(overrides, Mapping):
        raise _fail(f"{ROOT}.layers", f"expected an object of layer indices or ranges to overrides, got {overrides!r}")
    layers: Dict[int, Tuple[PolicySpec, str]] = {}
    for key, body in overrides.items():
        path = f"{ROOT}.layers.{key}"
        indices = _layer_set(path, key)
        if not isinstance(body, Mapping):
            raise _fail(path, f"expected an object (policy and settings), got {body!r}")
        spec = _spec(path, body, _LAYER_KEYS, policy)
        for layer in indices:
            if layer in dense:
                raise _fail(path, f"layer {layer} is also in dense_layers")
            if layer in layers:
                raise _fail(path, f"layer {layer} is also given by {layers[layer][1]}")
            layers[layer] = (spec, f"layers.{key}")

    calibration = raw.get("calibration")
    readers = [(f"{ROOT}.{source}", spec) for spec, source in layers.values()]
    readers = [(p, s) for p, s in [(ROOT, policy)] + readers if s.name == ExactGate.name or s.target is not None]
    if calibration is not None:
        if not isinstance(calibration, str) or not calibration:
            raise _fail(f"{ROOT}.calibration", f"expected a file path, got {calibration!r}")
        if not readers:
            raise _fail(f"{ROOT}.calibration", "given, but no layer reads it (exact_gate, density_target, skip_target)")
    for path, spec in readers:
        if calibration is None:
            what = "policy exact_gate" if spec.target is None else _TARGETS[spec.name][0]
            raise _fail(f"{ROOT}.calibration", f"required by {what} ({path})")
        _calibrated(path, calibration, spec)

    return SparsePrefillConfig(policy=policy, dense_layers=frozenset(dense),
                               layers=tuple(sorted((k, s, src) for k, (s, src) in layers.items())),
                               min_sparse_len=min_sparse_len, calibration=calibration, log_level=log_level)


def rank_heads(total: int, tp_size: int, rank: int) -> Tuple[int, int]:
    """The query heads [start, stop) that tensor-parallel rank `rank` of `tp_size` holds: vLLM's
    column-parallel QKV projection gives each rank total / tp_size consecutive heads."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"tensor parallel rank {rank} of size {tp_size}: expected 0 <= rank < size")
    if total < 1 or total % tp_size:
        raise ValueError(f"{total} query heads do not split over {tp_size} tensor-parallel ranks")
    per = total // tp_size
    return rank * per, (rank + 1) * per


def rank_thresholds(table: np.ndarray, tp_size: int, rank: int) -> np.ndarray:
    """exact_gate's float32 [h_q, positions] table (all the model's query heads) -> this rank's
    rows [h_q / tp_size, positions], contiguous."""
    if table.ndim != 2:
        raise ValueError(f"thresholds: expected [h_q, positions], got shape {list(table.shape)}")
    start, stop = rank_heads(int(table.shape[0]), tp_size, rank)
    return np.ascontiguousarray(table[start:stop], dtype=np.float32)


def layer_policy(config: SparsePrefillConfig, layer: int, num_heads: int, tp_size: int = 1,
                 tp_rank: int = 0) -> Tuple[Any, str]:
    """(what layer `layer` runs on rank `tp_rank` - a Policy, or SyntheticDensity - and where the
    configuration says so). num_heads: the query heads of this rank (vLLM's per-rank count); an
    exact_gate layer gets its calibrated table's rows for these heads."""
    spec, source = config.spec_for(layer)
    values = dict(spec.settings)
    if spec.name == SYNTHETIC:
        return SyntheticDensity(**values), source
    if spec.target is not None:
        cal = load_calibration(config.calibration)  # cached by the loader; parse_config checked it
        fit = cal.estimate_select if spec.name == EstimateSelect.name else cal.softmax_skip
        try:
            policy = fit(layer, spec.target)
        except _ext.Error as e:
            raise _fail(f"{ROOT}.calibration", f"{config.calibration}: {e}") from None
        return replace(policy, **values), source
    if spec.name != ExactGate.name:
        return _LIBRARY_POLICIES[spec.name](**values), source
    cal = load_calibration(config.calibration)  # cached by the loader; parse_config checked it
    total = num_heads * tp_size
    try:
        table = cal.thresholds(layer, spec.budget)
    except _ext.Error as e:
        raise _fail(f"{ROOT}.calibration", f"{config.calibration}: {e}") from None
    if table.shape[0] != total:
        raise _fail(f"{ROOT}.calibration", f"{config.calibration} holds exact_gate tables for {table.shape[0]} query "
                    f"heads; the model has {total} ({num_heads} per rank x {tp_size} ranks)")
    return ExactGate(block_q=cal.gate_block_q, block_k=cal.gate_block_k,
                     thresholds=rank_thresholds(table, tp_size, tp_rank)), source


@dataclass(frozen=True)
class LayerSpec:
    """What vLLM's attention layer is, as the decision reads it. dtype: the model's ('bfloat16',
    'float16', ...); kv_cache_dtype: vLLM's cache dtype string ('auto' is the model's);
    rswa_window and mm_prefix: the model's R-SWA window and PrefixLM flag (model_config);
    attention_chunk: a ChunkedLocalAttention layer's chunk (Llama 4's local layers), None else."""

    index: int
    head_size: int
    dtype: str
    kv_cache_dtype: str = "auto"
    sliding_window: Optional[int] = None
    attn_type: str = "decoder"
    logits_soft_cap: float = 0.0
    alibi: bool = False
    sinks: bool = False
    dcp_world_size: int = 1
    rswa_window: Optional[int] = None
    mm_prefix: bool = False
    attention_chunk: Optional[int] = None


@dataclass(frozen=True)
class LayerDecision:
    """Our policy for the layer's long prefills (spec), or FLASH_ATTN for all its rows (spec None,
    `reason` says why)."""

    layer: int
    spec: Optional[PolicySpec]
    source: str = ""
    reason: str = ""
    min_sparse_len: int = _DEFAULT_MIN_SPARSE_LEN

    @property
    def sparse(self) -> bool:
        return self.spec is not None

    def log_line(self) -> str:
        if self.spec is None:
            return f"sparseprefill: layer {self.layer}: FLASH_ATTN for every row: {self.reason}"
        return (f"sparseprefill: layer {self.layer}: {self.spec.describe()} ({self.source}) on prefills of >= "
                f"{self.min_sparse_len} keys; decodes and shorter prefills run FLASH_ATTN")


def decide_layer(config: SparsePrefillConfig, spec: LayerSpec,
                 probe: Callable[[], Optional[str]]) -> LayerDecision:
    """Our policy, or FLASH_ATTN for the whole layer with the first reason that applies. The
    checks that need only the layer's description come first; `probe` (asked last, and only
    then) returns the library's refusal of this layer's call shape and policy on its device, or
    None (sp.can_run on a tiny paged call laid out as vLLM's cache)."""
    reasons = []
    if spec.attn_type != "decoder":
        reasons.append(f"attention type {spec.attn_type} (sparseprefill runs causal decoder self-attention)")
    if spec.sliding_window is not None:
        reasons.append(f"sliding window {spec.sliding_window} (not supported)")
    if spec.rswa_window is not None:
        reasons.append(f"reference sliding-window attention, window {spec.rswa_window} (not supported)")
    if spec.mm_prefix:
        reasons.append("bidirectional multimodal prefix ranges (PrefixLM; not supported)")
    if spec.attention_chunk is not None:
        # vLLM runs these layers on per-chunk virtual batches built by its wrapper of this
        # backend's builder, whose host sequence lengths stay the real batch's (rows and lengths
        # both differ): our split would read the wrong keys.
        reasons.append(f"chunked local attention, chunks of {spec.attention_chunk} (vLLM's per-chunk virtual "
                       "batches; not supported)")
    if spec.dtype not in ("bfloat16", "float16"):
        reasons.append(f"dtype {spec.dtype} (bfloat16 or float16 expected)")
    if spec.kv_cache_dtype not in ("auto", spec.dtype):
        reasons.append(f"kv cache dtype {spec.kv_cache_dtype} (the model's dtype {spec.dtype} expected)")
    if spec.logits_soft_cap:
        reasons.append(f"logit soft-capping {spec.logits_soft_cap} (not supported)")
    if spec.alibi:
        reasons.append("ALiBi slopes (not supported)")
    if spec.sinks:
        reasons.append("attention sinks (not supported)")
    if spec.dcp_world_size > 1:
        reasons.append(f"decode context parallelism of {spec.dcp_world_size} (not supported)")
    policy, source = config.spec_for(spec.index)
    if not reasons:
        refusal = probe()
        if refusal:
            reasons.append(f"the library cannot run it: {refusal}")
    if reasons:
        return LayerDecision(spec.index, None, source, reasons[0], config.min_sparse_len)
    return LayerDecision(spec.index, policy, source, "", config.min_sparse_len)
