# SPDX-License-Identifier: Apache-2.0
"""Greedy-token agreement of our backend with FLASH_ATTN on a real model: the same 50 prompts
(windows of this repository's text, lengths log-uniform over --min-len .. --max-len tokens)
through two engines in turn (separate processes), 32 greedy tokens each, CUDA graphs on (decode
steps run FLASH_ATTN's graphs in both). Passes when at least --pass-fraction of the prompts give
the same first 32 tokens; reports every divergence (prompt, position, both tokens, both
logprobs and FLASH_ATTN's top-2 margin there) and the logprob differences over agreeing tokens.
--controls adds other vLLM backends (for example TRITON_ATTN), compared with FLASH_ATTN the
same way: what two correct dense backends give on the same prompts, the scale for ours.

    python scripts/vllm/greedy.py --model $SP_VLLM_MODEL --out greedy   # -> greedy.json, greedy.md
    python scripts/vllm/greedy.py ... --controls TRITON_ATTN

--config: our additional_config body; by default dense with min_sparse_len 1, so that every
prefill of the run goes through our kernel."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import common

DEFAULT_CONFIG = {"policy": "dense", "min_sparse_len": 1}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("SP_VLLM_MODEL"), help="checkpoint folder with its tokenizer")
    p.add_argument("--out", required=True, help="path prefix of the .json and .md results")
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--min-len", type=int, default=1024)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--config", default=json.dumps(DEFAULT_CONFIG))
    p.add_argument("--pass-fraction", type=float, default=0.9)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    p.add_argument("--controls", default="", help="comma-separated vLLM backends also compared with FLASH_ATTN")
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--prompt-file", help=argparse.SUPPRESS)
    return p.parse_args()


def run_engine(args: argparse.Namespace) -> None:
    """One engine: greedy tokens with their logprobs and the top-2 at each position."""
    from vllm import LLM, SamplingParams, TokensPrompt

    prompts = json.loads(open(args.prompt_file).read())
    kwargs = common.engine_kwargs(args)
    kwargs.update(attention_backend=args.run, max_model_len=args.max_len + args.tokens + 16)
    if args.run == "CUSTOM":
        kwargs["additional_config"] = {"sparseprefill": json.loads(args.config)}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, logprobs=2, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        steps = []
        for tok, lp in zip(c.token_ids, c.logprobs):
            ranked = sorted(lp.items(), key=lambda kv: -kv[1].logprob)
            steps.append({"token": tok, "logprob": lp[tok].logprob,
                          "top2": [[t, v.logprob] for t, v in ranked[:2]]})
        result.append(steps)
    common.write_json(args.prompt_file + f".{args.run}.json", result)


def compare(fa: list, ours: list, prompt_lens: list, tokens: int) -> dict:
    agree, divergences, deltas = 0, [], []
    for i, (a, b) in enumerate(zip(fa, ours)):
        ta, tb = [s["token"] for s in a[:tokens]], [s["token"] for s in b[:tokens]]
        first = next((j for j in range(min(len(ta), len(tb))) if ta[j] != tb[j]), None)
        if first is None and len(ta) == len(tb):
            agree += 1
        upto = len(ta) if first is None else first
        deltas += [abs(a[j]["logprob"] - b[j]["logprob"]) for j in range(upto)]
        if first is not None:
            top2 = a[first]["top2"]
            margin = top2[0][1] - top2[1][1] if len(top2) > 1 else None
            divergences.append({"prompt": i, "prompt_len": prompt_lens[i], "position": first,
                                "flash_attn": [ta[first], a[first]["logprob"]],
                                "ours": [tb[first], b[first]["logprob"]], "flash_attn_top2_margin": margin})
    return {"prompts": len(fa), "agree": agree, "fraction": agree / max(1, len(fa)), "divergences": divergences,
            "max_logprob_diff": max(deltas) if deltas else None,
            "mean_logprob_diff": sum(deltas) / len(deltas) if deltas else None}


def main() -> int:
    args = parse()
    if args.run:
        run_engine(args)
        return 0
    if not args.model or not os.path.isdir(args.model):
        print(f"greedy: no model folder ({args.model!r}); set SP_VLLM_MODEL", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lengths = common.log_uniform(args.min_len, args.max_len, args.prompts, seed=1)
    prompts = common.token_windows(tokenizer, lengths, seed=2)
    prompt_file = args.out + ".prompts.json"
    common.write_json(prompt_file, prompts)
    controls = [b for b in args.controls.split(",") if b]
    outputs = {}
    for backend in ["FLASH_ATTN", "CUSTOM"] + controls:
        cmd = [sys.executable, __file__, "--run", backend, "--prompt-file", prompt_file] + sys.argv[1:]
        subprocess.run(cmd, check=True)
        outputs[backend] = json.loads(open(f"{prompt_file}.{backend}.json").read())
    result = compare(outputs["FLASH_ATTN"], outputs["CUSTOM"], lengths, args.tokens)
    result.update(model=args.model, config=json.loads(args.config), tokens=args.tokens,
                  lengths=[args.min_len, args.max_len], pass_fraction=args.pass_fraction,
                  passed=result["fraction"] >= args.pass_fraction,
                  controls={b: compare(outputs["FLASH_ATTN"], outputs[b], lengths, args.tokens) for b in controls})
    common.write_json(args.out + ".json", result)
    lines = [f"### Greedy agreement with FLASH_ATTN: {os.path.basename(args.model.rstrip('/'))}", "",
             f"{result['agree']} of {result['prompts']} prompts ({100 * result['fraction']:.0f}%) give FLASH_ATTN's "
             f"first {args.tokens} greedy tokens (pass: >= {100 * args.pass_fraction:.0f}%: "
             f"{'PASS' if result['passed'] else 'FAIL'}); prompts of {args.min_len}-{args.max_len} tokens, "
             f"configuration `{json.dumps(result['config'])}`, CUDA graphs {'off' if args.eager else 'on'}.",
             f"Logprob of the agreeing tokens: max |diff| {result['max_logprob_diff']}, mean "
             f"{result['mean_logprob_diff']}.", ""]
    lines += [f"Control, {b} against FLASH_ATTN on the same prompts: {c['agree']} of {c['prompts']} agree "
              f"({100 * c['fraction']:.0f}%); logprob max |diff| {c['max_logprob_diff']}, mean {c['mean_logprob_diff']}."
              for b, c in result["controls"].items()]
    if controls:
        lines.append("")
    rows = [(b, d) for b, r in [("ours", result)] + list(result["controls"].items()) for d in r["divergences"]]
    if rows:
        lines.append(common.table(
            ["backend", "prompt", "prompt tokens", "position", "FLASH_ATTN token (logprob)", "its token (logprob)",
             "FLASH_ATTN top-2 margin"],
            [[b, d["prompt"], d["prompt_len"], d["position"], f"{d['flash_attn'][0]} ({d['flash_attn'][1]:.3f})",
              f"{d['ours'][0]} ({d['ours'][1]:.3f})",
              None if d["flash_attn_top2_margin"] is None else round(d["flash_attn_top2_margin"], 4)]
             for b, d in rows]))
    with open(args.out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
