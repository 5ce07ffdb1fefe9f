# SPDX-License-Identifier: Apache-2.0
"""Time to first token of single prompts through vLLM's offline engine, for one backend: one
engine start, then each setting (CUSTOM: additional_config bodies switched in between requests
by sparseprefill.vllm.worker, so the settings are peers in one engine) at each prompt length:
a warm-up request, then --repeats timed ones (TTFT: vLLM's own first_token_latency, from
arrival to the first token), each prompt new (prefix caching off). With --density, one more
request per setting and length records the density of our calls (statistics synchronise, so
that request is not timed). With --profile FILE, one more untimed request per setting and
length runs under torch.profiler in the worker, and its operator tables (by self CUDA and self
CPU time) go to FILE.

    python scripts/vllm/ttft.py --backend FLASH_ATTN --dummy --lengths 32768,65536,130048 --out fa.json
    python scripts/vllm/ttft.py --backend CUSTOM --dummy --lengths 32768 --out ours.json \
        --settings '[{"name": "dense", "sparseprefill": {"policy": "dense"}}]'

--dummy: the Llama-3.1-8B shape with dummy weights (common.LLAMA_8B_SHAPE); else --model, a
checkpoint folder with real weights. --chunk N: the engine's max_num_batched_tokens (chunked
prefill); 0 keeps vLLM's default budget; by default the longest prompt (one-shot). --tp N: vLLM's
tensor_parallel_size (each rank runs its heads; the density is the ranks' mean)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import common


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, choices=["FLASH_ATTN", "CUSTOM"])
    p.add_argument("--model", help="checkpoint folder (real weights); default with --dummy: the 8B shape")
    p.add_argument("--dummy", action="store_true", help="dummy weights (load_format=dummy, no tokenizer)")
    p.add_argument("--lengths", required=True, help="comma-separated prompt lengths in tokens")
    p.add_argument("--settings", default='[{"name": "default", "sparseprefill": {}}]',
                   help="JSON list of {name, sparseprefill} (CUSTOM only)")
    p.add_argument("--chunk", type=int, default=None, help="max_num_batched_tokens (0: vLLM's default)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--density", action="store_true", help="also record our calls' density (CUSTOM)")
    p.add_argument("--profile", help="a text file: one more request per setting and length under "
                                     "torch.profiler, its operator tables appended there (untimed)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--label", default="", help="a name for these records (e.g. 'Llama-3.1-8B shape, dummy')")
    p.add_argument("--out", required=True)
    return p.parse_args()


def main() -> int:
    args = parse()
    args.eager = True  # prefill steps run eagerly in any mode; no graph capture at start
    from vllm import LLM, SamplingParams, TokensPrompt

    lengths = [int(x) for x in args.lengths.split(",")]
    settings = json.loads(args.settings)
    if args.backend == "FLASH_ATTN":
        settings = [{"name": "FLASH_ATTN", "sparseprefill": None}]
    if args.dummy and args.model is None:
        args.model = common.llama_8b_shape_dir()
    kwargs = common.engine_kwargs(args)
    kwargs.update(attention_backend=args.backend, max_model_len=max(lengths) + 64, tensor_parallel_size=args.tp,
                  max_num_batched_tokens=max(lengths) if args.chunk is None else (args.chunk or None))
    if args.dummy:
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    if args.backend == "CUSTOM" or args.profile:
        kwargs.update(worker_extension_cls="sparseprefill.vllm.worker.SparsePrefillWorkerExtension")
    if args.backend == "CUSTOM":
        kwargs.update(additional_config={"sparseprefill": settings[0]["sparseprefill"]})
    if kwargs["max_num_batched_tokens"] is None:
        del kwargs["max_num_batched_tokens"]
    start = time.time()
    llm = LLM(**kwargs)
    started = time.time() - start
    vocab = llm.llm_engine.model_config.get_vocab_size()
    # The budget the engine runs with (vLLM's default where --chunk 0 left it unset).
    budget = llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    g = random.Random(0)

    def request(n: int) -> tuple:
        prompt = TokensPrompt(prompt_token_ids=[g.randrange(100, vocab - 100) for _ in range(n)])
        t0 = time.perf_counter()
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = getattr(out.metrics, "first_token_latency", None) if out.metrics is not None else None
        return (ttft if ttft else wall), wall

    records = []
    for setting in settings:
        if args.backend == "CUSTOM":
            llm.collective_rpc("sparseprefill_configure", args=({"sparseprefill": setting["sparseprefill"]},))
        for n in lengths:
            request(n)  # warm-up: kernels, allocations, the prepared-call cache
            times = [request(n) for _ in range(args.repeats)]
            rec = {"label": args.label, "backend": args.backend, "setting": setting["name"],
                   "config": setting["sparseprefill"], "length": n, "chunk": budget, "tp": args.tp,
                   "ttft_s": [t for t, _ in times], "wall_s": [w for _, w in times],
                   "median_ttft_s": statistics.median(t for t, _ in times), "engine_start_s": started}
            if args.density and args.backend == "CUSTOM":
                llm.collective_rpc("sparseprefill_collect", args=(True,))
                request(n)
                ranks = llm.collective_rpc("sparseprefill_collect", args=(False,))
                rec["density"] = statistics.mean(r["density"] for r in ranks)  # equal heads per rank
            if args.profile:
                llm.collective_rpc("sparseprefill_profile", args=(True,))
                request(n)
                (tables,) = llm.collective_rpc("sparseprefill_profile", args=(False,))
                with open(args.profile, "a") as f:
                    f.write(f"## {args.backend} {setting['name']} {n} (budget {budget})\n\n{tables}\n\n")
            records.append(rec)
            print(f"ttft: {args.backend} tp {args.tp} {setting['name']} {n}: median {rec['median_ttft_s']:.4f} s "
                  f"{rec.get('density', '')}", flush=True)
            common.write_json(args.out, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
