# SPDX-License-Identifier: Apache-2.0
"""The whole engine with our backend, on a tiny Llama-shaped model with dummy weights: CUDA
graphs on (FULL graphs for decode steps, piecewise otherwise), chunked prefill of a long prompt
(budget 1024 tokens) beside short ones, so steps mix decodes, chunks and short prefills; the
plugin found through its entry point alone (`attention_backend="CUSTOM"`, no import of ours).
Exits non-zero unless every request returns all its tokens.

    python scripts/vllm/smoke.py --out smoke.json"""

from __future__ import annotations

import argparse
import json
import sys
import time

import common

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
        "vocab_size": 1024, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from vllm import LLM, SamplingParams, TokensPrompt

    path = common.HOME / "tiny-llama"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY))
    config = {"policy": "estimate_select", "alpha": 0.1, "min_sparse_len": 2048, "dense_layers": [0]}
    t0 = time.time()
    llm = LLM(model=str(path), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=8192,
              max_num_batched_tokens=1024, attention_backend="CUSTOM", gpu_memory_utilization=0.3, seed=0,
              additional_config={"sparseprefill": config})
    started = time.time() - t0
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i) % 1000 + 3 for i in range(n)]) for n in (6000, 3000, 40, 300)]
    params = SamplingParams(max_tokens=24, temperature=0.0, detokenize=False, ignore_eos=True)
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    result = {"engine_start_s": started, "generate_s": time.time() - t0, "tokens": lengths, "config": config,
              "ok": lengths == [24] * len(prompts)}
    common.write_json(args.out, result)
    print(f"smoke: {'ok' if result['ok'] else 'FAILED'}: {result}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
