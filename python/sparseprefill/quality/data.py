# SPDX-License-Identifier: Apache-2.0
"""Text and model inputs of the quality runs: the calibration / held-out split of one long
document (by a character offset snapped to a paragraph break, so the parts never overlap),
token windows, passkey prompts, and loading a model from a GGUF file or a transformers folder."""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import random
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

__all__ = ["TextSplit", "split_text", "read_split", "windows", "PasskeyPrompt", "passkey_prompt",
           "load_model", "file_sha256", "progress", "record_date", "calibration_epoch"]

# The held-out part starts at this fraction of the document (calibration text before it).
DEFAULT_SPLIT_FRACTION = 0.4


@dataclass(frozen=True)
class TextSplit:
    """One document cut in two at `boundary` (a character offset): calibration text is
    [0, boundary), evaluation text is [boundary, len)."""

    path: str
    sha256: str
    length: int
    boundary: int
    calibration: str
    evaluation: str

    def describe(self) -> dict:
        return {"path": os.path.basename(self.path), "sha256": self.sha256, "chars": self.length,
                "calibration_chars": [0, self.boundary], "evaluation_chars": [self.boundary, self.length],
                "split": "one document, cut at the first paragraph break at or after the split fraction"}


def add_model_args(p: argparse.ArgumentParser, text_help: str) -> None:
    """The arguments every quality command takes: --model, --model-name, --text (helped by
    text_help: which part of it the command reads) and --split-fraction."""
    p.add_argument("--model", required=True, help="a .gguf file or a transformers model folder")
    p.add_argument("--model-name", help="recorded in the output (default: the file or folder name)")
    p.add_argument("--text", required=True, help=text_help)
    p.add_argument("--split-fraction", type=float, default=DEFAULT_SPLIT_FRACTION,
                   help="calibration text ends at the first paragraph break after this fraction "
                        f"(default {DEFAULT_SPLIT_FRACTION}); the rest is held out")


def split_text(text: str, fraction: float = DEFAULT_SPLIT_FRACTION) -> int:
    """The boundary offset: the first paragraph break ("\\n\\n") at or after fraction * len,
    moved past the break; len(text) if there is none. 0 < fraction < 1."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"fraction: expected a value in (0, 1), got {fraction}")
    start = int(len(text) * fraction)
    brk = text.find("\n\n", start)
    return len(text) if brk < 0 else brk + 2


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_split(path: str, fraction: float = DEFAULT_SPLIT_FRACTION) -> TextSplit:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    b = split_text(text, fraction)
    return TextSplit(path, file_sha256(path), len(text), b, text[:b], text[b:])


def windows(tokens: Sequence[int], length: int, count: int, start: int = 0) -> List[Tuple[int, List[int]]]:
    """`count` consecutive, non-overlapping windows of `length` tokens from `start`:
    [(offset, tokens)]. Raises ValueError when the text is too short."""
    need = start + length * count
    if need > len(tokens):
        raise ValueError(f"text: {count} windows of {length} tokens from token {start} need {need} tokens, "
                         f"the text has {len(tokens)}")
    return [(start + i * length, list(tokens[start + i * length:start + (i + 1) * length])) for i in range(count)]


@dataclass(frozen=True)
class PasskeyPrompt:
    """A prompt of exactly `length` tokens whose last len(answer) tokens are the passkey's
    digits; the model retrieves it iff its greedy prediction at each answer position (teacher
    forced, which is what greedy decoding would produce) equals the answer token."""

    length: int
    depth: float
    key: str
    ids: List[int]
    answer: List[int]
    needle_at: int  # token offset of the needle sentence


def passkey_prompt(tokenizer: Any, filler: Sequence[int], length: int, depth: float, key: str) -> PasskeyPrompt:
    """The passkey test of Mohtashami & Jaggi (2023) with real text as the distractor: an
    instruction, filler tokens with the needle sentence at `depth` (0 = start, 1 = end of the
    filler), the question, and the answer (the key's tokens)."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: expected a fraction in [0, 1], got {depth}")
    encode = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    head = encode("There is an important piece of information hidden inside a lot of irrelevant text. "
                  "Find it and memorize it.\n\n")
    needle = encode(f"\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n")
    question = encode("\n\nWhat is the pass key? The pass key is")
    answer = encode(" " + key)
    n = length - len(head) - len(needle) - len(question) - len(answer)
    if n < 0 or n > len(filler):
        raise ValueError(f"filler: a {length}-token prompt needs {max(n, 0)} filler tokens, got {len(filler)}")
    at = int(round(n * depth))
    ids = head + list(filler[:at]) + needle + list(filler[at:n]) + question + answer
    return PasskeyPrompt(length, depth, key, ids, answer, len(head) + at)


def passkeys(seed: int, count: int) -> List[str]:
    """`count` distinct five-digit keys from a seeded generator."""
    rng = random.Random(seed)
    keys: List[str] = []
    while len(keys) < count:
        k = str(rng.randrange(10000, 100000))
        if k not in keys:
            keys.append(k)
    return keys


def load_model(path: str, device: str = "cpu", dtype: str = "auto") -> Tuple[Any, Any]:
    """(model, tokenizer) from a .gguf file (transformers dequantises it through the gguf
    package) or a transformers model folder. dtype "auto": float32 on the CPU, bfloat16 on CUDA."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        kwargs = {"gguf_file": name}
    else:
        folder, kwargs = path, {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype, **kwargs)
    return model.to(device).eval(), tokenizer


def progress(iterable: Any = None, total: int = 0, desc: str = "") -> Any:
    """A progress bar on stderr (tqdm, which transformers depends on)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total or None, desc=desc, dynamic_ncols=True, leave=True)


def record_date() -> str:
    """The date a calibration file records: SOURCE_DATE_EPOCH's (the reproducible-builds
    convention; UTC) when it is set, so that a calibration made again from the same model, text
    and arguments is the same file, byte for byte (what a resumed quality run checks: longctx's
    calibration_sha256); today's otherwise."""
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    if not epoch:
        return datetime.date.today().isoformat()
    try:
        return datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc).date().isoformat()
    except (ValueError, OverflowError, OSError):
        raise SystemExit(f"SOURCE_DATE_EPOCH: expected whole seconds since 1970-01-01 UTC, got {epoch!r}")


def calibration_epoch(doc: dict) -> int:
    """SOURCE_DATE_EPOCH (midnight UTC) of the date a longctx results document's calibration
    records, to make that calibration again byte for byte (record_date) when only the results
    were kept."""
    date = doc["meta"]["calibration"]["metadata"].get("date")
    if not date:
        raise SystemExit("results: the calibration's metadata records no date")
    day = datetime.date.fromisoformat(date)
    return int(datetime.datetime(day.year, day.month, day.day, tzinfo=datetime.timezone.utc).timestamp())
