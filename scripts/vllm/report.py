# SPDX-License-Identifier: Apache-2.0
"""Record-ready markdown from the results scripts/vllm/gpu_vllm.sh collects (RESULTS holds
env.json, tests.txt, smoke.json, greedy.md, ttft8b-*.json, chunked-*.json, tpN-*.json,
qwen-*.json, serve-*.json, soak.json; absent ones are listed as not run). Speedups are against FLASH_ATTN
in the same call's engine of the same model and length.

    python scripts/vllm/report.py RESULTS > vllm-results.md"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

from common import SLO_S, best_rate, capacity, table


def load(results: str, name: str) -> Any:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read()
    if name.endswith((".md", ".txt")):
        return text
    try:
        return json.loads(text)
    except ValueError:  # a stage stopped while writing it: its log says why
        return None


def ttft_section(title: str, fa: Optional[list], ours: Optional[list], note: str) -> List[str]:
    lines = [f"### {title}", "", note, ""]
    if not fa or not ours:
        return lines + ["Not run.", ""]
    base = {r["length"]: r["median_ttft_s"] for r in fa}
    rows = []
    for r in ours:
        fa_s = base.get(r["length"])
        rows.append([r["length"], r["setting"], r.get("chunk"), fa_s and 1e3 * fa_s, 1e3 * r["median_ttft_s"],
                     fa_s and fa_s / r["median_ttft_s"], r.get("density")])
    header = ["prompt tokens", "ours: setting", "batched-token budget", "FLASH_ATTN TTFT (ms)", "ours TTFT (ms)",
              "speedup", "density (our calls)"]
    return lines + [table(header, rows), "", "Each TTFT is the median of "
                    f"{len(ours[0]['ttft_s'])} requests after a warm-up (vLLM's first_token_latency).", ""]


def chunk_section(one_fa, one_ours, ch_fa, ch_ours) -> List[str]:
    lines = ["### Chunked prefill: speedup kept against one-shot", ""]
    if not (one_fa and one_ours and ch_fa and ch_ours):
        return lines + ["Not run.", ""]

    def speedups(fa, ours):
        base = {r["length"]: r["median_ttft_s"] for r in fa}
        return {(r["length"], r["setting"]): base[r["length"]] / r["median_ttft_s"] for r in ours if r["length"] in base}

    one, ch = speedups(one_fa, one_ours), speedups(ch_fa, ch_ours)
    rows = [[n, s, one[(n, s)], ch[(n, s)], ch[(n, s)] / one[(n, s)]] for (n, s) in sorted(ch) if (n, s) in one]
    return lines + [f"vLLM's default budget of {ch_ours[0]['chunk']} batched tokens per step; target: at least 80% "
                    "of the one-shot speedup.", "",
                    table(["prompt tokens", "setting", "one-shot speedup", "chunked speedup", "kept"], rows), ""]


def serve_section(fa: Optional[dict], ours: Optional[dict]) -> List[str]:
    lines = ["### Open-loop serving (`vllm serve` + `vllm bench serve`, Poisson arrivals)", ""]
    if not fa or not ours:
        return lines + ["Not run.", ""]
    rows = []
    for rec in (fa, ours):
        for run in rec["runs"]:
            rows.append([rec["backend"], run["rate"], run["completed"], run["failed"], run["median_ttft_ms"],
                         run["p99_ttft_ms"], run["median_tpot_ms"], run["request_throughput"]])
    best = {rec["backend"]: best_rate(rec) for rec in (fa, ours)}
    tpot = [statistics.median(r["median_tpot_ms"] for r in rec["runs"] if math.isfinite(r["rate"])) for rec in (fa, ours)]
    ratio = (best["CUSTOM"] / best["FLASH_ATTN"]) if best.get("CUSTOM") and best.get("FLASH_ATTN") else None
    cap = [capacity(rec) for rec in (fa, ours)]
    cap_line = (f"Capacity (request throughput with every request at once, rate inf): FLASH_ATTN {cap[0]:.2f}, ours "
                f"{cap[1]:.2f} req/s ({cap[1] / cap[0]:.2f}x). " if None not in cap else "")
    return lines + [f"Model {os.path.basename(fa['model'].rstrip('/'))}; prompts log-uniform over "
                    f"{fa['lengths'][0]}-{fa['lengths'][1]} tokens, {fa['output_len']} output tokens; ours: "
                    f"`{json.dumps(ours['config'])}`.", "",
                    table(["backend", "rate (req/s)", "completed", "failed", "TTFT p50 (ms)", "TTFT p99 (ms)",
                           "TPOT p50 (ms)", "throughput (req/s)"], rows), "",
                    f"Highest rate with p99 TTFT <= {SLO_S:g} s and no failure: FLASH_ATTN {best.get('FLASH_ATTN')}, "
                    f"ours {best.get('CUSTOM')} (ratio {ratio if ratio is None else round(ratio, 2)}; target >= 1.8). "
                    + cap_line + f"TPOT (median over the finite rates): FLASH_ATTN {tpot[0]:.2f} ms, ours {tpot[1]:.2f} ms "
                    f"({100 * (tpot[1] / tpot[0] - 1):+.1f}%; target within 5%).", ""]


def soak_section(soak: Optional[dict]) -> List[str]:
    lines = ["### Soak", ""]
    if not soak:
        return lines + ["Not run.", ""]
    (run,) = soak["runs"]
    mem = soak.get("memory_mib", {})
    source = (f" (the highest rate of {os.path.basename(soak['soak_rate_of'])} within the SLO)"
              if soak.get("soak_rate_of") else "")
    return lines + [f"{run['duration']:.0f} s at {run['rate']:g} req/s{source} with ours "
                    f"(`{json.dumps(soak['config'])}`): "
                    f"{run['completed']} completed, {run['failed']} failed; device memory {mem.get('first')} -> "
                    f"{mem.get('last')} MiB (min {mem.get('min')}, max {mem.get('max')}, {mem.get('samples')} samples "
                    f"every 5 s).", ""]


def main() -> int:
    results = sys.argv[1]
    env: Dict[str, Any] = load(results, "env.json") or {}
    out = ["## vLLM backend (issue 31): results", ""]
    out += [f"- {k}: {v}" for k, v in env.items()] + [""]
    tests = load(results, "tests.txt")
    out += ["### Backend tests (tests/python/test_vllm_*.py)", "", (tests or "Not run.").strip(), ""]
    smoke = load(results, "smoke.json")
    out += ["### Engine smoke run (tiny model, dummy weights, CUDA graphs, chunked prefill)", "",
            json.dumps(smoke) if smoke else "Not run.", ""]
    greedy = load(results, "greedy.md")
    out += [greedy.strip() if greedy else "### Greedy agreement with FLASH_ATTN\n\nNot run.", ""]
    out += ttft_section("TTFT, Llama-3.1-8B shape, dummy weights (one-shot prefill)", load(results, "ttft8b-fa.json"),
                        load(results, "ttft8b-ours.json"),
                        "Dummy weights make attention uniform, so the fixed densities are the benchmark setting "
                        "`synthetic` (a BlockSparse mask keeping that fraction of each query block's visible key "
                        "blocks; docs/vllm.md), not a policy's decisions.")
    out += chunk_section(load(results, "ttft8b-fa.json"), load(results, "ttft8b-ours.json"),
                         load(results, "chunked-fa.json"), load(results, "chunked-ours.json"))
    for tp in sorted({int(n[2:].split("-")[0]) for n in os.listdir(results) if n.startswith("tp") and
                      n.endswith("-fa.json")}):
        out += ttft_section(f"TTFT at tensor parallelism {tp}, Llama-3.1-8B shape, dummy weights",
                            load(results, f"tp{tp}-fa.json"), load(results, f"tp{tp}-ours.json"),
                            f"vLLM's tensor_parallel_size {tp}: each rank runs its heads; FLASH_ATTN at the same size.")
    out += ttft_section("TTFT with real weights", load(results, "qwen-fa.json"), load(results, "qwen-ours.json"),
                        "Each policy at its setting; density: kept / visible key blocks over our calls of one "
                        "untimed request of that length.")
    out += serve_section(load(results, "serve-fa.json"), load(results, "serve-ours.json"))
    out += soak_section(load(results, "soak.json"))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
