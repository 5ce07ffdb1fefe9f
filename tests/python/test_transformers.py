# SPDX-License-Identifier: Apache-2.0
"""The transformers backend on a tiny Llama-architecture model with random weights (GQA):
dense mode gives sdpa's logits (also with padding and in cached generation), and every
policy runs per layer with decode and short prefills routed to dense. Tiny random Gemma 2,
Gemma 3, gpt-oss, Phi-3 and DeepSeek-V3 models (softcap, sliding windows, sinks, head dims 256
and 96, MLA's V head dim unlike Q/K's) give transformers' own logits in dense mode."""

import json
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sparseprefill as sp  # noqa: E402
import sparseprefill.transformers as spt  # noqa: E402
from _torch_refs import DEVICES  # noqa: E402

DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}
BLOCK = {"cpu": 16, "cuda": 128}  # the CUDA kernels take block_q = 128


def tiny_llama(device, seed=0):
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=4096)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    return model.to(device=device, dtype=DTYPE[device])


def both(device):
    spt.register(spt.BackendConfig())
    model = tiny_llama(device)
    model.set_attn_implementation("sdpa")
    ours = tiny_llama(device)
    ours.set_attn_implementation("sparseprefill")
    return model, ours


def assert_logits_close(got, want, ref, device):
    if device == "cpu":
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    else:
        # bf16: our error against the fp32 model is at most twice sdpa's (FA's rule), plus a small atol.
        err = (got.float() - ref).abs().max().item()
        sdpa_err = (want.float() - ref).abs().max().item()
        assert err <= 2 * sdpa_err + 1e-2, f"logits error {err:.3e} vs sdpa's {sdpa_err:.3e}"


def fp32_reference(device, ids, mask=None):
    model = tiny_llama(device).float()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits.float()


@pytest.mark.parametrize("device", DEVICES)
def test_dense_logits_match_sdpa(device):
    sdpa, ours = both(device)
    ids = torch.randint(0, 256, (2, 200), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        want = sdpa(ids).logits
        with sp.collect_stats() as log:
            got = ours(ids).logits
    assert_logits_close(got, want, fp32_reference(device, ids) if device == "cuda" else None, device)
    assert sorted(log.layers()) == [0, 1, 2] and log.density() == 1.0


@pytest.mark.parametrize("device", DEVICES)
def test_padded_batch_matches_sdpa(device):
    sdpa, ours = both(device)
    ids = torch.randint(0, 256, (3, 90), generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones(3, 90, dtype=torch.long, device=device)
    mask[0, :30] = 0  # left padding
    mask[2, :1] = 0
    with torch.no_grad():
        want = sdpa(ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask).logits
    valid = mask.bool()
    ref = fp32_reference(device, ids, mask)[valid] if device == "cuda" else None
    assert_logits_close(got[valid], want[valid], ref, device)


def test_generation_matches_sdpa_and_decode_runs_dense():
    sdpa, ours = both("cpu")
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(3))
    spt.set_config(spt.BackendConfig(policy=sp.EstimateSelect(block=16, alpha=0.0), min_sparse_len=32))
    with torch.no_grad():
        want = sdpa.generate(ids, max_new_tokens=6, do_sample=False)
        with sp.collect_stats() as log:
            got = ours.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    prefill = [c for c in log.calls if c.heads.shape[1] == 4 and c.policy.startswith("estimate_select")]
    decode = [c for c in log.calls if c.policy == "dense"]
    assert len(prefill) == 3 and len(decode) == 3 * 5  # 3 layers; 5 decode steps after the prefill


def write_calibration(path, layers, heads, positions, block):
    table = np.full((layers, 1, heads, positions), 2.0, dtype=np.float32)
    meta = {"format": "sparseprefill.calibration", "format_version": "1", "layers": str(layers),
            "exact_gate.layers": str(layers), "exact_gate.heads": str(heads), "exact_gate.positions": str(positions),
            "exact_gate.block_q": str(block), "exact_gate.block_k": str(block)}
    tensors = {"exact_gate.thresholds": table, "exact_gate.budgets": np.array([8], dtype=np.int32)}
    header, blobs, offset = {"__metadata__": meta}, [], 0
    for name, arr in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": "F32" if arr.dtype == np.float32 else "I32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def configs(device, tmp_path):
    bl = BLOCK[device]
    path = tmp_path / "gate.safetensors"
    write_calibration(path, 3, 4, 64, bl)
    return {
        "softmax_skip": spt.BackendConfig(policy=sp.SoftmaxSkip(block_q=bl, block_k=bl, a=40.0)),
        "estimate_select": spt.BackendConfig(policy=sp.EstimateSelect(block=bl, alpha=0.3, mean_correction=True)),
        "permute_stop": spt.BackendConfig(policy=sp.PermuteStop(segment=2 * bl, tau=0.05, block_q=bl, block_k=bl)),
        "exact_gate": spt.BackendConfig(calibration=str(path), budget=8),
        "per_layer": spt.BackendConfig(layer_policies={1: sp.EstimateSelect(block=bl, alpha=0.3),
                                                       2: sp.SoftmaxSkip(block_q=bl, block_k=bl, a=40.0)}),
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["softmax_skip", "estimate_select", "permute_stop", "exact_gate", "per_layer"])
def test_every_policy_runs_in_the_model(device, name, tmp_path):
    config = configs(device, tmp_path)[name]
    config.dense_layers, config.min_sparse_len = 1, 64
    _, ours = both(device)
    spt.set_config(config)
    s = 8 * BLOCK[device]
    ids = torch.randint(0, 256, (1, s), generator=torch.Generator().manual_seed(4)).to(device)
    q_like = torch.zeros(1, s, 4, 64, dtype=DTYPE[device], device=device)
    probe = config.policy_for(2, s)
    ok, message = sp.can_run(q_like, q_like[:, :, :2], q_like[:, :, :2], probe, causal=True)
    if not ok:
        pytest.skip(f"{device} backend: {message}")
    with torch.no_grad(), sp.collect_stats() as log:
        logits = ours(ids).logits
        short = ours(ids[:, :40]).logits  # below min_sparse_len: dense everywhere
    assert torch.isfinite(logits).all() and torch.isfinite(short).all()
    prefill = log.calls[:3]
    assert [c.layer for c in prefill] == [0, 1, 2]
    assert prefill[0].policy == "dense" and prefill[0].density == 1.0  # dense_layers=1
    assert all(c.policy != "dense" for c in prefill[1:]), [c.policy for c in prefill]
    assert all(c.policy == "dense" for c in log.calls[3:])
    spt.set_config(spt.BackendConfig())


def test_unsupported_arguments_raise():
    _, ours = both("cpu")
    attn = ours.model.layers[0].self_attn
    q = torch.zeros(1, 4, 8, 64)
    kv = torch.zeros(1, 2, 8, 64)
    with pytest.raises(sp.UnsupportedError, match="dropout"):
        spt.attention_forward(attn, q, kv, kv, None, dropout=0.1)
    for bad in (0, -3, True):
        with pytest.raises(sp.InvalidArgumentError, match="sliding_window: expected None or a number of tokens >= 1"):
            spt.attention_forward(attn, q, kv, kv, None, sliding_window=bad)
    with pytest.raises(sp.InvalidArgumentError, match="softcap"):
        spt.attention_forward(attn, q, kv, kv, None, softcap=-1.0)
    with pytest.raises(sp.InvalidArgumentError, match="sinks: expected float32 \\[h_q\\] = \\[4\\]"):
        spt.attention_forward(attn, q, kv, kv, None, s_aux=torch.zeros(3))
    with pytest.raises(sp.UnsupportedError, match="attention_mask"):
        spt.attention_forward(attn, q, kv, kv, torch.zeros(1, 1, 8, 8))
    out, weights = spt.attention_forward(attn, q, kv, kv, None)
    assert out.shape == (1, 8, 4, 64) and weights is None


# Tiny random models of the families whose attention uses the model-family features (docs/
# semantics.md §1), each against transformers' own attention in dense mode on the CPU backend:
# Gemma 2 (softcap, with sliding layers), Gemma 3 (head_dim 256, sliding window), gpt-oss
# (learned sinks, 128-token window), Phi-3 (head_dim 96) and DeepSeek-V3 (MLA: a V head dim
# unlike Q/K's). initializer_range 0.2 makes the
# scores large enough for each feature to change the logits (checked against the model with the
# feature removed). Reference: eager where sdpa lacks the feature (softcap, sinks).
FAMILIES = {
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", "eager", 48,
               dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=5.0,
                    final_logit_softcapping=None, query_pre_attn_scalar=32),
               dict(attn_logit_softcapping=None)),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", "sdpa", 48,
               dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
                    sliding_window=16, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=256),
               dict(sliding_window=4096)),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig", "eager", 200,
                dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                     layer_types=["sliding_attention", "full_attention"]),
                dict(sliding_window=4096)),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", "sdpa", 48,
             dict(hidden_size=192, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                  pad_token_id=0),
             None),
    # MLA: q/k of qk_nope + qk_rope = 48 features, v of 32 (DeepSeek-V2/V3's 192/128 in small).
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", "sdpa", 48,
                    dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=32,
                         qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                         first_k_dense_replace=1, n_group=1, topk_group=1),
                    None),
}


def family_model(name, attn, removed=False, **override):
    cls_name, config_name, _, _, kwargs, without = FAMILIES[name]
    cls, config_cls = getattr(transformers, cls_name, None), getattr(transformers, config_name, None)
    if cls is None or config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    config = config_cls(vocab_size=256, num_hidden_layers=2, max_position_embeddings=4096, initializer_range=0.2,
                        **{**kwargs, **(without if removed else {}), **override})
    torch.manual_seed(0)
    model = cls(config).eval()
    if removed and name == "gpt_oss":
        for layer in model.model.layers:
            layer.self_attn.sinks.data.fill_(-float("inf"))  # a sink of -inf is none
    model.set_attn_implementation(attn)
    return model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_model_family_logits_match_transformers(name):
    spt.register(spt.BackendConfig())
    reference = FAMILIES[name][2]
    length = FAMILIES[name][3]
    want_model, ours = family_model(name, reference), family_model(name, "sparseprefill")
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :11] = 0  # left padding: the packed (varlen) path
    with torch.no_grad():
        want = want_model(ids).logits
        with sp.collect_stats() as log:
            got = ours(ids).logits
        want_padded = want_model(ids, attention_mask=mask).logits
        got_padded = ours(ids, attention_mask=mask).logits
        if FAMILIES[name][5] is not None:
            removed = family_model(name, reference, removed=True)(ids).logits
            assert (removed - want).abs().max() > 1e-2, f"{name}: the feature changes nothing here"
    assert sorted(log.layers()) == [0, 1] and log.density() == 1.0
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    valid = mask.bool()
    torch.testing.assert_close(got_padded[valid], want_padded[valid], atol=2e-4, rtol=2e-4)
    # Cached generation: decode steps over the (sliding-window) cache.
    with torch.no_grad():
        assert torch.equal(ours.generate(ids[:1], max_new_tokens=5, do_sample=False),
                           want_model.generate(ids[:1], max_new_tokens=5, do_sample=False))


def llama4_model(attn, chunk=16):
    """A tiny random Llama 4 text model: layer 0 chunked attention (chunks of `chunk`), layer 1
    full attention."""
    if getattr(transformers, "Llama4ForCausalLM", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no Llama4ForCausalLM")
    config = transformers.Llama4TextConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                           intermediate_size_mlp=256, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=32, attention_chunk_size=chunk,
                                           no_rope_layers=[1, 0], num_local_experts=2, initializer_range=0.2)
    assert config.layer_types == ["chunked_attention", "full_attention"]
    torch.manual_seed(0)
    model = transformers.Llama4ForCausalLM(config).eval()
    model.set_attn_implementation(attn)
    return model


def test_llama4_chunked_layers_match_sdpa_and_refuse_a_cache():
    # Llama 4's chunked-attention layer over a 40-token prompt (chunks of 16: the prompt spans
    # three) against transformers' sdpa, unpadded and left-padded (the chunks start at the first
    # valid token in both); chunks wider than the prompt change the logits (the feature bites).
    # Decode steps reach the chunked layer over its sliding-window cache, which carries no
    # positions: refused by name, not run as full attention.
    spt.register(spt.BackendConfig())
    want_model, ours = llama4_model("sdpa"), llama4_model("sparseprefill")
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(6))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0
    with torch.no_grad():
        want, got = want_model(ids).logits, ours(ids).logits
        want_padded, got_padded = want_model(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
        unchunked = llama4_model("sdpa", chunk=4096)(ids).logits
    assert (unchunked - want).abs().max() > 1e-2, "the chunks change nothing here"
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    valid = mask.bool()
    torch.testing.assert_close(got_padded[valid], want_padded[valid], atol=2e-4, rtol=2e-4)
    with torch.no_grad(), pytest.raises(sp.UnsupportedError, match="layer 0 is a chunked-attention layer"):
        ours.generate(ids[:1], max_new_tokens=2, do_sample=False)


# The families whose features the CUDA kernels take (windows, softcap, sinks; head dims 64, 96,
# 128 and 256; q/k 192 with v 128), Gemma 2 and gpt-oss at head_dim 64, Gemma 3, Phi-3 and
# DeepSeek-V3 at theirs (256, 96, 192/128), bf16 on
# the GPU: our logits against the fp32 model's within twice the error of transformers' own
# attention in bf16 (assert_logits_close's rule).
CUDA_FAMILIES = {"gemma2": dict(head_dim=64, query_pre_attn_scalar=64), "gpt_oss": dict(head_dim=64), "gemma3": {},
                 "phi3": {}, "deepseek_v3": dict(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)}


@pytest.mark.skipif("cuda" not in DEVICES, reason="the CUDA kernels' model-family features")
@pytest.mark.parametrize("name", list(CUDA_FAMILIES))
def test_model_family_logits_on_cuda(name):
    spt.register(spt.BackendConfig())
    reference, length = FAMILIES[name][2], FAMILIES[name][3]
    models = [family_model(name, attn, **CUDA_FAMILIES[name]) for attn in (reference, "sparseprefill", reference)]
    want_model, ours, fp32 = (m.to("cuda", dtype) for m, dtype in zip(models, (torch.bfloat16, torch.bfloat16,
                                                                               torch.float32)))
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(5)).to("cuda")
    with torch.no_grad():
        want = want_model(ids).logits
        with sp.collect_stats() as log:
            got = ours(ids).logits
        ref = fp32(ids).logits.float()
    assert sorted(log.layers()) == [0, 1] and log.density() == 1.0
    assert_logits_close(got, want, ref, "cuda")

