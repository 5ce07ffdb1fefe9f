# SPDX-License-Identifier: Apache-2.0
"""Per-call cost of the host path a serving engine exercises: many small calls back to back.

Cases (Llama-3.1-8B attention shape: h_q 32, h_kv 8, d 128, bf16, causal, batch 1):
  - s = 128 (a short chunk or a small prefill): the GPU work is a few microseconds, so the
    per-call wall time is the host path's cost.
  - s = 4K and 8K dense: the kernel takes 0.1-0.3 ms, so a host path slower than that, or one
    that synchronises, shows up as a gap against SDPA cuDNN.
Implementations, in one process on the same inputs:
  sdpa_cudnn, sdpa_flash   torch SDPA with one backend enabled (K/V repeated to h_q heads
                           beforehand, outside the timed calls, as the baselines do)
  fa_func                  sparseprefill.flash_attn_func (a new out per call, as FA returns)
  run_plan                 sparseprefill.run(plan, q, k, v, out=out, stats=False)
  op                       torch.ops.sparseprefill.attention_out (the registered op itself)
Each is timed over `layers` distinct input sets used in turn (a model's layers: new tensors
each call, as a serving step sees them), `reps` calls back to back with one synchronisation at
the end: per-call wall = elapsed / calls; host = time until the last call returned. With
--profile, the cProfile of fa_func's and run_plan's calls (top entries by own time) follows.

--python-only needs no GPU: CPU tensors (fp32, h 32/8, d 128, s from --lengths, default 16),
fa_func, run_plan and op, each in two modes:
  stub   the extension's run entry points (_ext.run, _ext.run_decisions, PlanHandle.run and
         PlanCall.run_ptrs, where they exist) replaced by no-ops: what is left is the Python
         side of a call alone (the checks, conversions, allocations and dispatch);
  cpu    the real CPU backend on these tiny shapes.
Prepared calls (docs/python.md) are planned during the warm-up, so the timed calls are hits.

Writes OUT/host_overhead.json and OUT/host_overhead.md.
Usage: python bench/host_overhead.py OUT [--lengths 128,4096,8192] [--layers 32] [--reps 400] [--profile]
       python bench/host_overhead.py OUT --python-only [--lengths 16] [--reps 2000] [--profile]
"""
import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import subprocess
import time

import torch
import torch.nn.functional as F

import sparseprefill as sp
import sparseprefill.ops  # noqa: F401  (registers torch.ops.sparseprefill.*)
from sparseprefill import _ext
from sparseprefill.flash_attn_interface import flash_attn_func


def commit():
    # The GPU machine's copy of the tree may carry no (or a stale) .git: SP_COMMIT names it.
    if os.environ.get("SP_COMMIT"):
        return os.environ["SP_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def make_sets(s, layers, device, dtype, h_q=32, h_kv=8, d=128, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    sets = []
    for _ in range(layers):
        q = torch.randn(1, s, h_q, d, device=device, dtype=dtype, generator=gen)
        k = torch.randn(1, s, h_kv, d, device=device, dtype=dtype, generator=gen)
        v = torch.randn(1, s, h_kv, d, device=device, dtype=dtype, generator=gen)
        group = h_q // h_kv
        # SDPA's layout [b, h, s, d], K/V repeated to h_q heads (outside the timed calls).
        qt = q.transpose(1, 2).contiguous()
        kt = k.transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        vt = v.transpose(1, 2).repeat_interleave(group, dim=1).contiguous()
        sets.append(dict(q=q, k=k, v=v, qt=qt, kt=kt, vt=vt, out=torch.empty_like(q)))
    return sets


def implementations(sets, sdpa_too):
    plan = sp.plan(sets[0]["q"], sets[0]["k"], sets[0]["v"], sp.Dense(), causal=True)
    op = torch.ops.sparseprefill.attention_out
    lse = {id(x): torch.empty(1, x["q"].shape[2], x["q"].shape[1], device=x["q"].device, dtype=torch.float32)
           for x in sets}

    def sdpa(backend):
        from torch.nn.attention import sdpa_kernel

        def call(x):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(x["qt"], x["kt"], x["vt"], is_causal=True)
        return call

    def op_call(x):
        # ..., causal, scale, window (-1, -1), attention_chunk 0, softcap 0, sinks None, policy, ...
        op(x["q"], x["k"], x["v"], None, None, None, None, None, None, None, True, 0.0, -1, -1, 0, 0.0, None, "dense", "",
           None, None, None, 0, 0, False, -1, None, None, None, None, x["out"], lse[id(x)])

    impls = {}
    if sdpa_too:
        from torch.nn.attention import SDPBackend

        impls["sdpa_cudnn"] = sdpa(SDPBackend.CUDNN_ATTENTION)
        impls["sdpa_flash"] = sdpa(SDPBackend.FLASH_ATTENTION)
    impls["fa_func"] = lambda x: flash_attn_func(x["q"], x["k"], x["v"], causal=True)
    impls["run_plan"] = lambda x: sp.run(plan, x["q"], x["k"], x["v"], out=x["out"], stats=False)
    impls["op"] = op_call
    return impls


def sync(sets):
    if sets[0]["q"].is_cuda:
        torch.cuda.synchronize()


def time_impl(fn, sets, reps):
    for _ in range(2):  # warm-up: every input set twice (caches, plans, autotuning, handles)
        for x in sets:
            fn(x)
    sync(sets)
    t0 = time.perf_counter()
    for i in range(reps):
        fn(sets[i % len(sets)])
    host = time.perf_counter() - t0
    sync(sets)
    wall = time.perf_counter() - t0
    return wall / reps * 1e6, host / reps * 1e6


def profile(fn, sets, reps, top=25):
    prof = cProfile.Profile()
    prof.enable()
    for i in range(reps):
        fn(sets[i % len(sets)])
    sync(sets)
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


# The extension's entry points that run a call (an absent one, e.g. on an older build, is skipped).
_RUN_ENTRY_POINTS = (("run", None), ("run_decisions", None), ("run", "PlanHandle"), ("run_ptrs", "PlanCall"))


@contextlib.contextmanager
def stubbed_extension():
    """Replaces the extension's run calls by no-ops returning what they return without
    statistics, so that a timed call measures the Python side alone."""
    saved = []
    for name, owner_name in _RUN_ENTRY_POINTS:
        owner = _ext if owner_name is None else getattr(_ext, owner_name, None)
        if owner is None or not hasattr(owner, name):
            continue
        saved.append((owner, name, getattr(owner, name)))
        if owner_name == "PlanHandle" or name == "run_decisions":
            stub = lambda *a, **kw: (None, None)  # noqa: E731  ((stats, decisions))
        else:
            stub = lambda *a, **kw: None  # noqa: E731
        setattr(owner, name, stub)
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_gpu(args, rows, profiles):
    for s in (int(x) for x in args.lengths.split(",")):
        sets = make_sets(s, args.layers, "cuda", torch.bfloat16)
        impls = implementations(sets, sdpa_too=True)
        reps = args.reps if s <= 1024 else max(50, args.reps // 4)
        for name, fn in impls.items():
            rounds = sorted(time_impl(fn, sets, reps) for _ in range(args.rounds))
            wall, host = rounds[len(rounds) // 2]
            rows.append(dict(s=s, impl=name, wall_us=wall, host_us=host, reps=reps, layers=args.layers))
            print(f"s={s:6d} {name:11s} wall {wall:9.1f} us/call  host {host:9.1f} us/call", flush=True)
        if args.profile:
            for name in ("fa_func", "run_plan"):
                profiles[f"{name} s={s}"] = profile(impls[name], sets, reps)
        del sets, impls
        torch.cuda.empty_cache()


def run_python_only(args, rows, profiles):
    for s in (int(x) for x in args.lengths.split(",")):
        sets = make_sets(s, args.layers, "cpu", torch.float32)
        impls = implementations(sets, sdpa_too=False)
        for mode in ("stub", "cpu"):
            with stubbed_extension() if mode == "stub" else contextlib.nullcontext():
                for name, fn in impls.items():
                    rounds = sorted(time_impl(fn, sets, args.reps)[0] for _ in range(args.rounds))
                    us = rounds[len(rounds) // 2]
                    rows.append(dict(s=s, impl=name, mode=mode, us=us, reps=args.reps, layers=args.layers))
                    print(f"s={s:6d} {name:9s} {mode:4s} {us:8.2f} us/call", flush=True)
                if args.profile:
                    for name in ("fa_func", "run_plan", "op"):
                        profiles[f"{name} {mode} s={s}"] = profile(impls[name], sets, args.reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--python-only", action="store_true",
                    help="CPU tensors, no GPU: the Python side alone (extension stubbed) and the CPU backend")
    ap.add_argument("--lengths", default=None, help="sequence lengths (default 128,4096,8192; --python-only: 16)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=None, help="calls per round (default 400; --python-only: 2000)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds per implementation, median kept (default 3; --python-only: 5)")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    quick = args.python_only
    args.lengths = args.lengths or ("16" if quick else "128,4096,8192")
    args.reps = args.reps or (2000 if quick else 400)
    args.rounds = args.rounds or (5 if quick else 3)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    profiles = {}
    (run_python_only if quick else run_gpu)(args, rows, profiles)
    device = platform.processor() or platform.machine() if quick else torch.cuda.get_device_name()
    meta = dict(commit=commit(), device=device, torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"), command="python bench/host_overhead.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" if not isinstance(v, bool) else (f"--{k.replace('_', '-')}" if v else "")
                    for k, v in vars(args).items() if k != "out").strip())
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows, profiles=profiles), f, indent=1)
    lines = [f"# Host path per call ({meta['date']}, {meta['commit']}, {meta['device']}, torch {meta['torch']})", "",
             f"`{meta['command']}`", ""]
    if quick:
        lines += ["| s | impl | Python side µs/call (stub) | CPU backend µs/call |", "|---:|---|---:|---:|"]
        for r in rows:
            if r["mode"] == "stub":
                cpu = next(x["us"] for x in rows if x["s"] == r["s"] and x["impl"] == r["impl"] and x["mode"] == "cpu")
                lines.append(f"| {r['s']} | {r['impl']} | {r['us']:.2f} | {cpu:.2f} |")
        table = len(rows) // 2
    else:
        lines += ["| s | impl | wall µs/call | host µs/call | vs sdpa_cudnn |", "|---:|---|---:|---:|---:|"]
        for r in rows:
            ref = next(x["wall_us"] for x in rows if x["s"] == r["s"] and x["impl"] == "sdpa_cudnn")
            lines.append(f"| {r['s']} | {r['impl']} | {r['wall_us']:.1f} | {r['host_us']:.1f} | {ref / r['wall_us']:.2f}x |")
        table = len(rows)
    for what, text in profiles.items():
        lines += ["", f"## cProfile of {what}", "", "```", text.strip(), "```"]
    with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:table + 6]))


if __name__ == "__main__":
    main()
