# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality.report on a synthetic results document: ΔPPL relative to dense at the
same length, the target verdict (sparsest setting within 1% perplexity and dense's passkey
accuracy at every length), the mean-correction comparison, the per-density winners, and a page
that states them."""

import pytest

from sparseprefill.quality import report


def _length(ppl, kl, pair, passkey, layers=3):
    return {"ppl": ppl, "kl": kl, "top1_agreement": 1 - kl, "density": pair, "pair_density": pair,
            "passkey_accuracy": passkey, "seconds_ppl": 1.0, "seconds_passkey": 1.0,
            "layer_pair_density": [pair] * layers, "layer_density": [pair] * layers}


def _setting(policy, knob, value, per_length):
    label = "dense" if policy == "dense" else f"{policy} {knob}={value:g}"
    return {"policy": policy, "knob": knob, "value": value, "label": label,
            "lengths": {str(L): _length(*v) for L, v in per_length.items()}}


def doc():
    settings = [
        _setting("dense", "", 0, {1024: (10.0, 0.0, 1.0, 1.0), 2048: (9.0, 0.0, 1.0, 1.0)}),
        # exact_gate: budget 8 passes (+0.5%), budget 4 fails on passkey, budget 2 fails perplexity.
        _setting("exact_gate", "budget", 2, {1024: (10.5, 0.05, 0.2, 1.0), 2048: (9.5, 0.05, 0.15, 1.0)}),
        _setting("exact_gate", "budget", 4, {1024: (10.05, 0.01, 0.3, 1.0), 2048: (9.05, 0.01, 0.25, 0.5)}),
        _setting("exact_gate", "budget", 8, {1024: (10.05, 0.005, 0.5, 1.0), 2048: (9.045, 0.004, 0.45, 1.0)}),
        _setting("estimate_select", "density_target", 0.4, {1024: (10.3, 0.03, 0.4, 1.0), 2048: (9.3, 0.03, 0.4, 1.0)}),
        _setting("estimate_select_mc", "density_target", 0.4, {1024: (10.2, 0.02, 0.4, 1.0), 2048: (9.25, 0.04, 0.4, 1.0)}),
    ]
    points = []
    for layer in (0, 1):
        points += [{"policy": "exact_gate", "setting": f"budget={b}", "layer": layer, "density": d,
                    "pair_density": d, "rel_err": e} for b, d, e in ((2, 0.2, 0.1), (8, 0.6, 0.01))]
        points += [{"policy": "estimate_select", "setting": f"alpha={a}", "layer": layer, "density": d,
                    "pair_density": d, "rel_err": e} for a, d, e in ((0.1, 0.1, 0.5), (0.01, 0.5, 0.005))]
        points += [{"policy": "estimate_select_mc", "setting": f"alpha={a}", "layer": layer, "density": d,
                    "pair_density": d, "rel_err": e} for a, d, e in ((0.1, 0.1, 0.4), (0.01, 0.5, 0.006))]
    meta = {"model": "m", "model_file": "m.gguf", "model_sha256": "0" * 64, "dtype": "float32", "device": "cpu",
            "threads": 2, "architecture": {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 9,
                                           "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192},
            "text": {"path": "t.txt", "sha256": "1" * 64, "chars": 100, "split": "cut", "calibration_chars": [0, 40],
                     "evaluation_chars": [40, 100]},
            "held_out_tokens": 9000, "calibration": {"file": "c", "metadata": {}, "block": 64, "budgets": [2, 4, 8],
                                                     "skip_targets": [], "density_targets": [0.4], "estimate_base": {}},
            "ppl_windows": {"1024": [0], "2048": [1024]}, "passkey": {"depths": [0.5], "seed": 1},
            "dense_layers": 0, "segment": 512, "block": 64, "seconds_total": 10.0, "seconds_operator": 1.0,
            "versions": {}}
    return {"meta": meta, "settings": settings, "operator": {"length": 2048, "layers": [0, 1], "points": points},
            "attention_map": None}


def test_summary_verdicts():
    s = report.summarize(doc())
    r = next(r for r in s["rows"] if r["label"] == "exact_gate budget=8" and r["length"] == 2048)
    assert abs(r["dppl"] - (9.045 / 9.0 - 1)) < 1e-12
    density, label, _ = s["targets"]["exact_gate"]
    assert label == "exact_gate budget=8" and density == 0.475  # the mean over lengths
    assert s["targets"]["estimate_select"] is None and "permute_stop" not in s["targets"]  # not measured
    mc = {(m["target"], m["length"]): m for m in s["mc"]}
    assert mc[(0.4, 1024)]["kl_mc"] < mc[(0.4, 1024)]["kl"] and mc[(0.4, 2048)]["kl_mc"] > mc[(0.4, 2048)]["kl"]
    assert sorted(s["op_mc"]) == sorted([(0.5, 0.4), (0.005, 0.006)] * 2)
    # At density 0.5 exact_gate reads 0.1 * (0.01/0.1)^(0.3/0.4) and estimate_select 0.005: the latter wins.
    best, vals = s["winners_op"][0.5]
    assert best == "estimate_select" and abs(vals["exact_gate"] - 0.1 * 0.1 ** 0.75) < 1e-9
    assert s["winners_op"][0.1][0] == "estimate_select_mc"  # exact_gate's curve starts at 0.2
    assert s["winners_op"][0.7][0] is None


def test_render_states_results(tmp_path):
    text = report.render(doc(), "r.json", {})
    assert "| exact_gate | exact_gate budget=8 | 1024: 0.500, 2048: 0.450 | 1024: +0.50, 2048: +0.50 | " \
        "1024: 1.00 (1.00), 2048: 1.00 (1.00) |" in text
    assert "| estimate_select | none of the measured settings |" in text
    assert "mean correction lowers KL in 1 of 2" in text
    assert "NOT MEASURED" in text
    assert "exact_gate at `exact_gate budget=8` (density 0.50/0.45); not met by any measured setting: " \
        "estimate_select, estimate_select + mean correction." in text
    assert "| 0.5 | **estimate_select** 0.005 (then estimate_select + mean correction 0.006, exact_gate 0.0178) |" in text


def test_main_with_a_separate_run(tmp_path):
    import json

    main, extra = doc(), doc()
    extra["settings"] = [x for x in extra["settings"] if x["policy"] in ("dense", "exact_gate")]
    for x in extra["settings"]:
        x["lengths"] = {"8192": x["lengths"]["2048"]}
    paths = []
    for name, d in (("main", main), ("long", extra)):
        paths.append(str(tmp_path / f"{name}.json"))
        with open(paths[-1], "w") as f:
            json.dump(d, f)
    out = tmp_path / "docs" / "quality.md"
    out.parent.mkdir()
    assert report.main(paths + ["--output", str(out), "--img-dir", str(tmp_path / "docs" / "img")]) == 0
    text = out.read_text()
    assert "## Results at 8192 tokens (separate run" in text
    assert text.count("| exact_gate | exact_gate budget=8 |") == 2
    assert (tmp_path / "main.md").read_text().count("## Results at") == 3


def test_timing_section():
    d = doc()
    assert "NOT MEASURED" in report.render(d, "r.json", {})
    d["timing"] = {"repeats": 3, "seconds": {"torch sdpa": {"1024": 0.2, "2048": 0.5},
                                             "dense": {"1024": 0.25, "2048": 0.6},
                                             "exact_gate budget=8": {"1024": 0.125, "2048": 0.2}}}
    text = report.render(d, "r.json", {})
    assert "NOT MEASURED" not in text
    assert "| exact_gate budget=8 | 125.0 | 2.00 | 1.60 | 200.0 | 3.00 | 2.50 |" in text
    assert "not a speed result" in text


def test_per_length_targets():
    d = doc()
    for x in d["settings"]:  # estimate_select: within 1% at 2048 (+0.2%), not at 1024 (+3%)
        if x["policy"] == "estimate_select":
            x["lengths"]["2048"]["ppl"] = 9.018
    s = report.summarize(d)
    per = s["per_length"]["estimate_select"]
    assert per[1024] is None and per[2048]["label"] == "estimate_select density_target=0.4"
    assert "exact_gate" not in s["per_length"]  # one setting serves every length
    text = report.render(d, "r.json", {})
    assert "- estimate_select, length by length: at 1024 no setting (best passkey 1.00, dense 1.00); at 2048 " \
        "`estimate_select density_target=0.4` (density 0.40, ΔPPL +0.20%)." in text


def test_timing_host_bound_note():
    d = doc()
    d["meta"]["device"] = "cuda"
    d["timing"] = {"repeats": 3, "seconds": {"torch sdpa": {"1024": 0.03, "2048": 0.03},
                                             "dense": {"1024": 0.05, "2048": 0.051}}}
    assert "bound by per-call host work" in report.render(d, "r.json", {})  # 4x the work, 1.02x the time
    d["timing"]["seconds"]["dense"]["2048"] = 0.19
    assert "bound by per-call host work" not in report.render(d, "r.json", {})


def test_passkey_flips_name_the_deciding_prompt():
    d = doc()

    def prompts(answers):
        return [{"depth": depth, "key": key, "predicted": " " + ans, "retrieved": ans == key}
                for depth, key, ans in zip((0.25, 0.75), ("11111", "22222"), answers)]

    for x in d["settings"]:
        for per in x["lengths"].values():
            per["passkey"] = prompts(("11111", "22222"))
    # exact_gate budget=4 (accuracy 0.5 at 2048) and estimate_select miss the same prompt.
    for label in ("exact_gate budget=4", "estimate_select density_target=0.4"):
        x = next(x for x in d["settings"] if x["label"] == label)
        x["lengths"]["2048"]["passkey"] = prompts(("11111", "2.222"))
        x["lengths"]["2048"]["passkey_accuracy"] = 0.5
    s = report.summarize(d)
    assert s["passkey_flips"]["1024"] == []
    [flip] = s["passkey_flips"]["2048"]
    assert (flip["depth"], flip["key"], flip["dense"], flip["dense_ok"]) == (0.75, "22222", "22222", True)
    assert [x[0] for x in flip["flips"]] == ["exact_gate budget=4", "estimate_select density_target=0.4"]
    text = report.render(d, "r.json", {})
    assert "| 2048 | 0.75 | 22222 | 22222 (right) | exact_gate budget=4 (2.222), " \
        "estimate_select density_target=0.4 (2.222) |" in text
    assert "at 2048 no setting (best passkey 0.50, dense 1.00; decided by the prompt at depth 0.75 (dense " \
        "'22222', right; `estimate_select density_target=0.4` '2.222'), which 1 setting(s) of 1 other policies " \
        "also answer otherwise)" in text


def test_records_without_answers_have_no_flips():
    s = report.summarize(doc())  # passkey accuracies only, as the oldest records hold
    assert all(v == [] for v in s["passkey_flips"].values())
    assert "Passkey prompts on which" not in report.render(doc(), "r.json", {})


def test_mean_correction_differences_below_the_kl_floor_are_ties():
    d = doc()
    s = report.summarize(d)
    # No setting keeps >= 0.95 of the pairs in doc(): no floor, every difference counts.
    assert {(m["length"], m["floor"]) for m in s["mc"]} == {(1024, 0.0), (2048, 0.0)}
    # A near-dense setting at 1024 sets the floor there, and 2048 inherits it.
    d["settings"].append(_setting("estimate_select", "density_target", 0.97, {1024: (10.001, 0.004, 0.97, 1.0),
                                                                              2048: (9.001, 0.0, 1.0, 1.0)}))
    s = report.summarize(d)
    assert {(m["length"], m["floor"]) for m in s["mc"]} == {(1024, 0.004), (2048, 0.004)}
    text = report.render(d, "r.json", {})
    assert "lowers KL in 1 of 2 (target, length) pairs; counting a difference below the length's KL floor as a " \
        "tie: lower in 1, higher in 1, tied in 0" in text
    mc = next(x for x in d["settings"] if x["policy"] == "estimate_select_mc")
    mc["lengths"]["2048"]["kl"] = 0.031  # 0.001 above estimate_select's 0.03: below the floor 0.004
    text = report.render(d, "r.json", {})
    assert "lower in 1, higher in 0, tied in 1" in text
    assert "| 0.4 | 2048 | 0.400 | 0.03 | 0.031 | no | 0.004 | tie |" in text
    assert "(or, without one, of the nearest shorter length)" in text


def test_operator_timing_section():
    d = doc()
    assert "## Operator time on real activations" not in report.render(d, "r.json", {})
    d["meta"]["device"] = "cuda"
    d["operator"]["dense_cuda"] = {"0": {"ms": 0.4, "select_ms": 0.0, "attend_ms": 0.3},
                                   "1": {"ms": 0.6, "select_ms": 0.0, "attend_ms": 0.5}}
    d["operator"]["timing_repeats"] = 5
    for p in d["operator"]["points"]:
        if p["policy"] == "estimate_select":  # layer 0 and 1: 0.2 and 0.3 ms, selection 0.05 and 0.07
            p.update({"cuda_ms": 0.2 + 0.1 * p["layer"], "cuda_select_ms": 0.05 + 0.02 * p["layer"],
                      "cuda_attend_ms": 0.1})
    text = report.render(d, "r.json", {})
    assert "Dense: 0.500 ms per call (0.400 ms in its kernel)" in text
    # Averaged over the two layers: 0.25 ms, 2.00x dense, selection 0.06 ms.
    assert "| estimate_select | alpha=0.1 | 0.100 | 0.250 | 2.00 | 0.060 | 0.100 |" in text
    assert "| exact_gate |" not in text.split("## Operator time on real activations")[1].split("##")[0]


def test_mc_analysis_section_and_summary():
    points = [{"layer": 0, "alpha": 0.1, "density": 0.5, "library_mc": 0.1000001, "none": 0.2, "zero_order": 0.1,
               "exact_mass": 0.3, "exact_value": 0.05, "exact": 1e-16, "mass_share": 0.1},
              {"layer": 1, "alpha": 0.1, "density": 0.6, "library_mc": 0.25, "none": 0.2, "zero_order": 0.25,
               "exact_mass": 0.1, "exact_value": 0.2, "exact": 2e-16, "mass_share": 0.3}]
    mc = {"model": "m", "length": 4096, "block": 128, "command": "python -m sparseprefill.quality.mc_analysis x",
          "points": points}
    assert "Why mean correction" not in report.render(doc(), "r.json", {})
    text = report.render(doc(), "r.json", {}, (), (mc, "a.json"))
    assert "its pseudo-tokens carry 10%–30% of the pruned blocks' true mass" in text  # the summary
    assert "| 0 | 0.1 | 0.500 | 0.2000 | 0.1000 | 0.3000 | 0.0500 | 0.100 |" in text
    assert "to within 1e-07" in text and "dense to within 2e-16" in text
    assert "higher than with no correction at all in 1 of 2 cases" in text
    assert "lowers the error in 1 of 2 cases, by 50.0% at the median (-25.0% to +50.0%)" in text
    assert "python -m sparseprefill.quality.mc_analysis x\npython -m sparseprefill.quality.report r.json " \
        "--mc-analysis a.json" in text


def test_default_page_is_the_records_checkout(tmp_path, monkeypatch):
    import json

    assert report.docs_dir_of("/a/b/bench/records/quality/x.json") == "/a/b/docs"
    assert report.docs_dir_of("/a/bench/x.json") is None
    records = tmp_path / "repo" / "bench" / "records" / "quality"
    records.mkdir(parents=True)
    (tmp_path / "repo" / "docs").mkdir()
    path = records / "main.json"
    path.write_text(json.dumps(doc()))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert report.main([str(path)]) == 0
    assert (tmp_path / "repo" / "docs" / "quality.md").exists() and not list(elsewhere.iterdir())
    stray = tmp_path / "stray.json"
    stray.write_text(json.dumps(doc()))
    with pytest.raises(SystemExit):
        report.main([str(stray)])
