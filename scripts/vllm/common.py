# SPDX-License-Identifier: Apache-2.0
"""Shared by the GPU-machine scripts of scripts/vllm/: the Llama-3.1-8B shape for dummy-weight
runs, prompts cut from this repository's own text (the GPU machine has no data set), JSON and
markdown helpers."""

from __future__ import annotations

import json
import math
import os
import pathlib
import random
from typing import Any, Dict, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOME = pathlib.Path(os.environ.get("SP_VLLM_HOME", "/root/sp-vllm"))

# Llama-3.1-8B's architecture (hidden 4096, 32 layers, 32/8 heads, head_dim 128, llama3 RoPE
# scaling to 131072 positions); with load_format="dummy" only this file is read.
LLAMA_8B_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
    "eos_token_id": 128001,
}


def llama_8b_shape_dir() -> str:
    path = HOME / "llama-3.1-8b-shape"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_8B_SHAPE, indent=1))
    return str(path)


def repo_text() -> str:
    """This repository's documentation and sources, in a fixed order (about 2 M characters of
    English prose and C++/CUDA/Python: what a code model is for)."""
    parts = []
    for pattern in ("README.md", "docs/*.md", "src/**/*.cpp", "src/**/*.h", "src/**/*.cu", "src/**/*.cuh",
                    "include/**/*.h", "python/**/*.py", "tests/**/*.cpp", "tests/**/*.py"):
        for path in sorted(ROOT.glob(pattern)):
            parts.append(f"// {path.relative_to(ROOT)}\n{path.read_text(errors='replace')}")
    return "\n\n".join(parts)


def token_windows(tokenizer: Any, lengths: Sequence[int], seed: int) -> List[List[int]]:
    """Token-id prompts of the given lengths, each a window of the repository's text at a seeded
    offset (the text repeated when a window is longer than it)."""
    ids = tokenizer(repo_text(), add_special_tokens=False)["input_ids"]
    longest = max(lengths)
    while len(ids) < 2 * longest:
        ids = ids + ids
    g = random.Random(seed)
    windows = []
    for n in lengths:
        start = g.randrange(len(ids) - n)
        windows.append(ids[start:start + n])
    return windows


def log_uniform(lo: int, hi: int, count: int, seed: int) -> List[int]:
    g = random.Random(seed)
    return [int(round(math.exp(g.uniform(math.log(lo), math.log(hi))))) for _ in range(count)]


# The p99 TTFT a serving rate must stay under (issue 31's SLO for the highest sustained rate).
SLO_S = float(os.environ.get("SP_VLLM_SLO_S", "10"))


def best_rate(record: Dict[str, Any], slo_s: float = SLO_S) -> Optional[float]:
    """The highest finite request rate of a serve.py record whose p99 TTFT met the SLO with no
    failed request (None when no rate did); the inf rate (all requests at once) measures capacity,
    not a sustained rate."""
    ok = [r["rate"] for r in record["runs"] if r["p99_ttft_ms"] is not None and r["p99_ttft_ms"] <= 1e3 * slo_s
          and not r["failed"] and math.isfinite(r["rate"])]
    return max(ok) if ok else None


def capacity(record: Dict[str, Any]) -> Optional[float]:
    """A serve.py record's request throughput at the inf rate (None without one)."""
    runs = [r["request_throughput"] for r in record["runs"] if not math.isfinite(r["rate"])]
    return runs[-1] if runs else None


def soak_rate(record: Dict[str, Any], slo_s: float = SLO_S) -> Optional[float]:
    """The rate a soak runs at from a serve.py record, or from a session record holding one under
    "serve-ours": the saturating rate, its capacity (rounded down to 0.5 req/s), else without an
    inf run its highest rate within the SLO (None when neither)."""
    record = record.get("serve-ours", record)
    cap = capacity(record)
    return math.floor(2 * cap) / 2 if cap else best_rate(record, slo_s)


def write_json(path: str, data: Any) -> None:
    pathlib.Path(path).write_text(json.dumps(data, indent=1))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(x: Any) -> str:
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"
        return "—" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines)


def engine_kwargs(args: Any) -> Dict[str, Any]:
    """The LLM(...) arguments every offline script shares."""
    return dict(model=args.model, dtype="bfloat16", enforce_eager=args.eager, seed=0,
                gpu_memory_utilization=args.gpu_memory_utilization, enable_prefix_caching=False,
                disable_log_stats=False)
