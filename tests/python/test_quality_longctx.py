# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality.longctx: the settings it runs, the rule that picks the RULER settings
from the perplexity run, the order of the RULER items, greedy decoding (prefill through the
setting, decoding through SDPA) giving transformers' own greedy answers, and a results file made
with other arguments refused. scripts/model/qwen_dry_run.sh runs the whole command on a CPU."""

import argparse

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import sparseprefill.transformers as spt  # noqa: E402
from sparseprefill.quality import capture, longctx  # noqa: E402
from sparseprefill.quality.evaluate import Setting  # noqa: E402


def args(**kw):
    a = longctx.parse_args(["--model", "m", "--text", "t", "--calibration", "c", "--output", "o"])
    return argparse.Namespace(**dict(vars(a), **kw))


def test_settings():
    s = longctx.settings_from(args())
    labels = [x.label for x in s]
    assert labels[0] == "dense" and len(labels) == len(set(labels))
    base = 4 + 3 + 3 + 2 * 4 + 4
    assert len(s) == 1 + 2 * base  # every sparse setting again with 2 dense layers
    assert "estimate_select alpha=0.1" in labels and "estimate_select_mc alpha=0.1" in labels
    assert "permute_stop tau=0.01 dense_layers=2" in labels and "dense dense_layers=2" not in labels
    assert len(longctx.settings_from(args(dense_layer_variants=[]))) == 1 + base


def _ppl(entries, length=32768):
    return {st.label: {"lengths": {str(length): {"pair_density": d, "kl": kl}}} for st, d, kl in entries}


EG = [Setting("exact_gate", "budget", float(b)) for b in (4, 8, 16)]
ES = [Setting("estimate_select", "density_target", t) for t in (0.1, 0.3)]
FP = [Setting("estimate_select", "alpha", 0.1), Setting("estimate_select_mc", "alpha", 0.1)]
PS = [Setting("permute_stop", "tau", t) for t in (0.01, 0.1)]
VAR = Setting("exact_gate", "budget", 8.0, dense_layers=2)
DENSE = Setting("dense", "", 0.0)
ALL = [DENSE] + EG + ES + FP + PS + [VAR]


def test_choose_by_kl_under_the_density_bound():
    ppl = _ppl([(DENSE, 1, 0), (EG[0], 0.05, 0.3), (EG[1], 0.12, 0.1), (EG[2], 0.25, 0.01), (ES[0], 0.1, 0.05),
                (ES[1], 0.3, 0.02), (FP[0], 0.08, 0.06), (FP[1], 0.08, 0.05), (PS[0], 0.4, 0.01), (PS[1], 0.3, 0.1),
                (VAR, 0.18, 0.08)])
    chosen = longctx.choose(ppl, ALL, 32768, 0.2)
    # The published pair first; exact_gate: the dense-layer variant has the lowest KL under 0.2;
    # estimate_select: its calibrated targets only; permute_stop: none under 0.2, so the sparsest.
    assert [c.label for c in chosen] == ["estimate_select alpha=0.1", "estimate_select_mc alpha=0.1",
                                         "exact_gate budget=8 dense_layers=2", "estimate_select density_target=0.1",
                                         "permute_stop tau=0.1"]
    # A setting without a result at the length is not considered.
    del ppl[VAR.label]
    assert longctx.choose(ppl, ALL, 32768, 0.2)[2].label == "exact_gate budget=8"
    assert [c.policy for c in longctx.choose(ppl, ALL, 16384, 0.2)] == ["estimate_select", "estimate_select_mc"]


def test_ruler_queue_order():
    ppl = _ppl([(DENSE, 1, 0), (EG[0], 0.05, 0.3), (EG[1], 0.12, 0.1), (EG[2], 0.25, 0.01), (ES[0], 0.1, 0.05),
                (ES[1], 0.3, 0.02), (FP[0], 0.08, 0.06), (FP[1], 0.08, 0.05), (PS[0], 0.4, 0.01),
                (PS[1], 0.3, 0.1)])
    chosen = [FP[0], EG[1]]
    q = longctx.ruler_queue(ALL, chosen, ppl, 32768, [4096, 8192, 16384, 32768], [16384, 32768], -1)
    head = [(s.label, L) for s, L in q[:10]]
    assert head == [("dense", 32768), (FP[0].label, 32768), (EG[1].label, 32768),
                    ("dense", 16384), (FP[0].label, 16384), (EG[1].label, 16384),
                    ("dense", 8192), ("dense", 4096), (FP[0].label, 8192), (EG[1].label, 8192)]
    extras = [(s.label, L) for s, L in q[12:]]
    assert all(L == 32768 for _, L in extras)
    # Per policy the density nearest the chosen one's (by ratio) first, the policies in turn:
    # exact_gate's 0.25 (x2.1 of 0.12) before 0.05 (/2.4); estimate_select's 0.1 nearest 0.08; a
    # policy without a chosen setting (mean correction, permute_stop here) its densest first.
    assert [x for x, _ in extras[:5]] == ["exact_gate budget=16", "estimate_select density_target=0.1",
                                          "estimate_select_mc alpha=0.1", "permute_stop tau=0.01", "exact_gate budget=4"]
    assert set(extras) == {(s.label, 32768) for s in ALL[1:] if s not in chosen and s.dense_layers == 0}
    assert len(longctx.ruler_queue(ALL, chosen, ppl, 32768, [32768], [32768], 2)) == 3 + 2


def tiny_qwen():
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=4096)
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("prefill", ["sdpa", "sparseprefill"])
def test_greedy_is_transformers_greedy(prefill):
    spt.register(spt.BackendConfig(min_sparse_len=1))
    model = tiny_qwen()
    name = "sdpa" if prefill == "sdpa" else capture.register()
    prompts = torch.randint(0, 256, (3, 300), generator=torch.Generator().manual_seed(2)).tolist()
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = model.generate(torch.tensor(prompts), max_new_tokens=12, do_sample=False, min_new_tokens=12,
                              attention_mask=torch.ones(3, 300, dtype=torch.long))[:, 300:].tolist()
    model.set_attn_implementation(name)
    got, seconds = longctx.greedy(model, prompts, 12, [255], name)
    assert seconds > 0 and model.config._attn_implementation == name
    assert got == [row[:row.index(255)] if 255 in row else row for row in want]
    # An answer stops at its first EOS token; the others go on.
    stop = want[0][3]
    got, _ = longctx.greedy(model, prompts, 12, [stop], name)
    assert got[0] == want[0][:want[0].index(stop)]
    assert all(g == (w[:w.index(stop)] if stop in w else w) for g, w in zip(got[1:], want[1:]))


def test_results_of_other_arguments_refused(tmp_path):
    path = str(tmp_path / "r.json")
    run = longctx.Run(path, {"a": 1, "b": 2}, {"model": "m"})
    run.save()
    assert longctx.Run(path, {"a": 1, "b": 2}, {}).doc["meta"]["model"] == "m"
    with pytest.raises(SystemExit, match="b differ"):
        longctx.Run(path, {"a": 1, "b": 3}, {})
