# SPDX-License-Identifier: Apache-2.0
"""python -m sparseprefill.quality.longctx: every policy on a long-context model (issue 32),
resumable and under a deadline. In this order, skipping what the results file holds already:

  1. perplexity, KL(dense || setting), top-1 agreement with dense and density per layer and
     head on held-out windows of the evaluation text (--ppl-lengths, default 16K and 32K
     tokens), for every setting: dense; exact_gate, softmax_skip and estimate_select at the
     calibration's targets; estimate_select at fixed alphas (FlashPrefill V2's base: block
     128, 2 sink and 4 window blocks), without and with mean correction; permute_stop at
     several tau; each of them again with the first layers dense (--dense-layer-variants);
  2. the RULER settings, chosen by rule from step 1 at the longest length: FlashPrefill V2's
     published setting (alpha 0.1) without and with mean correction, then per policy the
     setting of lowest KL among those at pair density <= --max-density (default 0.2; the
     sparsest when none is), dense-layer variants included;
  3. prefill time (the decoder stack, median of --timing-repeats after a warm-up) of torch
     SDPA, SDPA with cuDNN and every setting without dense layers, plus the chosen ones, at
     the perplexity lengths;
  4. the RULER-style suite (sparseprefill.quality.ruler) on the evaluation text's body:
     --ruler-samples prompts per task and length, greedy answers (prefill through the setting,
     decoding through SDPA), RULER's scores, the prompts' attention density. Items (setting,
     length) in this order: dense and the chosen settings at each --frontier-lengths length
     (longest first), dense and then the chosen settings at the other lengths, then the other
     settings at the longest length (per policy nearest the chosen one's density first), as
     far as the deadline allows.

The results file (--output) is written after every setting of steps 1 and 3 and after every
batch of step 4; run again with the same file and arguments, the command goes on where it
stopped (its arguments must match the file's). No batch starts when the last one's time would
run past --deadline seconds from the start."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import capture, data, evaluate, metrics, ruler
from .evaluate import Setting

__all__ = ["settings_from", "choose", "ruler_queue", "greedy", "main"]

PUBLISHED_ALPHA = 0.1  # FlashPrefill V2's published alpha (with block 128, sink 2 and window 4 blocks)
POLICIES = ["exact_gate", "softmax_skip", "estimate_select", "estimate_select_mc", "permute_stop"]


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def _words(s: str) -> List[str]:
    return [x for x in s.split(",") if x]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.quality.longctx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a transformers model folder (python -m sparseprefill.quality.convert) "
                                                  "or a .gguf file")
    p.add_argument("--model-name", help="recorded in the output (default: the folder or file name)")
    p.add_argument("--text", required=True, help="the evaluation text (UTF-8), all of it held out: perplexity windows "
                                                 "from its start, RULER haystacks from its body")
    p.add_argument("--calibration", required=True,
                   help="from python -m sparseprefill.quality.calibrate on another text (checked: not this one)")
    p.add_argument("--output", required=True, help="results JSON; resumed when it exists")
    p.add_argument("--deadline", type=float, default=math.inf, help="seconds from the start after which no work starts")
    p.add_argument("--ppl-lengths", type=_ints, default=[16384, 32768])
    p.add_argument("--ppl-windows", type=_ints, default=[1, 1], help="windows per --ppl-lengths entry")
    p.add_argument("--budgets", type=_ints, default=[4, 8, 16, 32], help="exact_gate budgets (of the calibration)")
    p.add_argument("--skip-targets", type=_floats, default=[0.7, 0.8, 0.9], help="softmax_skip targets (of the calibration)")
    p.add_argument("--density-targets", type=_floats, default=[0.1, 0.2, 0.3],
                   help="estimate_select targets (of the calibration)")
    p.add_argument("--alphas", type=_floats, default=[0.1, 0.2, 0.3, 0.4],
                   help="estimate_select fixed alphas, each without and with mean correction")
    p.add_argument("--taus", type=_floats, default=[0.001, 0.003, 0.01, 0.03], help="permute_stop tau values")
    p.add_argument("--segment", type=int, default=2048, help="permute_stop segment")
    p.add_argument("--dense-layer-variants", type=_ints, default=[2],
                   help="each sparse setting again with layers [0, n) dense, for each n")
    p.add_argument("--max-density", type=float, default=0.2, help="the RULER choice's density bound")
    p.add_argument("--timing-repeats", type=int, default=3, help="0: no prefill timing")
    p.add_argument("--ruler-tasks", type=_words, default=list(ruler.DEFAULT_TASKS))
    p.add_argument("--ruler-lengths", type=_ints, default=[4096, 8192, 16384, 32768])
    p.add_argument("--frontier-lengths", type=_ints, default=[16384, 32768],
                   help="lengths at which every chosen setting runs before the other lengths")
    p.add_argument("--ruler-samples", type=int, default=40)
    p.add_argument("--extra-settings", type=int, default=-1,
                   help="settings beyond the chosen ones at the longest length (-1: all, as time allows)")
    p.add_argument("--batch-tokens", type=int, default=16 * 32768, help="prompt tokens per RULER batch")
    p.add_argument("--seed", type=int, default=0, help="RULER samples")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    return p.parse_args(argv)


def settings_from(args: argparse.Namespace) -> List[Setting]:
    """Dense, every policy's settings, then the same sparse settings with dense first layers."""
    base = [Setting("exact_gate", "budget", float(b)) for b in args.budgets]
    base += [Setting("softmax_skip", "skip_target", t) for t in args.skip_targets]
    base += [Setting("estimate_select", "density_target", t) for t in args.density_targets]
    for a in args.alphas:
        base += [Setting("estimate_select", "alpha", a), Setting("estimate_select_mc", "alpha", a)]
    base += [Setting("permute_stop", "tau", t) for t in args.taus]
    out = [Setting("dense", "", 0.0)] + base
    for n in args.dense_layer_variants:
        out += [dataclasses.replace(s, dense_layers=n) for s in base]
    return out


def _at(ppl: Dict[str, Any], st: Setting, length: int) -> Optional[Dict[str, Any]]:
    return ppl.get(st.label, {}).get("lengths", {}).get(str(length))


def choose(ppl: Dict[str, Any], settings: List[Setting], length: int, max_density: float) -> List[Setting]:
    """The RULER settings: FlashPrefill V2's published setting without and with mean
    correction (when among the settings), then for exact_gate, softmax_skip, estimate_select at
    the calibration's targets and permute_stop the setting of lowest KL at `length` among those
    with pair density <= max_density, or the sparsest when none is (dense-layer variants
    compete with the rest). Settings without a result at `length` are not considered."""
    out = [s for s in (Setting("estimate_select", "alpha", PUBLISHED_ALPHA),
                       Setting("estimate_select_mc", "alpha", PUBLISHED_ALPHA)) if s in settings]
    for policy, knob in (("exact_gate", "budget"), ("softmax_skip", "skip_target"),
                         ("estimate_select", "density_target"), ("permute_stop", "tau")):
        cands = [(s, r) for s in settings if s.policy == policy and s.knob == knob and (r := _at(ppl, s, length))]
        if not cands:
            continue
        ok = [c for c in cands if c[1]["pair_density"] <= max_density]
        pick = min(ok, key=lambda c: (c[1]["kl"], c[1]["pair_density"])) if ok else \
            min(cands, key=lambda c: c[1]["pair_density"])
        out.append(pick[0])
    return out


def ruler_queue(settings: List[Setting], chosen: List[Setting], ppl: Dict[str, Any], ppl_length: int,
                lengths: Sequence[int], frontier: Sequence[int], extra: int) -> List[Tuple[Setting, int]]:
    """The RULER items in the order they run (see the module's docstring); the extra settings'
    order reads their densities at ppl_length."""
    dense = settings[0]
    longest = max(lengths)
    front = sorted((L for L in lengths if L in frontier), reverse=True)
    rest = sorted((L for L in lengths if L not in frontier), reverse=True)
    q = [(s, L) for L in front for s in [dense] + chosen]
    q += [(dense, L) for L in rest] + [(s, L) for L in rest for s in chosen]
    # More frontier points at the longest length: per policy the settings nearest the chosen
    # one's density first, the policies in turn.
    lanes = []
    for policy in POLICIES:
        mine = [s for s in settings if s.policy == policy and s.dense_layers == 0 and s not in chosen
                and _at(ppl, s, ppl_length)]
        ref = [c for c in chosen if c.policy == policy and _at(ppl, c, ppl_length)]
        if not mine:
            continue
        d0 = _at(ppl, ref[0], ppl_length)["pair_density"] if ref else 1.0
        mine.sort(key=lambda s: abs(math.log(max(_at(ppl, s, ppl_length)["pair_density"], 1e-6) / max(d0, 1e-6))))
        lanes.append(mine)
    extras = [lane[i] for i in range(max((len(x) for x in lanes), default=0)) for lane in lanes if i < len(lane)]
    if extra >= 0:
        extras = extras[:extra]
    return q + [(s, longest) for s in extras]


def eos_ids(tokenizer: Any, model: Any) -> List[int]:
    """The tokens that end an answer: the tokenizer's and the generation config's EOS, and the
    chat template's end of turn (<|im_end|>) where the vocabulary has one."""
    ids = set()
    for x in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if x is not None:
            ids |= set(x) if isinstance(x, (list, tuple)) else {int(x)}
    end = tokenizer.get_vocab().get("<|im_end|>")
    if end is not None:
        ids.add(int(end))
    return sorted(ids)


def greedy(model: Any, prompts: List[List[int]], max_new: int, eos: Sequence[int], prefill_impl: str,
           decode_impl: str = "sdpa") -> Tuple[List[List[int]], float]:
    """Greedy answers of a batch of equally long prompts: the prefill through `prefill_impl`
    (the setting under test), each next token through `decode_impl` (dense; the policies act on
    prefill only), until every answer has an EOS token or max_new tokens. Returns each answer's
    tokens before its first EOS, and the prefill's seconds (CUDA synchronised)."""
    import torch
    from transformers import DynamicCache

    cuda = model.device.type == "cuda"
    x = torch.tensor(prompts, device=model.device)
    stop = torch.tensor(list(eos), device=model.device)
    cache = DynamicCache(config=model.config)
    steps = []
    with torch.no_grad():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        hidden = model.model(input_ids=x, past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
        nxt = model.lm_head(hidden).argmax(dim=-1)
        if cuda:
            torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        done = torch.zeros(len(prompts), dtype=torch.bool, device=model.device)
        model.set_attn_implementation(decode_impl)
        try:
            for step in range(max_new):
                steps.append(nxt)
                done |= torch.isin(nxt, stop)
                if step + 1 == max_new or bool(done.all()):
                    break
                hidden = model.model(input_ids=nxt[:, None], past_key_values=cache,
                                     use_cache=True).last_hidden_state[:, -1]
                nxt = model.lm_head(hidden).argmax(dim=-1)
        finally:
            model.set_attn_implementation(prefill_impl)
    out = []
    for row in torch.stack(steps, dim=1).tolist():
        cut = next((i for i, t in enumerate(row) if t in set(eos)), len(row))
        out.append(row[:cut])
    return out, prefill


class Run:
    """The results document and its file: loaded when it exists (its arguments checked against
    this run's), written atomically."""

    def __init__(self, path: str, fingerprint: Dict[str, Any], meta: Dict[str, Any]):
        self.path = path
        if os.path.isfile(path):
            with open(path) as f:
                self.doc = json.load(f)
            old = self.doc["meta"]["fingerprint"]
            diff = sorted(k for k in set(old) | set(fingerprint) if old.get(k) != fingerprint.get(k))
            if diff:
                raise SystemExit(f"{path}: made with other arguments ({', '.join(diff)} differ); "
                                 "give another --output or the same arguments")
            print(f"resuming {path}", file=sys.stderr)
        else:
            self.doc = {"meta": dict(meta, fingerprint=fingerprint), "settings": [], "ppl": {}, "timing": None,
                        "ruler": {"chosen": None, "queue": None, "results": {}}, "calls": []}

    def save(self) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.write(evaluate.dumps(self.doc))
        os.replace(tmp, self.path)


def _config(st: Setting, cal: Any, layers: int, block: int, segment: int) -> Any:
    return evaluate.backend_config(st, cal, layers, block, segment, st.dense_layers)


def _setting_record(st: Setting, cal: Any, layers: int) -> Dict[str, Any]:
    return {"label": st.label, "policy": st.policy, "knob": st.knob, "value": st.value,
            "dense_layers": st.dense_layers, "per_layer_value": evaluate.per_layer_values(st, cal, layers)}


def run_ppl(run: Run, model: Any, windows: Dict[int, List[Tuple[int, List[int]]]], settings: List[Setting],
            cal: Any, block: int, segment: int, clock: "Clock") -> bool:
    """Step 1; False when the deadline stopped it."""
    import sparseprefill as sp
    import sparseprefill.transformers as spt

    layers = model.config.num_hidden_layers
    dense_hidden: Dict[Tuple[int, int], Any] = {}
    failed = run.doc.setdefault("errors", {}).get("ppl", {})
    todo = [s for s in settings if s.label not in run.doc["ppl"] and s.label not in failed]
    if todo and todo[0].policy != "dense":
        todo.insert(0, settings[0])  # dense again: the reference hidden states are not stored
    bar = data.progress(todo, desc="perplexity / KL")
    for st in bar:
        if not clock.allows(clock.last.get("ppl", 0.0)):
            bar.close()
            return False
        t0 = time.time()
        spt.set_config(_config(st, cal, layers, block, segment))
        entry = {"setting": _setting_record(st, cal, layers), "lengths": {}}
        try:
            for length, wins in windows.items():
                sums = metrics.TokenSums()
                with sp.collect_stats() as log:
                    for wi, (_, ids) in enumerate(wins):
                        window, hidden = evaluate.ppl_window(model, ids, dense_hidden.get((length, wi)))
                        if st.policy == "dense":
                            dense_hidden[(length, wi)] = hidden
                        sums.add(window)
                        del hidden
                per_layer = metrics.layer_densities(log)
                dens, pair = metrics.total_density(log)
                row = sums.summary()
                row.update({"density": dens, "pair_density": pair,
                            "layer_pair_density": [per_layer[l]["pair_density"] for l in sorted(per_layer)],
                            "head_pair_density": [[round(x, 4) for x in per_layer[l]["head_pair_density"]]
                                                  for l in sorted(per_layer)]})
                entry["lengths"][str(length)] = row
        except Exception as e:  # noqa: BLE001 - recorded, reported, and the other settings go on
            if st.policy == "dense":
                raise
            _failed(run, "ppl", st.label, e)
            continue
        entry["seconds"] = round(time.time() - t0, 2)
        clock.last["ppl"] = entry["seconds"]
        if st.label not in run.doc["ppl"]:
            run.doc["ppl"][st.label] = entry
            run.save()
        r = entry["lengths"][str(max(windows))]
        bar.set_postfix_str(f"{st.label}: density {r['pair_density']:.3f} KL {r['kl']:.3g}")
    bar.close()
    return True


def run_timing(run: Run, model: Any, windows: Dict[int, List[Tuple[int, List[int]]]], settings: List[Setting],
               cal: Any, block: int, segment: int, repeats: int, clock: "Clock") -> bool:
    """Step 3, one setting at a time; False when the deadline stopped it."""
    layers = model.config.num_hidden_layers
    inputs = {L: w[0][1] for L, w in windows.items()}
    if run.doc["timing"] is None:
        run.doc["timing"] = evaluate.prefill_times(model, inputs, [settings[0]], lambda st: _config(
            st, cal, layers, block, segment), repeats)
        run.save()
    secs = run.doc["timing"]["seconds"]
    per = sum(secs["dense"].values()) * (repeats + 1)
    failed = run.doc.setdefault("errors", {}).get("timing", {})
    for st in (s for s in settings if s.label not in secs and s.label not in failed):
        if not clock.allows(per):
            return False
        try:
            t = evaluate.prefill_times(model, inputs, [st], lambda s: _config(s, cal, layers, block, segment),
                                       repeats, baselines=False)
        except Exception as e:  # noqa: BLE001 - recorded, reported, and the other settings go on
            _failed(run, "timing", st.label, e)
            continue
        secs.update(t["seconds"])
        run.save()
    return True


def _failed(run: Run, step: str, key: str, e: BaseException) -> None:
    """Records (and prints) an error that stops one setting or item, not the run."""
    import traceback

    traceback.print_exc()
    msg = f"{type(e).__name__}: {e}"[:300]
    print(f"{step} {key}: FAILED, {msg}", file=sys.stderr)
    run.doc.setdefault("errors", {}).setdefault(step, {})[key] = msg
    run.save()


class Clock:
    def __init__(self, deadline: float):
        self.start = time.time()
        self.deadline = deadline
        self.last: Dict[Any, float] = {}

    def elapsed(self) -> float:
        return time.time() - self.start

    def allows(self, seconds: float) -> bool:
        """Whether work expected to take `seconds` ends before the deadline."""
        return self.elapsed() + seconds <= self.deadline


def run_ruler(run: Run, model: Any, tokenizer: Any, suite: Tuple[ruler.Encoder, ruler.Haystack, List[str]],
              queue: List[Tuple[Setting, int]], args: argparse.Namespace, cal: Any, block: int,
              clock: Clock) -> bool:
    """Step 4; False when the deadline stopped it."""
    import sparseprefill.transformers as spt

    layers = model.config.num_hidden_layers
    eos = eos_ids(tokenizer, model)
    samples: Dict[Tuple[str, int], List[ruler.Sample]] = {}
    results = run.doc["ruler"]["results"]
    failed = run.doc.setdefault("errors", {}).setdefault("ruler", {})
    for st, length in queue:
        if f"{st.label} @ {length}" in failed:
            continue
        item = results.setdefault(st.label, {}).setdefault(str(length), {
            "tasks": {}, "visible_pairs": 0, "computed_pairs": 0, "seconds": 0.0, "prefill_seconds": 0.0})
        todo = {t: [i for i in range(args.ruler_samples) if i not in {r["index"] for r in item["tasks"].get(t, [])}]
                for t in args.ruler_tasks}
        count = sum(len(v) for v in todo.values())
        if not count:
            continue
        spt.set_config(_config(st, cal, layers, block, args.segment))
        bar = data.progress(total=count, desc=f"RULER {st.label} @ {length}")
        try:
            if not _ruler_item(run, model, tokenizer, suite, st, length, item, todo, samples, eos, args, clock, bar):
                bar.close()
                return False
        except Exception as e:  # noqa: BLE001 - recorded, reported, and the other items go on
            bar.close()
            _failed(run, "ruler", f"{st.label} @ {length}", e)
            continue
        bar.close()
        avg = 100 * sum(sum(r["score"] for r in v) / len(v) for v in item["tasks"].values()) / len(item["tasks"])
        print(f"[{clock.elapsed():.0f} s] RULER {st.label} @ {length}: average {avg:.1f}, density "
              f"{item['computed_pairs'] / max(item['visible_pairs'], 1):.3f}, {item['seconds']:.0f} s", file=sys.stderr)
    return True


def _ruler_item(run: Run, model: Any, tokenizer: Any, suite: Tuple[ruler.Encoder, ruler.Haystack, List[str]],
                st: Setting, length: int, item: Dict[str, Any], todo: Dict[str, List[int]],
                samples: Dict[Tuple[str, int], List[ruler.Sample]], eos: List[int], args: argparse.Namespace,
                clock: Clock, bar: Any) -> bool:
    """One (setting, length) item's missing prompts, batch by batch; False when the deadline
    stopped it."""
    import torch

    import sparseprefill as sp

    enc, hay, words = suite
    for task in args.ruler_tasks:
        if not todo[task]:
            continue
        if (task, length) not in samples:
            samples[(task, length)] = [ruler.make_sample(task, length, i, args.seed, enc, hay, words)
                                       for i in range(args.ruler_samples)]
        batch = max(1, min(args.ruler_samples, args.batch_tokens // length))
        pending = list(todo[task])
        while pending:
            part = pending[:batch]
            expect = clock.last.get(("ruler", length), 0.0) * len(part)
            if not clock.allows(expect):
                return False
            t0 = time.time()
            try:
                with sp.collect_stats() as log:
                    answers, prefill = greedy(model, [samples[(task, length)][i].ids for i in part],
                                              ruler.TASKS[task].max_new, eos, capture.NAME)
            except torch.cuda.OutOfMemoryError:
                if batch == 1:
                    raise
                batch //= 2
                torch.cuda.empty_cache()
                print(f"RULER {st.label} @ {length} {task}: out of memory, batch now {batch}", file=sys.stderr)
                continue
            took = time.time() - t0
            clock.last[("ruler", length)] = max(took / len(part), clock.last.get(("ruler", length), 0.0) * 0.5)
            for c in log.calls:
                item["visible_pairs"] += int(c.heads[..., 3].sum())
                item["computed_pairs"] += int(c.heads[..., 4].sum())
            rows = item["tasks"].setdefault(task, [])
            for i, ids in zip(part, answers):
                s = samples[(task, length)][i]
                pred = ruler.postprocess(tokenizer.decode(ids, skip_special_tokens=True))
                rec = {"index": i, "score": ruler.score(task, pred, s.outputs), "pred": pred[:160],
                       "tokens": len(ids)}
                if "needles" in s.info:
                    asked = [n for n in s.info["needles"] if n["key"] in s.info["asked"]]
                    rec["depth"] = asked[0]["placed_depth"]
                    rec["value_type"] = s.info["value_type"]
                elif "placed_depth" in s.info:
                    rec["depth"] = s.info["placed_depth"]
                rows.append(rec)
            rows.sort(key=lambda r: r["index"])
            item["seconds"] = round(item["seconds"] + took, 2)
            item["prefill_seconds"] = round(item["prefill_seconds"] + prefill, 2)
            run.save()
            pending = pending[len(part):]
            bar.update(len(part))
            bar.set_postfix_str(f"{task} {100 * sum(r['score'] for r in rows) / len(rows):.0f}")
    return True


def _architecture(config: Any) -> Dict[str, Any]:
    out = {k: getattr(config, k, None) for k in ("model_type", "num_hidden_layers", "num_attention_heads",
                                                 "num_key_value_heads", "max_position_embeddings")}
    out["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    out["rope_theta"] = rope.get("rope_theta", getattr(config, "rope_theta", None))
    return out


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if len(args.ppl_windows) != len(args.ppl_lengths):
        raise SystemExit("--ppl-windows: expected one count per --ppl-lengths entry")
    unknown = [t for t in args.ruler_tasks if t not in ruler.TASKS]
    if unknown:
        raise SystemExit(f"--ruler-tasks: unknown {unknown}; expected some of {sorted(ruler.TASKS)}")
    clock = Clock(args.deadline)
    import torch
    import transformers

    import sparseprefill as sp
    import sparseprefill.transformers as spt
    from sparseprefill.calibration import load_calibration

    cal = load_calibration(args.calibration)
    text_sha = data.file_sha256(args.text)
    if cal.metadata.get("text_sha256") == text_sha:
        raise SystemExit(f"--calibration: calibrated on {args.text} itself; the evaluation text must be another")
    block = cal.gate_block_q
    source = os.path.join(args.model, "source.json")
    model_sha = data.file_sha256(args.model) if os.path.isfile(args.model) else ""
    if os.path.isfile(source):
        with open(source) as f:
            model_sha = json.load(f).get("gguf_sha256", model_sha)
    settings = settings_from(args)
    fingerprint = {"model_sha256": model_sha, "model": os.path.basename(os.path.normpath(args.model)),
                   "text_sha256": text_sha, "calibration_sha256": data.file_sha256(args.calibration),
                   "ppl": [args.ppl_lengths, args.ppl_windows], "settings": [s.label for s in settings],
                   "segment": args.segment, "max_density": args.max_density,
                   "ruler": [args.ruler_tasks, args.ruler_lengths, args.frontier_lengths, args.ruler_samples, args.seed],
                   "timing_repeats": args.timing_repeats, "device": args.device}
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    meta = {"model": args.model_name or os.path.basename(os.path.normpath(args.model)),
            "text": {"path": os.path.basename(args.text), "sha256": text_sha, "chars": len(text)},
            "calibration": {"file": os.path.basename(args.calibration), "metadata": cal.metadata, "block": block,
                            "budgets": cal.gate_budgets, "skip_targets": [round(t, 6) for t in cal.skip_targets],
                            "density_targets": [round(t, 6) for t in cal.density_targets],
                            "estimate_base": dataclasses.asdict(cal.estimate_base) if cal.estimate_base else None},
            "segment": args.segment, "published_alpha": PUBLISHED_ALPHA, "max_density": args.max_density,
            "ruler": {"tasks": {t: dataclasses.asdict(ruler.TASKS[t]) for t in args.ruler_tasks},
                      "lengths": args.ruler_lengths, "frontier_lengths": args.frontier_lengths,
                      "samples": args.ruler_samples, "seed": args.seed, "batch_tokens": args.batch_tokens,
                      "intervals": "per task: Wilson score interval of the mean score (conservative for "
                                   "string_match_all's fractions); average over tasks and paired differences: "
                                   "stratified percentile bootstrap over samples, 10000 resamples"}}
    run = Run(args.output, fingerprint, meta)
    spt.register(spt.BackendConfig(min_sparse_len=1))
    model, tokenizer = data.load_model(args.model, args.device, args.dtype)
    model.set_attn_implementation(capture.register())
    layers = model.config.num_hidden_layers
    run.doc["meta"].update({
        "architecture": _architecture(model.config),
        "device": args.device, "dtype": str(next(iter(model.parameters())).dtype).replace("torch.", ""),
        "versions": {"sparseprefill": sp.__version__, "torch": torch.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "build_info": sp.build_info()})
    run.doc["settings"] = [_setting_record(s, cal, layers) for s in settings]
    call = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in ["python", "-m", "sparseprefill.quality.longctx"]
                                + (sys.argv[1:] if argv is None else argv))}
    run.doc["calls"].append(call)
    tokens = tokenizer(text, add_special_tokens=False).input_ids
    windows: Dict[int, List[Tuple[int, List[int]]]] = {}
    at = 0
    for length, count in zip(args.ppl_lengths, args.ppl_windows):
        windows[length] = data.windows(tokens, length, count, start=at)
        at += length * count
    run.doc["meta"]["ppl_windows"] = {str(L): [off for off, _ in w] for L, w in windows.items()}
    run.doc["meta"]["held_out_tokens"] = len(tokens)
    enc = ruler.Encoder(tokenizer)
    hay = ruler.Haystack.from_text(os.path.basename(args.text), text, enc)
    run.doc["meta"]["ruler"]["haystack"] = {"body_from_unit": hay.body, "body_tokens": hay.body_tokens(),
                                            "qa_sections": len(hay.sections)}
    stopped = "deadline"
    if run_ppl(run, model, windows, settings, cal, block, args.segment, clock):
        longest = max(args.ppl_lengths)
        chosen = choose(run.doc["ppl"], settings, longest, args.max_density)
        if run.doc["ruler"]["chosen"] is None:
            run.doc["ruler"]["chosen"] = [s.label for s in chosen]
        chosen = [s for s in settings if s.label in run.doc["ruler"]["chosen"]]
        chosen.sort(key=lambda s: run.doc["ruler"]["chosen"].index(s.label))
        queue = ruler_queue(settings, chosen, run.doc["ppl"], longest, args.ruler_lengths, args.frontier_lengths,
                            args.extra_settings)
        run.doc["ruler"]["queue"] = [[s.label, L] for s, L in queue]
        run.save()
        timed = [s for s in settings if s.dense_layers == 0 or s in chosen]
        if args.timing_repeats <= 0 or run_timing(run, model, windows, timed, cal, block, args.segment,
                                                  args.timing_repeats, clock):
            if run_ruler(run, model, tokenizer, (enc, hay, ruler.vocabulary(text)), queue, args, cal, block, clock):
                stopped = "done"
    call.update({"seconds": round(clock.elapsed(), 1), "stopped": stopped})
    run.save()
    print(f"wrote {args.output}: {stopped} after {clock.elapsed():.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
