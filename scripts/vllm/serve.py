# SPDX-License-Identifier: Apache-2.0
"""Open-loop serving: `vllm serve` with one backend, then `vllm bench serve` against it at each
request rate (Poisson arrivals: --request-rate R --burstiness 1), prompts cut from this
repository's text with lengths log-uniform over --min-len .. --max-len tokens (a custom JSONL
data set), --output-len tokens each (ignore_eos). Records TTFT p50/p99, TPOT, request
throughput and failures per rate. A rate of `inf` sends --saturate-count requests at once: its
request throughput is the server's capacity, the figure the rates' grid only brackets. With --soak S, one run of S seconds instead, sampling the
device memory every 5 s (it must stay flat) and counting failed requests, at --soak-rate or at
the saturating rate of an earlier record (--soak-rate-of: common.soak_rate, its capacity, or
its highest rate whose p99 TTFT met the SLO, SP_VLLM_SLO_S).

    python scripts/vllm/serve.py --backend FLASH_ATTN --model $SP_VLLM_MODEL --rates 2,4,8 --out fa.json
    python scripts/vllm/serve.py --backend CUSTOM --config '{"policy": "estimate_select", "alpha": 0.1}' ...
    python scripts/vllm/serve.py --backend CUSTOM ... --soak 300 --soak-rate-of ours.json --out soak.json

Prefix caching is off (no prompt shares a cached prefix by chance). The server listens on
127.0.0.1 only and is stopped when the runs end."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import common

# Distinct prompts at most: `vllm bench serve` draws past them at random (its oversampling), which
# keeps a soak's data set and its tokenisation small; with prefix caching off a repeated prompt
# costs what a new one does.
PROMPT_POOL = 400


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, choices=["FLASH_ATTN", "CUSTOM"])
    p.add_argument("--model", default=os.environ.get("SP_VLLM_MODEL"))
    p.add_argument("--config", default="{}", help="our additional_config body (CUSTOM)")
    p.add_argument("--rates", default="4,8,12,inf", help="requests per second; inf: all at once (capacity)")
    p.add_argument("--saturate-count", type=int, default=200, help="requests of the inf rate")
    p.add_argument("--seconds", type=float, default=30.0, help="arrivals per rate: rate x seconds requests")
    p.add_argument("--min-len", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=32000)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--soak", type=float, default=0.0, help="seconds of one soak run instead of the rates")
    p.add_argument("--soak-rate", type=float, default=4.0, help="the soak's rate (without --soak-rate-of)")
    p.add_argument("--soak-rate-of", metavar="RECORD",
                   help="soak at the saturating rate of this serve.py (or session) record")
    p.add_argument("--port", type=int, default=18731)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--out", required=True)
    return p.parse_args()


def dataset(args: argparse.Namespace, count: int) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lengths = common.log_uniform(args.min_len, args.max_len, count, seed=3)
    path = args.out + ".prompts.jsonl"
    with open(path, "w") as f:
        for ids in common.token_windows(tokenizer, lengths, seed=4):
            f.write(json.dumps({"prompt": tokenizer.decode(ids)}) + "\n")
    return path


def cli(*words: str) -> list:
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", *words]


def wait_ready(port: int, server: subprocess.Popen, timeout: float = 300.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vllm serve not ready after {timeout} s")


def memory_sampler(samples: list, stop: threading.Event) -> None:
    while not stop.is_set():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True)
        if out.returncode == 0:
            samples.append([time.time(), int(out.stdout.split()[0])])
        stop.wait(5.0)


def bench(args: argparse.Namespace, data: str, rate: float, count: int, tag: str) -> dict:
    result_dir = os.path.dirname(os.path.abspath(args.out))
    name = f"{os.path.basename(args.out)}.{tag}.result.json"
    subprocess.run(cli("bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{args.port}",
                       "--model", args.model, "--dataset-name", "custom", "--dataset-path", data,
                       "--custom-output-len", str(args.output_len), "--skip-chat-template", "--ignore-eos",
                       "--num-prompts", str(count), "--request-rate", str(rate), "--burstiness", "1", "--seed", "0",
                       "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                       "--save-result", "--result-dir", result_dir, "--result-filename", name), check=True)
    with open(os.path.join(result_dir, name)) as f:
        raw = json.load(f)
    keep = ("completed", "failed", "request_throughput", "output_throughput", "total_input_tokens", "duration",
            "median_ttft_ms", "p99_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "mean_tpot_ms",
            "median_itl_ms", "median_e2el_ms", "p99_e2el_ms")
    return {"rate": rate, "num_prompts": count, **{k: raw.get(k) for k in keep},
            "errors": sorted({e for e in raw.get("errors", []) if e})[:5]}


def main() -> int:
    args = parse()
    if not args.model or not os.path.isdir(args.model):
        print(f"serve: no model folder ({args.model!r}); set SP_VLLM_MODEL", file=sys.stderr)
        return 2
    if args.soak and args.soak_rate_of:
        if not os.path.exists(args.soak_rate_of):
            print(f"serve: --soak-rate-of {args.soak_rate_of}: no such record (run the serving rates first, or "
                  "give --soak-rate)", file=sys.stderr)
            return 2
        with open(args.soak_rate_of) as f:
            args.soak_rate = common.soak_rate(json.load(f))
        if args.soak_rate is None:
            print(f"serve: {args.soak_rate_of} has no inf run and no rate within the SLO of {common.SLO_S:g} s",
                  file=sys.stderr)
            return 2
    rates = [args.soak_rate] if args.soak else [float(r) for r in args.rates.split(",")]
    counts = [args.saturate_count if r == float("inf") else max(8, int(round(r * (args.soak or args.seconds))))
              for r in rates]
    data = dataset(args, min(max(counts), PROMPT_POOL))
    serve = cli("serve", args.model, "--host", "127.0.0.1", "--port", str(args.port), "--attention-backend",
                args.backend, "--max-model-len", str(args.max_len + args.output_len + 64),
                "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--no-enable-prefix-caching",
                "--dtype", "bfloat16")
    if args.backend == "CUSTOM":
        serve += ["--additional-config", json.dumps({"sparseprefill": json.loads(args.config)})]
    log = open(args.out + ".server.log", "w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    record = {"backend": args.backend, "config": json.loads(args.config), "model": args.model,
              "lengths": [args.min_len, args.max_len], "output_len": args.output_len, "runs": []}
    if args.soak:
        record["soak_rate_of"] = args.soak_rate_of
    try:
        t0 = time.time()
        wait_ready(args.port, server)
        record["server_start_s"] = time.time() - t0
        samples: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=memory_sampler, args=(samples, stop), daemon=True)
        sampler.start()
        for rate, count in zip(rates, counts):
            record["runs"].append(bench(args, data, rate, count, "soak" if args.soak else f"rate{rate:g}"))
            common.write_json(args.out, record)
        stop.set()
        sampler.join()
        if samples:
            used = [m for _, m in samples]
            record["memory_mib"] = {"first": used[0], "last": used[-1], "min": min(used), "max": max(used),
                                    "samples": len(used)}
        common.write_json(args.out, record)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
