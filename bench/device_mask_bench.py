# SPDX-License-Identifier: Apache-2.0
"""Block masks read in place on the GPU (issue #30's device-resident masks), Llama-3.1-8B
attention shape (h_q 32, h_kv 8, d 128, bf16, causal, batch 1), random inputs:

  planned     block_sparse through a plan made once for a host mask (uploaded once)
  in place    block_sparse with a mask in device memory (FlexAttention's tensors), a different
              one on every call (rotating over --masks masks, each a new BlockSparse policy):
              the device check kernel plus the forward kernel, no host copy
  flex mask   the same masks through torch's FlexAttention BlockMask object (from_kv_blocks),
              read in place through BlockSparse.from_block_mask
  select      select(EstimateSelect(), device=True): the selection left on the device, against
              the selector's own kernels (means + selector, from the profiler)

Masks: per (query head, query block) each causally visible 128 x 128 block with probability
--density, plus the diagonal and block 0. Timing: CUDA events around `reps` calls back to back
(one warm-up pass over every mask first), the median of --rounds. Writes OUT/device_mask.json
and OUT/device_mask.md.
Usage: python bench/device_mask_bench.py OUT [--lengths 32768,131072] [--density 0.1] [--masks 4]
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch

import sparseprefill as sp

H_Q, H_KV, D, BLOCK = 32, 8, 128, 128


def commit():
    # The GPU machine's copy of the tree may carry no (or a stale) .git: SP_COMMIT names it.
    if os.environ.get("SP_COMMIT"):
        return os.environ["SP_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def random_flex(n_blocks, density, gen):
    """FlexAttention's tensors of a random causal mask over s = n_blocks · 128 (CUDA, int32;
    [1, H_Q, nb] and [1, H_Q, nb, nb]): partial = each query block's diagonal block, full = block
    0 and each block below the diagonal with probability `density`, ascending."""
    idx = torch.arange(n_blocks, device="cuda")
    below = idx[None, :] < idx[:, None]
    keep = (torch.rand(H_Q, n_blocks, n_blocks, device="cuda", generator=gen) < density) & below[None]
    keep[:, 1:, 0] = True
    full_counts = keep.sum(-1).to(torch.int32)[None].contiguous()
    full_idx = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None].contiguous()
    partial_counts = torch.ones(1, H_Q, n_blocks, dtype=torch.int32, device="cuda")
    partial_idx = torch.zeros(1, H_Q, n_blocks, n_blocks, dtype=torch.int32, device="cuda")
    partial_idx[..., 0] = idx.to(torch.int32)
    return partial_counts, partial_idx, full_counts, full_idx


def time_calls(fn, calls, rounds):
    for _ in range(2):
        fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def kernel_ms(fn, names):
    """Device time of the kernels whose names contain any of `names`, per call of fn()."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if any(n in e.key for n in names):
            total += e.device_time_total
    return total / 3 / 1000.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--masks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for s in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(1, s, H_Q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(1, s, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(1, s, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty_like(q)
        nb = (s + BLOCK - 1) // BLOCK
        masks = [random_flex(nb, args.density, gen) for _ in range(args.masks)]
        in_place = [sp.BlockSparse(kv_num_blocks=m[0], kv_indices=m[1], full_kv_num_blocks=m[2],
                                   full_kv_indices=m[3]) for m in masks]
        host = sp.BlockSparse(kv_num_blocks=masks[0][0].cpu(), kv_indices=masks[0][1].cpu(),
                              full_kv_num_blocks=masks[0][2].cpu(), full_kv_indices=masks[0][3].cpu())
        plan = sp.plan(q, k, v, host)
        calls = 20 if s <= 32768 else 5
        planned = time_calls(lambda i: sp.run(plan, q, k, v, out=out, stats=False), calls, args.rounds)
        placed = time_calls(lambda i: sp.run(q, k, v, in_place[i % len(in_place)], out=out, stats=False), calls,
                            args.rounds)
        row = dict(s=s, density=args.density, planned_ms=planned, in_place_ms=placed, ratio=placed / planned)
        try:
            from torch.nn.attention.flex_attention import BlockMask

            flex = [sp.BlockSparse.from_block_mask(BlockMask.from_kv_blocks(*m, BLOCK_SIZE=(BLOCK, BLOCK)))
                    for m in masks]
            row["flex_mask_ms"] = time_calls(lambda i: sp.run(q, k, v, flex[i % len(flex)], out=out, stats=False),
                                             calls, args.rounds)
        except Exception as e:  # noqa: BLE001 (reported, not fatal: the other rows stand)
            row["flex_mask_error"] = repr(e)
        sp.check()
        es = sp.EstimateSelect()
        row["select_device_ms"] = time_calls(lambda i: sp.select(q, k, v, es, device=True), calls, args.rounds)
        row["selector_kernels_ms"] = kernel_ms(lambda: sp.select(q, k, v, es, device=True), ("select", "block_means"))
        row["select_ratio"] = row["select_device_ms"] / row["selector_kernels_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, out, masks, in_place, plan
        torch.cuda.empty_cache()
    meta = dict(commit=commit(), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d"),
                command=f"python bench/device_mask_bench.py OUT --lengths {args.lengths} --density {args.density} "
                        f"--masks {args.masks} --rounds {args.rounds}")
    with open(os.path.join(args.out, "device_mask.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Device-resident block masks ({meta['date']}, {meta['commit']}, {meta['gpu']})", "",
             f"`{meta['command']}`", "",
             "| s | density | planned ms | in place ms | ratio | Flex BlockMask ms | select(device) ms | selector kernels ms | ratio |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['s']} | {r['density']} | {r['planned_ms']:.3f} | {r['in_place_ms']:.3f} | {r['ratio']:.3f} | "
                     f"{r.get('flex_mask_ms', float('nan')):.3f} | {r['select_device_ms']:.3f} | "
                     f"{r['selector_kernels_ms']:.3f} | {r['select_ratio']:.3f} |")
    with open(os.path.join(args.out, "device_mask.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
