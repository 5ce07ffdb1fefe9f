# SPDX-License-Identifier: Apache-2.0
"""python -m sparseprefill.quality.evaluate: dense and every policy at several settings on the
held-out part of a text, through attn_implementation="sparseprefill" with per-layer policies
from a calibration file. Per setting and length: perplexity, KL(dense || policy) of the
next-token distributions, top-1 agreement with dense, passkey retrieval at several depths,
density per layer and head. Operator level: real Q/K/V captured from the dense run, relative
error of every policy's attention output against density. Writes one JSON file."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import capture, data, metrics

__all__ = ["Setting", "settings_from", "layer_policy", "backend_config", "ppl_window", "prefill_times",
           "per_layer_values", "dumps", "main"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One evaluated configuration: a policy name, the value of its knob, and how many of the
    first layers run dense."""

    policy: str          # dense, exact_gate, softmax_skip, estimate_select, estimate_select_mc, permute_stop
    knob: str            # budget, skip_target, density_target, alpha (estimate_select, not calibrated), tau,
    value: float         # or "" for dense
    dense_layers: int = 0

    @property
    def label(self) -> str:
        base = "dense" if self.policy == "dense" else f"{self.policy} {self.knob}={self.value:g}"
        return base + (f" dense_layers={self.dense_layers}" if self.dense_layers else "")


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.quality.evaluate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data.add_model_args(p, "the long document (UTF-8); its held-out part is evaluated")
    p.add_argument("--calibration", required=True, help="file from python -m sparseprefill.quality.calibrate")
    p.add_argument("--output", required=True, help="results JSON")
    p.add_argument("--lengths", type=_ints, default=[2048, 4096], help="prompt lengths in tokens")
    p.add_argument("--windows", type=_ints, default=[2, 1],
                   help="perplexity windows per length (one value per --lengths entry)")
    p.add_argument("--passkey-depths", type=_floats, default=[0.1, 0.5, 0.9])
    p.add_argument("--budgets", type=_ints, default=[4, 8, 16], help="exact_gate budgets (of the file)")
    p.add_argument("--skip-targets", type=_floats, default=[0.4, 0.6, 0.8], help="softmax_skip targets (of the file)")
    p.add_argument("--density-targets", type=_floats, default=[0.3, 0.5, 0.7],
                   help="estimate_select targets (of the file), run without and with mean correction")
    p.add_argument("--taus", type=_floats, default=[0.001, 0.01, 0.05], help="permute_stop tau values")
    p.add_argument("--segment", type=int, default=512, help="permute_stop segment")
    p.add_argument("--dense-layers", type=int, default=0, help="layers [0, n) always dense")
    p.add_argument("--operator-layers", type=_ints, default=[2, 10, 20, 29],
                   help="layers whose Q/K/V are captured for the operator-level sweep")
    p.add_argument("--only", default="", help="comma-separated policy names to run (default: all)")
    p.add_argument("--cli", help="sparseprefill CLI for the kept-block map (optional)")
    p.add_argument("--map-layer", type=int, default=15, help="layer of the attention map figure (-1: none)")
    p.add_argument("--timing-repeats", type=int, default=0,
                   help="prefill timing: timed runs per setting and length after one warm-up (0: not measured; "
                        "meant for the GPU, where torch SDPA with cuDNN is timed too); on a CUDA device also the "
                        "operator sweep's calls on the captured Q/K/V")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=7, help="passkey digits")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> List[Setting]:
    out = [Setting("dense", "", 0.0)]
    out += [Setting("exact_gate", "budget", b) for b in args.budgets]
    out += [Setting("softmax_skip", "skip_target", t) for t in args.skip_targets]
    out += [Setting("estimate_select", "density_target", t) for t in args.density_targets]
    out += [Setting("estimate_select_mc", "density_target", t) for t in args.density_targets]
    out += [Setting("permute_stop", "tau", t) for t in args.taus]
    only = [x for x in args.only.split(",") if x]
    return [s for s in out if not only or s.policy in only or s.policy == "dense"]


def layer_policy(setting: Setting, cal: Any, layer: int, block: int, segment: int) -> Any:
    """The policy one layer runs under `setting` (calibrated values are per layer)."""
    import sparseprefill as sp

    if setting.policy == "dense":
        return sp.Dense()
    if setting.policy == "exact_gate":
        return cal.exact_gate(layer, int(setting.value))
    if setting.policy == "softmax_skip":
        return cal.softmax_skip(layer, setting.value)
    if setting.policy in ("estimate_select", "estimate_select_mc"):
        mc = setting.policy == "estimate_select_mc"
        if setting.knob == "alpha":  # one alpha for every layer (FlashPrefill V2's published 0.1, say)
            base = cal.estimate_base or sp.EstimateSelect(block=block)
            return dataclasses.replace(base, alpha=setting.value, mean_correction=mc)
        return dataclasses.replace(cal.estimate_select(layer, setting.value), mean_correction=mc)
    if setting.policy == "permute_stop":
        return sp.PermuteStop(segment=segment, tau=setting.value, block_q=block, block_k=block)
    raise ValueError(f"policy: unknown {setting.policy}")


def backend_config(setting: Setting, cal: Any, layers: int, block: int, segment: int, dense_layers: int) -> Any:
    import sparseprefill as sp
    import sparseprefill.transformers as spt

    return spt.BackendConfig(policy=sp.Dense(), dense_layers=dense_layers, min_sparse_len=1,
                             layer_policies={l: layer_policy(setting, cal, l, block, segment) for l in range(layers)})


def ppl_window(model: Any, ids: List[int], dense_hidden: Any = None, chunk: int = 4096) -> Tuple[metrics.TokenSums, Any]:
    """One perplexity window: (sums over its predicted positions, the final hidden states
    [len(ids) - 1, hidden] that predict them). With dense_hidden (dense's hidden states of the
    same window) the sums hold KL(dense || this run) and top-1 agreement; the logits are the
    LM head of the hidden states (what the model's logits are for Llama and Qwen2), computed
    chunk positions at a time."""
    import torch

    x = torch.tensor([ids], device=model.device)
    with torch.no_grad():
        hidden = model.model(x, use_cache=False).last_hidden_state[0, :-1]
        sums = metrics.hidden_sums(model.lm_head, hidden, x[0, 1:], dense_hidden, chunk)
    return sums, hidden


def prefill_times(model: Any, inputs: Dict[int, List[int]], settings: List[Setting], config_for: Any,
                  repeats: int, baselines: bool = True) -> Dict[str, Any]:
    """Median wall time of the model's prefill (the decoder stack without the LM head, no KV cache)
    per length: torch SDPA (default backend selection; on CUDA also cuDNN only; left out without
    `baselines`), then every setting through the sparseprefill backend. One warm-up run each;
    CUDA is synchronised."""
    import torch

    import sparseprefill.transformers as spt

    cuda = model.device.type == "cuda"

    def timed(x: Any) -> float:
        samples = []
        for i in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.model(x, use_cache=False)
            if cuda:
                torch.cuda.synchronize()
            if i:
                samples.append(time.perf_counter() - t)
        return float(np.median(samples))

    xs = {L: torch.tensor([ids], device=model.device) for L, ids in inputs.items()}
    out: Dict[str, Any] = {"repeats": repeats, "seconds": {}}
    if baselines:
        model.set_attn_implementation("sdpa")
        out["seconds"]["torch sdpa"] = {str(L): timed(x) for L, x in xs.items()}
        if cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                out["seconds"]["torch sdpa (cuDNN)"] = {str(L): timed(x) for L, x in xs.items()}
    model.set_attn_implementation(capture.NAME)
    for st in data.progress(settings, desc="prefill timing"):
        spt.set_config(config_for(st))
        out["seconds"][st.label] = {str(L): timed(x) for L, x in xs.items()}
    return out


# Kernels of a CUDA call that decide what to compute (estimate_select's block means and
# selector, permute_stop's ranking and sorts); the rest of a call's kernel time is attention.
_SELECTION_KERNELS = ("block_means_kernel", "select_kernel", "prefix_scores_kernel", "guide_kernel", "q_mean_kernel",
                      "order_init_kernel", "DeviceSegmentedRadixSort")


def cuda_times(q: Any, k: Any, v: Any, policy: Any, repeats: int) -> Dict[str, float]:
    """One policy on CUDA tensors: ms, the median of `repeats` calls after a warm-up (CUDA
    events around each call), and one profiled call's kernel time split into select_ms (the
    selection kernels) and attend_ms (the rest, copies excluded)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import sparseprefill as sp

    def call() -> None:
        sp.run(q, k, v, policy, causal=True, stats=False)

    call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    select_us = attend_us = 0.0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.device_time_total <= 0:
            continue
        if any(n in e.name for n in _SELECTION_KERNELS):
            select_us += e.device_time_total
        elif not e.name.startswith(("Memcpy", "Memset")):
            attend_us += e.device_time_total
    return {"ms": float(np.median(times)), "select_ms": select_us / 1e3, "attend_ms": attend_us / 1e3}


def operator_sweep(qkv: Dict[int, Any], cal: Any, block: int, segment: int,
                   timing_repeats: int = 0) -> Tuple[List[Dict[str, Any]], Dict[str, Dict[str, float]]]:
    """Every policy over a grid of settings on captured Q/K/V [1, s, h, d] (fp32 NumPy), against
    the CPU backend's dense output: (policy, setting, layer, density, pair_density, rel_err).
    timing_repeats > 0 (a CUDA device): each point also gets cuda_times() on the same Q/K/V in
    bf16 on the GPU (cuda_ms, cuda_select_ms, cuda_attend_ms), and the second result holds
    dense's cuda_times per layer."""
    import sparseprefill as sp

    alphas = [0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3]
    taus = [0.0003, 0.001, 0.003, 0.01, 0.03, 0.1]
    points = []
    grid = (len(cal.gate_budgets) + len(cal.skip_targets) + 2 * len(alphas) + len(taus)) * len(qkv)
    bar = data.progress(total=grid, desc="operator sweep")
    dense_times: Dict[str, Dict[str, float]] = {}
    for layer, (q, k, v) in qkv.items():
        dense = sp.run(q, k, v, sp.Dense(), causal=True).out
        on_gpu = None
        if timing_repeats > 0:
            import torch

            on_gpu = [torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q, k, v)]
            dense_times[str(layer)] = cuda_times(*on_gpu, sp.Dense(), timing_repeats)
        cases = [("exact_gate", f"budget={b}", cal.exact_gate(layer, b)) for b in cal.gate_budgets]
        cases += [("softmax_skip", f"skip_target={t:.6g}", cal.softmax_skip(layer, t)) for t in cal.skip_targets]
        base = cal.estimate_select(layer, cal.density_targets[0])
        for mc in (False, True):
            name = "estimate_select_mc" if mc else "estimate_select"
            cases += [(name, f"alpha={a:g}", dataclasses.replace(base, alpha=a, mean_correction=mc)) for a in alphas]
        cases += [("permute_stop", f"tau={t:g}", sp.PermuteStop(segment=segment, tau=t, block_q=block, block_k=block))
                  for t in taus]
        for name, setting, policy in cases:
            r = sp.run(q, k, v, policy, causal=True)
            points.append({"policy": name, "setting": setting, "layer": layer, "density": r.stats.density,
                           "pair_density": r.stats.pair_density, "rel_err": metrics.relative_error(r.out, dense)})
            if on_gpu is not None:
                t = cuda_times(*on_gpu, policy, timing_repeats)
                points[-1].update({"cuda_ms": t["ms"], "cuda_select_ms": t["select_ms"],
                                   "cuda_attend_ms": t["attend_ms"]})
            bar.update(1)
    bar.close()
    return points, dense_times


def attention_map(q: np.ndarray, k: np.ndarray, v: np.ndarray, layer: int, head: int, block: int, cal_path: str,
                  cli: Optional[str], settings: List[Setting]) -> Dict[str, Any]:
    """Block-averaged attention probabilities of one head ([q_blocks, k_blocks]: mean over the
    block's rows of the block's probability mass) and the kept blocks of the block policies
    (read from `sparseprefill run`'s `kept` output)."""
    s, h_q, d = q.shape[1], q.shape[2], q.shape[3]
    group = h_q // k.shape[2]
    qh = q[0, :, head].astype(np.float64)
    kh = k[0, :, head // group].astype(np.float64)
    scores = (qh @ kh.T) / np.sqrt(d)
    scores[np.triu_indices(s, 1)] = -np.inf
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    nb = -(-s // block)
    mass = np.zeros((nb, nb))
    for i in range(nb):
        rows = p[i * block:(i + 1) * block]
        mass[i] = np.add.reduceat(rows, np.arange(0, s, block), axis=1).mean(axis=0)
    out: Dict[str, Any] = {"layer": layer, "head": head, "block": block, "length": s,
                           "mass": [[float(f"{x:.4g}") for x in row] for row in mass], "kept": {}}
    if cli is None:
        return out
    from safetensors.numpy import load_file, save_file

    with tempfile.TemporaryDirectory(prefix="sp-map-") as tmp:
        inp = os.path.join(tmp, "qkv.safetensors")
        save_file({"q": q, "k": k, "v": v}, inp)
        picks = {}
        for st in settings:
            if st.policy in ("exact_gate", "softmax_skip", "estimate_select") and st.policy not in picks:
                mid = [x for x in settings if x.policy == st.policy]
                picks[st.policy] = mid[len(mid) // 2]
        for name, st in picks.items():
            res = os.path.join(tmp, f"{name}.safetensors")
            flag = {"exact_gate": "--budget", "softmax_skip": "--skip-target", "estimate_select": "--density-target"}[name]
            value = str(int(st.value)) if name == "exact_gate" else f"{st.value:g}"
            subprocess.run([cli, "run", "--input", inp, "--policy", name, "--calibration", cal_path,
                            "--layer", str(layer), flag, value, "--output", res, "--backend", "cpu"],
                           check=True, stdout=subprocess.DEVNULL)
            kept = load_file(res)["kept"][0, head]
            out["kept"][st.label] = [[int(x) for x in row] for row in kept]
    return out


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if len(args.windows) != len(args.lengths):
        raise SystemExit("--windows: expected one count per --lengths entry")
    import torch
    import transformers

    import sparseprefill as sp
    import sparseprefill.transformers as spt
    from sparseprefill.calibration import load_calibration

    t_start = time.time()
    cal = load_calibration(args.calibration)
    block = cal.gate_block_q
    spt.register(spt.BackendConfig(min_sparse_len=1))
    model, tok = data.load_model(args.model, args.device, args.dtype)
    model.set_attn_implementation(capture.register())
    layers = model.config.num_hidden_layers
    split = data.read_split(args.text, args.split_fraction)
    tokens = tok(split.evaluation, add_special_tokens=False).input_ids
    # Perplexity windows first, then passkey filler from the tokens after them.
    ppl_windows: Dict[int, list] = {}
    at = 0
    for length, count in zip(args.lengths, args.windows):
        ppl_windows[length] = data.windows(tokens, length, count, start=at)
        at += length * count
    keys = data.passkeys(args.seed, len(args.lengths) * len(args.passkey_depths))
    prompts = [data.passkey_prompt(tok, tokens[at:], L, depth, keys[i * len(args.passkey_depths) + j])
               for i, L in enumerate(args.lengths) for j, depth in enumerate(args.passkey_depths)]
    cli = None
    try:
        from .calibrate import find_cli

        cli = find_cli(args.cli)
    except FileNotFoundError:
        pass
    settings = settings_from(args)
    device = model.device
    dense_hidden: Dict[tuple, torch.Tensor] = {}
    qkv: Dict[int, Any] = {}
    map_qkv = None
    results = []
    total_forwards = sum(len(w) for w in ppl_windows.values()) + len(prompts)
    bar = data.progress(total=total_forwards * len(settings), desc="evaluate")
    for st in settings:
        spt.set_config(backend_config(st, cal, layers, block, args.segment, args.dense_layers))
        entry: Dict[str, Any] = {"policy": st.policy, "knob": st.knob, "value": st.value, "label": st.label,
                                 "lengths": {}}
        if st.policy != "dense":
            entry["per_layer_value"] = per_layer_values(st, cal, layers)
        for length in args.lengths:
            t0 = time.time()
            sums = metrics.TokenSums()
            with sp.collect_stats() as log:
                for wi, (_, ids) in enumerate(ppl_windows[length]):
                    bar.set_postfix_str(f"{st.label} {length} window {wi}")
                    wanted = []
                    if st.policy == "dense" and wi == 0:
                        wanted = (args.operator_layers if length == max(args.lengths) else []) + \
                            ([args.map_layer] if length == min(args.lengths) and args.map_layer >= 0 else [])
                    captured: Dict[int, Any] = {}
                    with capture.capturing(capture.numpy_sink(captured, wanted) if wanted else None):
                        window, hidden = ppl_window(model, ids, dense_hidden.get((length, wi)))
                    if length == max(args.lengths):
                        qkv.update({l: t for l, t in captured.items() if l in args.operator_layers})
                    if length == min(args.lengths) and args.map_layer in captured:
                        map_qkv = captured[args.map_layer]
                    if st.policy == "dense":
                        dense_hidden[(length, wi)] = hidden
                    sums.add(window)
                    del hidden
                    bar.update(1)
            t_ppl = time.time() - t0
            per_layer = metrics.layer_densities(log)
            dens, pair = metrics.total_density(log)
            t0 = time.time()
            passkey = []
            for pr in (p for p in prompts if p.length == length):
                bar.set_postfix_str(f"{st.label} passkey {length} depth {pr.depth:g}")
                x = torch.tensor([pr.ids], device=device)
                n = len(pr.answer)
                with torch.no_grad():
                    hidden = model.model(x, use_cache=False).last_hidden_state[:, -n - 1:-1]
                    pred = model.lm_head(hidden)[0].argmax(dim=-1).tolist()
                passkey.append({"depth": pr.depth, "key": pr.key, "retrieved": pred == pr.answer,
                                "predicted": tok.decode(pred)})
                bar.update(1)
            row = sums.summary()
            row.update({"density": dens, "pair_density": pair, "passkey": passkey,
                        "passkey_accuracy": float(np.mean([p["retrieved"] for p in passkey])) if passkey else None,
                        "layer_pair_density": [per_layer[l]["pair_density"] for l in sorted(per_layer)],
                        "layer_density": [per_layer[l]["density"] for l in sorted(per_layer)],
                        "seconds_ppl": round(t_ppl, 2), "seconds_passkey": round(time.time() - t0, 2)})
            if length == max(args.lengths):
                row["head_pair_density"] = [[round(x, 4) for x in per_layer[l]["head_pair_density"]]
                                            for l in sorted(per_layer)]
            entry["lengths"][str(length)] = row
        results.append(entry)
    bar.close()
    timing = None
    if args.timing_repeats > 0:
        spt.set_config(spt.BackendConfig(min_sparse_len=1))
        inputs = {L: ppl_windows[L][0][1] for L in args.lengths}
        timing = prefill_times(model, inputs, settings, lambda st: backend_config(
            st, cal, layers, block, args.segment, args.dense_layers), args.timing_repeats)
    t0 = time.time()
    op_points, op_dense = operator_sweep(qkv, cal, block, args.segment,
                                         args.timing_repeats if args.device.startswith("cuda") else 0)
    t_op = time.time() - t0
    amap = None
    if map_qkv is not None:
        amap = attention_map(*map_qkv, layer=args.map_layer, head=0, block=block,
                             cal_path=args.calibration, cli=cli, settings=settings)
    doc = {
        "meta": {
            "model": args.model_name or os.path.basename(os.path.normpath(args.model)),
            "model_file": os.path.basename(args.model),
            "model_sha256": data.file_sha256(args.model) if os.path.isfile(args.model) else "",
            "architecture": {k: getattr(model.config, k, None) for k in (
                "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "max_position_embeddings")},
            "text": split.describe(),
            "held_out_tokens": len(tokens),
            "ppl_windows": {str(L): [off for off, _ in w] for L, w in ppl_windows.items()},
            "passkey": {"depths": args.passkey_depths, "filler_from_token": at, "seed": args.seed},
            "calibration": {"file": os.path.basename(args.calibration), "sha256": data.file_sha256(args.calibration),
                            "metadata": cal.metadata, "block": block, "budgets": cal.gate_budgets,
                            "skip_targets": [round(t, 6) for t in cal.skip_targets],
                            "density_targets": [round(t, 6) for t in cal.density_targets],
                            "estimate_base": dataclasses.asdict(cal.estimate_base) if cal.estimate_base else None},
            "block": block, "segment": args.segment, "dense_layers": args.dense_layers,
            "device": args.device, "dtype": str(next(iter(model.parameters())).dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "versions": {"sparseprefill": sp.__version__, "torch": torch.__version__,
                         "transformers": transformers.__version__, "python": platform.python_version()},
            "build_info": sp.build_info(),
            "date": datetime.date.today().isoformat(),
            "command": " ".join(shlex.quote(a) for a in ["python", "-m", "sparseprefill.quality.evaluate"]
                                + (sys.argv[1:] if argv is None else argv)),
            "seconds_total": None, "seconds_operator": round(t_op, 1),
        },
        "settings": results,
        "operator": {"length": max(args.lengths), "layers": sorted(qkv), "points": op_points,
                     "dense_cuda": op_dense, "timing_repeats": args.timing_repeats if op_dense else 0},
        "attention_map": amap,
        "timing": timing,
    }
    doc["meta"]["seconds_total"] = round(time.time() - t_start, 1)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(dumps(doc))
    print(f"wrote {args.output} in {doc['meta']['seconds_total']:.0f} s", file=sys.stderr)
    return 0


def _rounded(x: Any) -> Any:
    """Floats to 6 significant digits (the measurements carry fewer), recursively."""
    if isinstance(x, float):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def dumps(doc: Dict[str, Any]) -> str:
    """JSON with one key per line but every list of numbers on one line (small, diffable);
    floats rounded to 6 significant digits."""
    text = json.dumps(_rounded(doc), indent=1)
    flat = re.sub(r"\[\s+([-+0-9.eE, \n]+?)\s+\]", lambda m: "[" + re.sub(r"\s+", " ", m.group(1)) + "]", text)
    return flat + "\n"


def per_layer_values(st: Setting, cal: Any, layers: int) -> List[float]:
    """The calibrated per-layer value behind a setting (a, alpha), for the record."""
    if st.policy == "softmax_skip":
        return [round(cal.softmax_skip(l, st.value).a, 4) for l in range(layers)]
    if st.policy in ("estimate_select", "estimate_select_mc") and st.knob == "density_target":
        return [round(cal.estimate_select(l, st.value).alpha, 5) for l in range(layers)]
    return []


if __name__ == "__main__":
    sys.exit(main())
