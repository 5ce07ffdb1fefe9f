# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality on a tiny random Llama (GQA): the capture attention hands over Q after
RoPE [b, s, h_q, d] and K/V with h_kv heads, its logits equal sdpa's, the calibration sample file
holds q_<layer>/k_<layer> for every layer, and (when the CLI is built) the calibrate step turns
samples into a calibration file the package reads; on CUDA the calibrate route that feeds q/k
straight to Calibrator (GPU statistics) gives the CPU route's tables within the statistics'
tolerance. The real-model test runs only where scripts/model/fetch.sh has put the model into
build/models/."""

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sparseprefill.transformers as spt  # noqa: E402
from sparseprefill.quality import calibrate, capture  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GGUF = os.path.join(ROOT, "build", "models", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def tiny_llama():
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=1024)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_capture_shapes_rope_and_logits():
    spt.register(spt.BackendConfig())
    model = tiny_llama()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids).logits
        model.set_attn_implementation(capture.register())
        seen = {}
        with capture.capturing(lambda layer, q, k, v: seen.setdefault(layer, (q.clone(), k.clone(), v.clone()))):
            out = model(ids).logits
        with capture.capturing(None):
            again = model(ids).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(again, ref, rtol=1e-4, atol=1e-4)
    assert sorted(seen) == [0, 1]
    q, k, v = seen[0]
    assert q.shape == (1, 40, 4, 32) and k.shape == (1, 40, 2, 32) and v.shape == (1, 40, 2, 32)
    # Q is taken after RoPE: position 0 is unrotated, so it equals the projection there, and
    # later positions differ from the projection.
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        h = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
        raw = attn.q_proj(h).view(1, 40, 4, 32)
    torch.testing.assert_close(q[:, 0], raw[:, 0], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(q[:, 5:], raw[:, 5:], atol=1e-3)


def test_calibration_sample_and_cli(tmp_path):
    from safetensors.numpy import load_file

    spt.register(spt.BackendConfig())
    model = tiny_llama()
    model.set_attn_implementation(capture.register())
    ids = list(np.random.default_rng(2).integers(0, 256, 96))
    paths = []
    for i in range(2):
        paths.append(str(tmp_path / f"s{i}.safetensors"))
        calibrate.capture_sample(model, ids[i * 8:] + ids[:i * 8], paths[-1])
    t = load_file(paths[0])
    assert sorted(t) == ["k_0", "k_1", "q_0", "q_1"]
    assert t["q_1"].shape == (1, 96, 4, 32) and t["k_1"].shape == (1, 96, 2, 32) and t["q_1"].dtype == np.float32
    try:
        cli = calibrate.find_cli()
    except FileNotFoundError:
        pytest.skip("the sparseprefill CLI is not built")
    import subprocess

    import sparseprefill as sp

    out = str(tmp_path / "cal.safetensors")
    cmd = [cli, "calibrate", "--output", out, "--block-q", "16", "--block-k", "16", "--block", "16",
           "--budgets", "1,2", "--skip-targets", "0.3", "--density-targets", "0.6", "--model", "tiny"]
    for p in paths:
        cmd += ["--input", p]
    subprocess.run(cmd, check=True, capture_output=True)
    calibrate.add_metadata(out, {"text": "random ids"})
    cal = sp.load_calibration(out)
    assert cal.layers == 2 and cal.gate_budgets == [1, 2] and cal.gate_block_q == 16
    assert cal.metadata["text"] == "random ids" and cal.metadata["model"] == "tiny"
    assert cal.gate_values.shape == (2, 2, 4, 6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU statistics need CUDA")
def test_gpu_calibration_matches_the_cpu_route(tmp_path):
    import sparseprefill as sp

    spt.register(spt.BackendConfig())
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=2048)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval().to("cuda", torch.bfloat16)
    model.set_attn_implementation(capture.register())
    targets = dict(budgets=[1, 2], skip_targets=[0.3, 0.6], density_targets=[0.5, 0.8], block_q=64, block_k=64,
                   select_block=128)
    gpu, cpu = sp.Calibrator(2, 4, **targets), sp.Calibrator(2, 4, **targets)

    def sink(layer, q, k, v):
        gpu.add(layer, q, k)
        cpu.add(layer, q.cpu(), k.cpu())

    ids = torch.randint(0, 256, (1, 700), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad(), capture.capturing(sink):
        model.model(ids, use_cache=False)
    gpu.save(tmp_path / "gpu.safetensors")
    cpu.save(tmp_path / "cpu.safetensors")
    g, c = sp.load_calibration(tmp_path / "gpu.safetensors"), sp.load_calibration(tmp_path / "cpu.safetensors")
    assert np.array_equal(np.isneginf(g.gate_values), np.isneginf(c.gate_values))
    finite = np.isfinite(c.gate_values)
    assert finite.any()
    np.testing.assert_allclose(g.gate_values[finite], c.gate_values[finite], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(np.log(g.skip_a), np.log(c.skip_a), atol=2e-3)
    np.testing.assert_allclose(g.alpha, c.alpha, rtol=2e-3)


@pytest.mark.skipif(not os.path.isfile(GGUF), reason="model not fetched (scripts/model/fetch.sh)")
def test_real_model_capture_gqa():
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from sparseprefill.quality import data

    spt.register(spt.BackendConfig())
    model, tok = data.load_model(GGUF)
    model.set_attn_implementation(capture.register())
    ids = tok("The Debian Policy Manual describes the policy requirements.", add_special_tokens=False).input_ids
    seen = {}
    with torch.no_grad(), capture.capturing(lambda layer, q, k, v: seen.setdefault(layer, (q.shape, k.shape))):
        model.model(torch.tensor([ids]), use_cache=False)
    assert len(seen) == model.config.num_hidden_layers == 30
    assert seen[0] == ((1, len(ids), 9, 64), (1, len(ids), 3, 64))


def test_settings_map_to_per_layer_policies():
    import argparse
    import json

    import sparseprefill as sp
    from sparseprefill.quality import evaluate

    cal = sp.Calibration(layers=2, gate_budgets=[4, 8], gate_block_q=32, gate_block_k=32,
                         gate_values=np.arange(2 * 2 * 3 * 5, dtype=np.float32).reshape(2, 2, 3, 5),
                         skip_targets=[0.5], skip_a=np.array([[7.0], [9.0]], np.float32), skip_block_q=32,
                         skip_block_k=32, density_targets=[0.3, 0.6], alpha=np.array([[0.1, 0.01], [0.2, 0.02]], np.float32),
                         estimate_base=sp.EstimateSelect(block=32, sink=1, window=2, tail=0))
    args = argparse.Namespace(budgets=[8], skip_targets=[0.5], density_targets=[0.6], taus=[0.01], only="")
    settings = evaluate.settings_from(args)
    assert [s.label for s in settings] == ["dense", "exact_gate budget=8", "softmax_skip skip_target=0.5",
                                           "estimate_select density_target=0.6",
                                           "estimate_select_mc density_target=0.6", "permute_stop tau=0.01"]
    config = {s.policy: evaluate.backend_config(s, cal, 2, 32, 256, 0) for s in settings}
    gate = config["exact_gate"].policy_for(1, 4096)
    np.testing.assert_array_equal(gate.table(), cal.gate_values[1, 1])
    assert config["softmax_skip"].policy_for(0, 4096).a == pytest.approx(7.0)
    plain, mc = config["estimate_select"].policy_for(1, 4096), config["estimate_select_mc"].policy_for(1, 4096)
    assert plain.alpha == mc.alpha == pytest.approx(0.02) and (plain.mean_correction, mc.mean_correction) == (False, True)
    assert plain.sink == 1 and plain.window == 2 and plain.block == 32
    stop = config["permute_stop"].policy_for(0, 4096)
    assert (stop.segment, stop.tau, stop.block_q) == (256, 0.01, 32)
    assert isinstance(config["dense"].policy_for(1, 4096), sp.Dense)
    only = evaluate.settings_from(argparse.Namespace(**{**vars(args), "only": "softmax_skip"}))
    assert [s.policy for s in only] == ["dense", "softmax_skip"]
    doc = {"a": [1, 2.5, -3e-05], "b": [[1, 2], [3, 4]], "c": {"d": "x", "e": 0.123456789}}
    text = evaluate.dumps(doc)
    assert "[1, 2.5, -3e-05]" in text and json.loads(text) == {**doc, "c": {"d": "x", "e": 0.123457}}
