# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.vllm's pure configuration (no vLLM, no torch): additional_config parsing with
every bad key and value refused by path, per-layer policies and decisions, tensor-parallel
slicing of heads and calibrated thresholds (a rank's gated output equals its heads of the
unsplit call), the plugin's entry point, and that the pure modules import neither vLLM nor torch."""

import importlib.metadata
import subprocess
import sys

import numpy as np
import pytest

import sparseprefill as sp
from sparseprefill.vllm import (LayerSpec, PolicySpec, SyntheticDensity, decide_layer, layer_policy, parse_config,
                                rank_heads, rank_thresholds)


def cfg(**body):
    return parse_config({"sparseprefill": body})


def test_absent_configuration_is_dense_with_defaults():
    for raw in (None, {}, {"other_plugin": {"x": 1}}, {"sparseprefill": {}}):
        c = parse_config(raw)
        assert c.policy == PolicySpec("dense") and c.min_sparse_len == 4096 and not c.dense_layers
        assert c.spec_for(7) == (PolicySpec("dense"), "policy")


def test_full_configuration_resolves_each_layer():
    c = cfg(policy="estimate_select", alpha=0.1, mean_correction=True, dense_layers=[0, "2-3"], min_sparse_len=8192,
            layers={"5": {"alpha": 0.3}, "6-7": {"policy": "softmax_skip", "a": 20}, "9": {"policy": "dense"}},
            log_level="debug")
    assert c.min_sparse_len == 8192 and c.log_level == "debug" and c.dense_layers == {0, 2, 3}
    base = PolicySpec("estimate_select", (("alpha", 0.1), ("mean_correction", True)))
    assert c.spec_for(1) == (base, "policy")
    assert c.spec_for(2) == (PolicySpec("dense"), "dense_layers")
    # An override of the same policy changes only what it gives; another policy starts afresh.
    assert c.spec_for(5) == (PolicySpec("estimate_select", (("alpha", 0.3), ("mean_correction", True))), "layers.5")
    assert c.spec_for(7) == (PolicySpec("softmax_skip", (("a", 20.0),)), "layers.6-7")
    assert c.spec_for(9) == (PolicySpec("dense"), "layers.9")
    policy, source = layer_policy(c, 5, num_heads=4)
    assert policy == sp.EstimateSelect(alpha=0.3, mean_correction=True) and source == "layers.5"
    assert layer_policy(c, 6, num_heads=4)[0] == sp.SoftmaxSkip(a=20.0)
    assert layer_policy(c, 0, num_heads=4)[0] == sp.Dense()


def test_synthetic_density_is_a_setting_not_a_library_policy():
    c = cfg(policy="synthetic", density=0.05)
    assert layer_policy(c, 3, num_heads=8)[0] == SyntheticDensity(0.05, 128)
    assert layer_policy(cfg(policy="synthetic", density=0.2, block=64), 0, 8)[0] == SyntheticDensity(0.2, 64)


@pytest.mark.parametrize("body,message", [
    ([1], "sparseprefill: expected a JSON object"),
    ({"polcy": "dense"}, "sparseprefill.polcy: unknown key"),
    ({"policy": 3}, "sparseprefill.policy: expected one of dense, estimate_select"),
    ({"policy": "block_sparse"}, "sparseprefill.policy: expected one of"),
    ({"alpha": 0.1}, "sparseprefill.alpha: unknown key .*dense has no settings"),
    ({"policy": "estimate_select", "a": 10}, "sparseprefill.a: unknown key .*settings of estimate_select: block, alpha"),
    ({"policy": "estimate_select", "alpha": "0.1"}, "sparseprefill.alpha: expected a number, got '0.1'"),
    ({"policy": "estimate_select", "alpha": True}, "sparseprefill.alpha: expected a number, got True"),
    ({"policy": "estimate_select", "alpha": float("nan")}, "sparseprefill.alpha: expected a finite number"),
    ({"policy": "estimate_select", "block": 128.5}, "sparseprefill.block: expected an integer, got 128.5"),
    ({"policy": "estimate_select", "mean_correction": 1}, "sparseprefill.mean_correction: expected true or false"),
    # Values the library's policy parser refuses, with its message behind the path.
    ({"policy": "estimate_select", "alpha": -1}, r"sparseprefill.alpha: expected a finite number >= 0, got -1"),
    ({"policy": "softmax_skip", "a": 0}, "sparseprefill.a: expected a finite positive number"),
    ({"policy": "permute_stop", "block_q": 0}, "sparseprefill.block_q: expected a positive block size"),
    ({"policy": "estimate_select", "layers": {"12": {"alpha": -0.5}}}, "sparseprefill.layers.12.alpha: expected a finite"),
    ({"layers": {"12": {"policy": "softmax_skip", "alpha": 1}}}, "sparseprefill.layers.12.alpha: unknown key"),
    ({"layers": {"x": {}}}, "sparseprefill.layers.x: expected a layer index or a range 'a-b'"),
    ({"layers": {"5-3": {}}}, "sparseprefill.layers.5-3: range '5-3' is empty"),
    ({"layers": {"-1": {}}}, "sparseprefill.layers.-1: expected a layer index"),
    ({"layers": {"4": "dense"}}, "sparseprefill.layers.4: expected an object"),
    ({"layers": [1]}, "sparseprefill.layers: expected an object"),
    ({"layers": {"3-5": {}, "5": {}}}, "sparseprefill.layers.5: layer 5 is also given by layers.3-5"),
    ({"dense_layers": [4], "layers": {"4": {}}}, "sparseprefill.layers.4: layer 4 is also in dense_layers"),
    ({"dense_layers": 2}, "sparseprefill.dense_layers: expected a list"),
    ({"dense_layers": [0, True]}, "sparseprefill.dense_layers.1: expected a layer index"),
    ({"dense_layers": [-2]}, "sparseprefill.dense_layers.0: expected a layer index >= 0"),
    ({"dense_layers": ["1-x"]}, "sparseprefill.dense_layers.0: expected a layer index or a range"),
    ({"min_sparse_len": 0}, "sparseprefill.min_sparse_len: expected a key count >= 1, got 0"),
    ({"min_sparse_len": "4096"}, "sparseprefill.min_sparse_len: expected a number"),
    ({"min_sparse_len": 1.5}, "sparseprefill.min_sparse_len: expected an integer"),
    ({"log_level": "verbose"}, "sparseprefill.log_level: expected one of debug, info, warning, error"),
    ({"policy": "estimate_select", "budget": 8}, "sparseprefill.budget: only with policy exact_gate"),
    ({"policy": "exact_gate"}, r"sparseprefill.calibration: required by policy exact_gate \(sparseprefill\)"),
    ({"layers": {"3": {"policy": "exact_gate", "budget": 4}}},
     r"sparseprefill.calibration: required by policy exact_gate \(sparseprefill.layers.3\)"),
    ({"calibration": "x.safetensors"}, r"sparseprefill.calibration: given, but no layer reads it \(exact_gate, "),
    ({"policy": "softmax_skip", "density_target": 0.2},
     "sparseprefill.density_target: only with policy estimate_select"),
    ({"policy": "estimate_select", "skip_target": 0.2}, "sparseprefill.skip_target: only with policy softmax_skip"),
    ({"policy": "estimate_select", "density_target": 0},
     r"sparseprefill.density_target: expected a fraction in \(0, 1\]"),
    ({"policy": "estimate_select", "density_target": 0.2, "alpha": 0.1},
     "sparseprefill.alpha: the calibration file fits it with density_target; give one or the other"),
    ({"policy": "softmax_skip", "skip_target": 0.8, "a": 5}, "sparseprefill.a: the calibration file fits it with"),
    ({"layers": {"2": {"policy": "softmax_skip", "skip_target": 0.8, "block_k": 64}}},
     "sparseprefill.layers.2.block_k: the calibration file fits it with skip_target"),
    ({"policy": "estimate_select", "density_target": 0.2},
     r"sparseprefill.calibration: required by density_target \(sparseprefill\)"),
    ({"policy": "exact_gate", "calibration": 5}, "sparseprefill.calibration: expected a file path"),
    ({"policy": "synthetic"}, r"sparseprefill.density: required with policy synthetic"),
    ({"policy": "synthetic", "density": 0}, r"sparseprefill.density: expected a fraction in \(0, 1\], got 0.0"),
    ({"policy": "synthetic", "density": 1.5}, r"sparseprefill.density: expected a fraction"),
    ({"policy": "synthetic", "density": 0.1, "block": 0}, "sparseprefill.block: expected a positive block size"),
])
def test_bad_keys_and_values_are_refused_by_path(body, message):
    with pytest.raises(ValueError, match="^" + message):
        parse_config({"sparseprefill": body})


def test_additional_config_itself_must_be_an_object():
    with pytest.raises(ValueError, match="^additional_config: expected a JSON object"):
        parse_config("sparseprefill")


def test_layers_beyond_the_model_are_refused():
    c = cfg(policy="estimate_select", dense_layers=[31], layers={"30": {"alpha": 0.2}})
    c.check_model(32)
    with pytest.raises(ValueError, match=r"^sparseprefill.dense_layers: layer 31: the model has 24 layers \(0 .. 23\)"):
        c.check_model(24)
    with pytest.raises(ValueError, match="^sparseprefill.layers.30: layer 30: the model has 30 layers"):
        cfg(policy="estimate_select", layers={"30": {"alpha": 0.2}}).check_model(30)


# -- calibration and tensor parallelism ---------------------------------------------------------

LAYERS, HEADS, KV_HEADS, BLOCK, SEQ, D = 3, 8, 2, 16, 96, 32


def scaled_heads(x):
    """float32 q whose heads have scores of different sizes (head h scaled by 1 + h)."""
    return (x * (1.0 + np.arange(x.shape[2]))[None, None, :, None]).astype(np.float32)


@pytest.fixture(scope="module")
def calibration(tmp_path_factory):
    """A calibration file of 3 layers x 8 query heads written by the library (CPU route) from
    random q/k, so every head's thresholds differ."""
    g = np.random.default_rng(7)
    cal = sp.Calibrator(LAYERS, HEADS, budgets=[1, 2], block_q=BLOCK, block_k=BLOCK)
    for layer in range(LAYERS):
        q = scaled_heads(g.standard_normal((1, SEQ, HEADS, D)))
        k = g.standard_normal((1, SEQ, KV_HEADS, D)).astype(np.float32)
        cal.add(layer, q, k)
    path = tmp_path_factory.mktemp("cal") / "cal.safetensors"
    cal.save(path)
    return str(path)


def test_calibration_is_checked_at_parse_time(calibration, tmp_path):
    c = cfg(policy="exact_gate", calibration=calibration, budget=2)
    assert c.calibration == calibration and c.policy == PolicySpec("exact_gate", (), 2)
    with pytest.raises(ValueError, match=r"^sparseprefill.budget: expected one of the file's budgets \[1, 2\], got 8"):
        cfg(policy="exact_gate", calibration=calibration, budget=8)
    with pytest.raises(ValueError, match=r"^sparseprefill.budget: required with policy exact_gate"):
        cfg(policy="exact_gate", calibration=calibration)
    with pytest.raises(ValueError, match="^sparseprefill.block_q: the calibration's thresholds were fitted for 16"):
        cfg(policy="exact_gate", calibration=calibration, budget=1, block_q=128)
    with pytest.raises(ValueError, match="^sparseprefill.calibration: .*absent.safetensors"):
        cfg(policy="exact_gate", calibration=str(tmp_path / "absent.safetensors"), budget=1)
    (tmp_path / "junk.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="^sparseprefill.calibration: .*junk.safetensors"):
        cfg(policy="exact_gate", calibration=str(tmp_path / "junk.safetensors"), budget=1)
    # A layer override may run exact_gate under another global policy; its budget is its own.
    c = cfg(policy="estimate_select", calibration=calibration, layers={"1": {"policy": "exact_gate", "budget": 1}})
    assert c.spec_for(1) == (PolicySpec("exact_gate", (), 1), "layers.1")


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A calibration file with softmax_skip and estimate_select fits (3 layers whose scores grow
    with the layer, so each layer's fitted alpha differs), CPU route, blocks of 16."""
    g = np.random.default_rng(8)
    cal = sp.Calibrator(LAYERS, HEADS, skip_targets=[0.5], density_targets=[0.3, 0.5], block_q=BLOCK, block_k=BLOCK,
                        select_block=BLOCK)
    for layer in range(LAYERS):
        q = g.standard_normal((1, 1024, HEADS, D)) * (1 + layer)
        cal.add(layer, q.astype(np.float32), g.standard_normal((1, 1024, KV_HEADS, D)).astype(np.float32))
    path = tmp_path_factory.mktemp("fit") / "fit.safetensors"
    cal.save(path)
    return str(path)


def test_calibrated_targets_run_each_layers_fitted_value(fitted, calibration):
    # The quality report's recommendations are calibrated targets: each layer runs the alpha (or
    # a) the file fitted for it, with the file's blocks; mean_correction stays the configuration's.
    c = cfg(policy="estimate_select", density_target=0.3, mean_correction=True, calibration=fitted,
            layers={"2": {"policy": "softmax_skip", "skip_target": 0.5}, "1": {"alpha": 0.25}})
    assert c.policy == PolicySpec("estimate_select", (("mean_correction", True),), None, 0.3)
    assert c.policy.describe() == "estimate_select mean_correction=True density_target=0.3"
    cal = sp.load_calibration(fitted)
    want = cal.estimate_select(0, 0.3)
    assert layer_policy(c, 0, num_heads=HEADS)[0] == sp.EstimateSelect(
        block=want.block, alpha=want.alpha, sink=want.sink, window=want.window, tail=want.tail,
        mean_correction=True, pack_gqa=want.pack_gqa)
    assert layer_policy(c, 2, num_heads=HEADS) == (cal.softmax_skip(2, 0.5), "layers.2")
    # An override giving its own alpha runs it (the target is not inherited), mean_correction kept.
    assert c.spec_for(1) == (PolicySpec("estimate_select", (("alpha", 0.25), ("mean_correction", True))), "layers.1")
    assert layer_policy(c, 1, num_heads=HEADS)[0] == sp.EstimateSelect(alpha=0.25, mean_correction=True)
    # Per layer from the file: layers 0 and 1 fitted different alphas for the same target.
    c2 = cfg(policy="estimate_select", density_target=0.3, calibration=fitted)
    assert layer_policy(c2, 0, HEADS)[0].alpha == want.alpha != layer_policy(c2, 1, HEADS)[0].alpha
    with pytest.raises(ValueError, match=r"^sparseprefill.density_target: expected one of the file's targets \[0.3"):
        cfg(policy="estimate_select", density_target=0.2, calibration=fitted)
    with pytest.raises(ValueError, match="^sparseprefill.calibration: .* has no softmax_skip section "
                                         r"\(needed by sparseprefill.skip_target\)"):
        cfg(policy="softmax_skip", skip_target=0.5, calibration=calibration)
    with pytest.raises(ValueError, match="^sparseprefill.calibration: .*layer: expected 0 .. 2"):
        layer_policy(c, 5, num_heads=HEADS)


def test_rank_heads_split_query_heads_in_order():
    assert [rank_heads(32, 4, r) for r in range(4)] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert rank_heads(8, 1, 0) == (0, 8)
    for args, message in [((30, 4, 0), "30 query heads do not split over 4"), ((32, 4, 4), "rank 4 of size 4"),
                          ((32, 0, 0), "rank 0 of size 0"), ((32, 2, -1), "rank -1 of size 2")]:
        with pytest.raises(ValueError, match=message):
            rank_heads(*args)


def test_rank_thresholds_are_the_ranks_rows():
    table = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    parts = [rank_thresholds(table, 4, r) for r in range(4)]
    assert all(p.shape == (2, 5) and p.flags.c_contiguous for p in parts)
    np.testing.assert_array_equal(np.concatenate(parts), table)
    with pytest.raises(ValueError, match=r"expected \[h_q, positions\]"):
        rank_thresholds(table[None], 2, 0)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_each_rank_gates_its_heads_as_the_unsplit_call_does(calibration, tp):
    """exact_gate under tensor parallelism: rank r holds query heads [r H/tp, (r+1) H/tp) and the
    KV heads they read; its layer policy (the calibrated table's rows for those heads) gives
    exactly those heads' output of the unsplit call."""
    c = cfg(policy="exact_gate", calibration=calibration, budget=1)
    layer = 2
    g = np.random.default_rng(11)
    q = scaled_heads(g.standard_normal((1, SEQ, HEADS, D)))
    k = g.standard_normal((1, SEQ, KV_HEADS, D)).astype(np.float32)
    v = g.standard_normal((1, SEQ, KV_HEADS, D)).astype(np.float32)
    whole_policy, _ = layer_policy(c, layer, num_heads=HEADS)
    whole = sp.run(q, k, v, whole_policy, causal=True, backend="cpu")
    assert whole.stats.density < 1.0  # the gate skips something: the comparison below means something
    per, kv_per = HEADS // tp, max(1, KV_HEADS // tp)
    densities = []
    for rank in range(tp):
        policy, _ = layer_policy(c, layer, num_heads=per, tp_size=tp, tp_rank=rank)
        lo, hi = rank_heads(HEADS, tp, rank)
        kv_lo = lo // (HEADS // KV_HEADS)
        part = sp.run(np.ascontiguousarray(q[:, :, lo:hi]), np.ascontiguousarray(k[:, :, kv_lo:kv_lo + kv_per]),
                      np.ascontiguousarray(v[:, :, kv_lo:kv_lo + kv_per]), policy, causal=True, backend="cpu")
        np.testing.assert_array_equal(part.out, whole.out[:, :, lo:hi])
        densities.append(part.stats.density)
    if tp > 1:
        assert len(set(densities)) > 1  # the ranks' tables differ: a wrong slice would show


def test_calibration_heads_must_match_the_model(calibration):
    c = cfg(policy="exact_gate", calibration=calibration, budget=1)
    with pytest.raises(ValueError, match=r"^sparseprefill.calibration: .* holds exact_gate tables for 8 query heads; "
                                         r"the model has 6 \(3 per rank x 2 ranks\)"):
        layer_policy(c, 0, num_heads=3, tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match=r"^sparseprefill.calibration: .*layer: expected 0 .. 2"):
        layer_policy(c, 3, num_heads=8)


# -- per-layer decisions --------------------------------------------------------------------------

def never():
    raise AssertionError("the library was asked although an earlier reason applies")


@pytest.mark.parametrize("change,reason", [
    (dict(attn_type="encoder_only"), "attention type encoder_only"),
    (dict(sliding_window=4096), "sliding window 4096"),
    (dict(rswa_window=512), "reference sliding-window attention, window 512"),
    (dict(mm_prefix=True), "bidirectional multimodal prefix ranges"),
    (dict(attention_chunk=8192), "chunked local attention, chunks of 8192"),
    (dict(dtype="float32"), "dtype float32"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv cache dtype fp8_e4m3"),
    (dict(kv_cache_dtype="float16"), "kv cache dtype float16 (the model's dtype bfloat16 expected)"),
    (dict(logits_soft_cap=30.0), "logit soft-capping 30.0"),
    (dict(alibi=True), "ALiBi slopes"),
    (dict(sinks=True), "attention sinks"),
    (dict(dcp_world_size=2), "decode context parallelism of 2"),
])
def test_layers_we_cannot_run_fall_back_with_their_reason(change, reason):
    c = cfg(policy="estimate_select")
    spec = LayerSpec(**{**dict(index=4, head_size=128, dtype="bfloat16"), **change})
    d = decide_layer(c, spec, never)
    assert not d.sparse and d.spec is None
    assert d.log_line().startswith("sparseprefill: layer 4: FLASH_ATTN for every row: ")
    assert reason in d.log_line()


def test_the_library_decides_last_and_its_refusal_is_the_reason():
    c = cfg(policy="estimate_select", alpha=0.2, min_sparse_len=2048)
    asked = []
    spec = LayerSpec(index=3, head_size=96, dtype="bfloat16", kv_cache_dtype="bfloat16")
    d = decide_layer(c, spec, lambda: asked.append(1) or "head_dim 96 is not compiled (64, 128)")
    assert asked == [1] and not d.sparse
    assert d.log_line() == ("sparseprefill: layer 3: FLASH_ATTN for every row: the library cannot run it: "
                            "head_dim 96 is not compiled (64, 128)")
    d = decide_layer(c, LayerSpec(index=3, head_size=128, dtype="float16"), lambda: None)
    assert d.sparse and d.spec == PolicySpec("estimate_select", (("alpha", 0.2),))
    assert d.log_line() == ("sparseprefill: layer 3: estimate_select alpha=0.2 (policy) on prefills of >= 2048 keys; "
                            "decodes and shorter prefills run FLASH_ATTN")
    d = decide_layer(cfg(dense_layers=["0-1"]), LayerSpec(index=1, head_size=64, dtype="bfloat16"), lambda: None)
    assert d.sparse and d.spec == PolicySpec("dense") and "dense (dense_layers)" in d.log_line()


# -- packaging --------------------------------------------------------------------------------------

def test_the_plugin_entry_point_is_registered():
    points = [p for p in importlib.metadata.entry_points(group="vllm.general_plugins") if p.name == "sparseprefill"]
    assert [p.value for p in points] == ["sparseprefill.vllm:register"]


def test_pure_modules_import_neither_vllm_nor_torch():
    code = ("import sys, sparseprefill.vllm, sparseprefill.vllm.config, sparseprefill.vllm.batch; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd="/")
    assert out.stdout.strip() == "[]"
