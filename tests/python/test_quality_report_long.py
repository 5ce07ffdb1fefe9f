# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality.report_long on a hand-made longctx results document: the RULER
average and its paired difference from dense, the sparsest setting per policy within 1 point,
the recommendation by measured speed-up, the issue's density target, mean correction and dense
first layers compared, the items not measured; and report.main putting the section first on the
page (or saying it is not yet measured) while the small model's record page stays as it was."""

import gzip
import json

import pytest

from sparseprefill.quality import report, report_long, ruler

from test_quality_report import doc as smollm_doc

TASKS = ["niah_single", "qa"]
SAMPLES = 4


def _setting(label, policy, knob="", value=0.0, dense_layers=0):
    return {"label": label, "policy": policy, "knob": knob, "value": value, "dense_layers": dense_layers,
            "per_layer_value": []}


SETTINGS = [_setting("dense", "dense"), _setting("exact_gate budget=8", "exact_gate", "budget", 8),
            _setting("exact_gate budget=16", "exact_gate", "budget", 16),
            _setting("estimate_select alpha=0.1", "estimate_select", "alpha", 0.1),
            _setting("estimate_select_mc alpha=0.1", "estimate_select_mc", "alpha", 0.1),
            _setting("permute_stop tau=0.01", "permute_stop", "tau", 0.01),
            _setting("exact_gate budget=16 dense_layers=2", "exact_gate", "budget", 16, 2)]


def _item(scores, density, seconds=10.0):
    tasks = {t: [{"index": i, "score": s, "pred": "x", "tokens": 3} for i, s in enumerate(v)] for t, v in scores.items()}
    return {"tasks": tasks, "visible_pairs": 1000, "computed_pairs": int(1000 * density), "seconds": seconds,
            "prefill_seconds": seconds / 2}


def _ppl(density, kl, ppl):
    return {"tokens": 100, "nll": 1.0, "ppl": ppl, "kl": kl, "top1_agreement": 1 - kl, "top1_accuracy": 0.5,
            "density": density, "pair_density": density, "layer_pair_density": [density, density],
            "head_pair_density": [[density] * 2, [density] * 2]}


def long_doc():
    ppl = {"dense": (1.0, 0.0, 10.0), "exact_gate budget=8": (0.08, 0.2, 11.0), "exact_gate budget=16": (0.3, 0.05, 10.2),
           "estimate_select alpha=0.1": (0.1, 0.04, 10.1), "estimate_select_mc alpha=0.1": (0.1, 0.03, 10.05),
           "permute_stop tau=0.01": (0.15, 0.02, 10.02), "exact_gate budget=16 dense_layers=2": (0.35, 0.01, 10.01)}
    full = [1, 1, 1, 1]
    results = {
        "dense": {"32768": _item({"niah_single": full, "qa": [1, 1, 0, 1]}, 1.0)},
        "exact_gate budget=8": {"32768": _item({"niah_single": [1, 1, 1, 0], "qa": [1, 1, 0, 1]}, 0.08)},
        "exact_gate budget=16": {"32768": _item({"niah_single": full, "qa": [1, 1, 0, 1]}, 0.3)},
        "estimate_select alpha=0.1": {"32768": _item({"niah_single": full, "qa": [1, 1, 0, 1]}, 0.1)},
        "estimate_select_mc alpha=0.1": {"32768": _item({"niah_single": full, "qa": full}, 0.1)},
        "permute_stop tau=0.01": {"32768": _item({"niah_single": [1, 1]}, 0.15)},
    }
    results["permute_stop tau=0.01"]["32768"]["tasks"]["qa"] = []
    meta = {"model": "Qwen2.5-Coder-1.5B-Instruct", "dtype": "bfloat16", "device": "cuda",
            "architecture": {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 2,
                             "num_key_value_heads": 1, "head_dim": 128, "max_position_embeddings": 32768,
                             "rope_theta": 1e6},
            "text": {"path": "policy.txt", "sha256": "a" * 64, "chars": 478130}, "held_out_tokens": 112458,
            "ppl_windows": {"32768": [0]},
            "calibration": {"file": "cal.safetensors", "block": 128, "budgets": [8, 16], "skip_targets": [],
                            "density_targets": [], "estimate_base": {"block": 128, "sink": 2, "window": 4, "tail": 2},
                            "metadata": {"text": "debian-reference.en.txt", "text_sha256": "b" * 64,
                                         "text_chars": "0:868673 (the whole document)",
                                         "sample_tokens": "3 windows x 32768 tokens from token 0 of the document",
                                         "command": "python -m sparseprefill.quality.calibrate --whole-text"}},
            "segment": 2048, "published_alpha": 0.1, "max_density": 0.2,
            "ruler": {"tasks": {t: {"name": t, "category": ruler.TASKS[t].category, "metric": ruler.TASKS[t].metric,
                                    "max_new": ruler.TASKS[t].max_new, "about": ruler.TASKS[t].about} for t in TASKS},
                      "lengths": [16384, 32768], "samples": SAMPLES, "seed": 0, "intervals": "as stated",
                      "haystack": {"body_tokens": 107338, "qa_sections": 83}},
            "versions": {"torch": "2.11"}}
    return {"meta": meta, "settings": SETTINGS,
            "ppl": {s["label"]: {"setting": s, "lengths": {"32768": _ppl(*ppl[s["label"]])}} for s in SETTINGS},
            "timing": {"repeats": 3, "seconds": {"torch sdpa (cuDNN)": {"32768": 0.35}, "dense": {"32768": 0.32},
                                                 "exact_gate budget=8": {"32768": 0.15},
                                                 "exact_gate budget=16": {"32768": 0.25},
                                                 "estimate_select alpha=0.1": {"32768": 0.2},
                                                 "estimate_select_mc alpha=0.1": {"32768": 0.22}}},
            "ruler": {"chosen": ["estimate_select alpha=0.1", "estimate_select_mc alpha=0.1", "exact_gate budget=8",
                                 "permute_stop tau=0.01"],
                      "queue": [["dense", 32768], ["estimate_select alpha=0.1", 32768],
                                ["permute_stop tau=0.01", 32768], ["dense", 16384]],
                      "results": results},
            "calls": [{"date": "2026-12-01T10:00:00", "seconds": 530.0, "stopped": "deadline",
                       "command": "python -m sparseprefill.quality.longctx --output r.json"}]}


def test_summary_numbers():
    s = report_long.summarize(long_doc())
    by = s["by"]
    dense = by[("dense", 32768)]
    assert dense["complete"] and dense["avg"] == pytest.approx(87.5)
    assert dense["tasks"]["qa"][0] == 75.0 and dense["tasks"]["qa"][1] < 75 < dense["tasks"]["qa"][2]
    eg8 = by[("exact_gate budget=8", 32768)]
    assert eg8["diff"] == pytest.approx(-12.5) and eg8["diff_hi"] <= 0 and eg8["vs_base"] == pytest.approx(0.35 / 0.15)
    assert by[("estimate_select alpha=0.1", 32768)]["diff"] == 0.0
    assert not by[("permute_stop tau=0.01", 32768)]["complete"]
    assert "diff" not in by[("permute_stop tau=0.01", 32768)]
    # exact_gate: budget 16 (density 0.3) is within 1 point, budget 8 is not; the sparsest within is 16.
    within, best = s["within"][32768]["exact_gate"]
    assert within["label"] == "exact_gate budget=16" and best["label"] == "exact_gate budget=16"
    assert s["within"][32768]["permute_stop"] == (None, None)  # incomplete: not judged
    # The recommendation: the highest measured speed-up over cuDNN among the settings within 1 point.
    assert s["recommend"][32768]["label"] == "estimate_select alpha=0.1"
    # The target (within 1 point at density <= 0.2): met by estimate_select, not by exact_gate.
    assert s["targets"]["estimate_select"][0]["label"] == "estimate_select alpha=0.1"
    assert s["targets"]["exact_gate"][0] is None
    mc = {m["kind"]: m for m in s["mc"]}
    assert mc["ruler"]["diff"] == pytest.approx(12.5) and mc["ruler"]["diff_lo"] == 0.0
    assert mc["kl"]["with"]["kl"] == 0.03 and mc["kl"]["without"]["kl"] == 0.04
    [layers] = s["layers"]
    assert layers["plain"]["kl"] == 0.05 and layers["variant"]["kl"] == 0.01
    assert s["missing"] == [("permute_stop tau=0.01", 32768), ("dense", 16384)]


def test_render_states_them():
    text = "\n".join(report_long.render(long_doc(), "r.json", {}))
    assert "## Long context: Qwen2.5-Coder-1.5B-Instruct, 16K–32K tokens (issue 32)" in text
    assert "| 32K | exact_gate | `exact_gate budget=16` | 0.300 |" in text
    assert "| 32K | estimate_select | `estimate_select alpha=0.1` | 0.100 | 87.5 [" in text
    assert "| 32K | estimate_select + mean correction | `estimate_select+mc alpha=0.1` | 0.100 | 100.0 [100.0, 100.0] | " \
        "+12.5 [+0.0, +37.5] | 1.59 |" in text
    assert "| 32K | estimate_select `estimate_select alpha=0.1` | 0.100 | +0.0 [+0.0, +0.0] | 1.75 | the highest " \
        "measured prefill speed-up" in text
    assert "**estimate_select at 32K**: `estimate_select alpha=0.1` keeps 0.100 of the pairs" in text and \
        "target met; prefill 1.75× torch sdpa (cuDNN)." in text
    assert "**exact_gate at 32K**: no measured setting within 1 point at density ≤ 0.2; the sparsest within it " \
        "`exact_gate budget=16` (density 0.300" in text
    assert "| permute_stop tau=0.01 | – | incomplete (2 of 8 prompts) |" in text
    assert "| exact_gate budget=8 | 0.080 | 75.0 [" in text and "| 75 | 75 | 150.0 | 2.33 | 2.13 |" in text
    # One qa prompt flips: drawn 0 to 3 times of 4 in the bootstrap, over two tasks.
    assert "Mean correction** (alpha 0.1, 32K): RULER with minus without +12.5 [+0.0, +37.5] points — the interval " \
        "holds 0: no effect shown." in text
    assert "lower KL in 1 of 1 settings at 32K; the mean density goes from 0.300 to 0.350" in text
    assert "| 0.1 | 32K | KL (nats/token) | 0.100 / 0.100 | 0.04 | 0.03 | -0.01 |" in text
    assert "| exact_gate budget=16 | 2 | 0.350 | 0.01 | +0.10 |" in text
    assert "`permute_stop tau=0.01` @ 32K, `dense` @ 16K." in text
    assert "different document from the evaluation text" in text
    assert "| exact_gate budget=16 | 0.300 | +2.00 | 0.05 | 0.950 | 250.0 | 1.40 | 1.28 |" in text
    assert "| permute_stop tau=0.01 | 0.150 | +0.20 | 0.02 | 0.980 | – | – | – |" in text
    assert "median of 3 runs: torch sdpa (cuDNN) 350.0 ms" in text


def test_summary_names_the_best_difference_when_none_is_within_the_tolerance():
    s = report_long.summarize(long_doc())
    hit, mine = s["targets"]["exact_gate"]
    s["targets"]["exact_gate"] = (hit, [r for r in mine if r["label"] != "exact_gate budget=16"])
    text = "\n".join(report_long._summary(s))
    assert "**exact_gate at 32K**: no measured setting within 1 point at density ≤ 0.2; closest " \
        "`exact_gate budget=8` (density 0.080, Δ -12.5 [" in text


def test_recommendation_needs_a_faster_prefill():
    d = long_doc()
    for name, per in d["timing"]["seconds"].items():
        if name != "torch sdpa (cuDNN)":
            per["32768"] = 0.5  # every setting slower than SDPA with cuDNN
    s = report_long.summarize(d)
    assert s["recommend"][32768] is None
    assert "| 32K | dense (no measured setting within 1 point prunes pairs and beats torch sdpa (cuDNN) where " \
        "timed) |" in "\n".join(report_long.render(d, "r.json", {}))
    d["timing"] = None  # untimed: the sparsest setting within 1 point
    assert report_long.summarize(d)["recommend"][32768]["label"] == "estimate_select alpha=0.1"


def test_failures_are_reported():
    d = long_doc()
    d["errors"] = {"ruler": {"permute_stop tau=0.01 @ 32768": "UnsupportedError: no kernel"},
                   "ppl": {"softmax_skip skip_target=0.9": "CudaError: launch failed"}}
    text = "\n".join(report_long.render(d, "r.json", {}))
    assert "| permute_stop tau=0.01 | – | failed: UnsupportedError: no kernel |" in text
    assert "| ppl | softmax_skip skip_target=0.9 | CudaError: launch failed |" in text
    assert "`dense` @ 16K." in text and "`permute_stop tau=0.01` @ 32K" not in text  # failed, not missing


def test_report_main_puts_the_long_section_first(tmp_path):
    main_path, long_path = tmp_path / "small.json", tmp_path / "long.json"
    main_path.write_text(json.dumps(smollm_doc()))
    long_path.write_text(json.dumps(long_doc()))
    out = tmp_path / "docs" / "quality.md"
    out.parent.mkdir()
    img = tmp_path / "docs" / "img"
    assert report.main([str(main_path), "--output", str(out), "--img-dir", str(img)]) == 0
    before = (tmp_path / "small.md").read_text()
    page = out.read_text()
    assert "NOT YET MEASURED" in page and page.index("## Long context") < page.index("## Setup")
    assert report.main([str(main_path), "--output", str(out), "--img-dir", str(img), "--long", str(long_path)]) == 0
    page = out.read_text()
    assert "NOT YET MEASURED" not in page and page.index("### Sparsest setting per policy") < page.index("## Setup")
    assert "--long " in page.split("\n")[2] and "## m: the quick check" in page
    assert (tmp_path / "small.md").read_text() == before  # the small model's record page is its own
    beside = (tmp_path / "long.md").read_text()
    assert beside.startswith("# Long-context quality") and "### Recommendation" in beside
    pytest.importorskip("matplotlib")
    assert {p.name for p in img.iterdir()} >= {"long-ruler-frontier.png", "long-kl-frontier.png",
                                              "long-layer-density.png", "long-head-density.png"}


def test_report_main_reads_a_compressed_long_record_as_the_plain_one(tmp_path):
    main_path = tmp_path / "small.json"
    main_path.write_text(json.dumps(smollm_doc()))
    plain, packed = tmp_path / "plain" / "long.json", tmp_path / "packed" / "long.json.gz"
    plain.parent.mkdir()
    packed.parent.mkdir()
    plain.write_text(json.dumps(long_doc()))
    with gzip.open(packed, "wt") as f:
        f.write(json.dumps(long_doc()))
    pages = []
    for long_path in (plain, packed):
        out = long_path.parent / "quality.md"
        assert report.main([str(main_path), "--output", str(out), "--img-dir", str(long_path.parent / "img"),
                            "--long", str(long_path)]) == 0
        beside = long_path.parent / "long.md"  # STEM.md beside the record, .json.gz stripped whole
        assert beside.exists()
        pages.append((out.read_text(), beside.read_text()))
    (page_plain, beside_plain), (page_packed, beside_packed) = pages
    assert page_packed == page_plain.replace("plain/long.json", "packed/long.json.gz")
    assert beside_packed == beside_plain.replace("plain/long.json", "packed/long.json.gz")
