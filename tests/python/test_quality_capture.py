# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality on a tiny random Llama (GQA): the capture attention hands over Q after
RoPE [b, s, h_q, d] and K/V with h_kv heads, its logits equal sdpa's, the calibration sample file
holds q_<layer>/k_<layer> for every layer, and (when the CLI is built) the calibrate step turns
samples into a calibration file the package reads. The real-model test runs only where
scripts/model/fetch.sh has put the model into build/models/."""

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
