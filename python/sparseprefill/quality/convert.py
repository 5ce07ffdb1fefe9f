# SPDX-License-Identifier: Apache-2.0
"""python -m sparseprefill.quality.convert: a checkpoint folder for the quality runs.

  convert MODEL.gguf OUT   the GGUF dequantised once by transformers (through the gguf
                           package) and saved as a transformers folder: safetensors weights in
                           --dtype, config, generation config, tokenizer, and source.json naming
                           the GGUF and its sha256. Later runs load the folder in seconds instead
                           of dequantising again (about a minute for a 1.5B model).
  convert --tiny TOKENIZER OUT   a random Qwen2 model of two small layers with TOKENIZER's
                           vocabulary and chat template (a folder, or a .gguf whose tokenizer is
                           read): the CPU dry run of the GPU scripts runs every code path on it."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List, Optional

from . import data

__all__ = ["convert", "tiny", "main"]


def convert(gguf: str, out: str, dtype: str = "bfloat16", device: str = "cpu") -> None:
    """Dequantises `gguf` into `out`, then loads `out` back and checks that it gives the same
    logits as the dequantised model on a short prompt."""
    import torch
    import transformers

    model, tokenizer = data.load_model(gguf, device, dtype)
    # The weights are dequantised already; the GGUF marker only blocks saving them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    x = torch.tensor([tokenizer("The Debian Policy Manual describes", add_special_tokens=False).input_ids],
                     device=model.device)
    with torch.no_grad():
        want = model(x).logits
        del model
        again, _ = data.load_model(out, device, dtype)
        got = again(x).logits
    if not torch.equal(got, want):
        raise RuntimeError(f"{out}: the saved model's logits differ from the GGUF's by up to "
                           f"{(got.float() - want.float()).abs().max().item():.3g}")
    with open(os.path.join(out, "source.json"), "w") as f:
        json.dump({"gguf": os.path.basename(gguf), "gguf_sha256": data.file_sha256(gguf), "dtype": dtype,
                   "transformers": transformers.__version__}, f, indent=1)


def tiny(tokenizer_path: str, out: str, seed: int = 0) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    if tokenizer_path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(tokenizer_path))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
                         rope_theta=1e6, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "source.json"), "w") as f:
        json.dump({"tiny": True, "tokenizer": os.path.basename(os.path.normpath(tokenizer_path)), "seed": seed}, f)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.quality.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .gguf file, or with --tiny the tokenizer (folder or .gguf)")
    p.add_argument("out", help="the folder to write")
    p.add_argument("--tiny", action="store_true", help="a random two-layer Qwen2 with the source's tokenizer")
    p.add_argument("--dtype", default="bfloat16", help="weights' dtype (default bfloat16)")
    p.add_argument("--device", default="cpu", help="where transformers dequantises (cuda is faster)")
    args = p.parse_args(argv)
    if args.tiny:
        tiny(args.source, args.out)
    else:
        convert(args.source, args.out, args.dtype, args.device)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
