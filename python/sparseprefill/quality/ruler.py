# SPDX-License-Identifier: Apache-2.0
"""A RULER-style long-context suite of our own (after Hsieh et al., 2024, "RULER: What's the Real
Context Size of Your Long-Context Language Models?"): retrieval (needles in a haystack: one
needle with a number, word or UUID value; several keys with distractors; several values;
several queries), multi-hop tracing (variable tracking), aggregation (common-words and
frequent-words extraction) and question answering over one long document, over haystacks of
real text.

Every sample is a function of (seed, task, length, index): the same arguments give the same
prompt on every machine. A prompt has exactly `length - task.max_new` tokens (the model's chat
template, the task's text, the context, the question and RULER's answer prefix), so that prompt
and answer fit in `length` as in RULER, and the samples of one task and length batch without
padding. Texts are tokenized in units that end at a newline run (lines of the haystack, list
items, coded words) and concatenated; for byte-level BPE tokenizers whose pre-tokenizer splits
after newline runs (Qwen2's) that is the text's own tokenization.

Scoring is RULER's (scripts/eval/synthetic/constants.py there): the greedy answer, stripped,
control characters turned into newlines; string_match_all scores the fraction of the expected
strings it contains, string_match_part scores 1 when it contains any; both case-insensitive."""

from __future__ import annotations

import math
import random
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["Task", "TASKS", "DEFAULT_TASKS", "Encoder", "ChatFrame", "Haystack", "Section", "Sample", "make_sample",
           "postprocess", "string_match_all", "string_match_part", "score", "vocabulary"]


@dataclass(frozen=True)
class Task:
    name: str
    category: str   # retrieval, multi-hop tracing, aggregation, question answering
    metric: str     # "all" (string_match_all) or "part" (string_match_part)
    max_new: int    # greedy generation budget in tokens; the prompt has length - max_new tokens
    about: str


TASKS: Dict[str, Task] = {t.name: t for t in (
    Task("niah_single", "retrieval", "all", 48,
         "one needle; word key; its value a 7-digit number, a word or a UUID in turn (index mod 3)"),
    Task("niah_single_number", "retrieval", "all", 24, "one needle, word key, 7-digit number value"),
    Task("niah_single_word", "retrieval", "all", 24, "one needle, word key, word value"),
    Task("niah_single_uuid", "retrieval", "all", 48, "one needle, word key, UUID value"),
    Task("niah_multikey", "retrieval", "all", 32, "four needles of distinct keys (three distractors), one asked"),
    Task("niah_multivalue", "retrieval", "all", 80, "four needles of one key, every value asked"),
    Task("niah_multiquery", "retrieval", "all", 96, "four needles of distinct keys, every key asked"),
    Task("vt", "multi-hop tracing", "all", 40, "one chain of five variables (four hops) among the text's lines"),
    Task("cwe", "aggregation", "all", 80, "numbered word list: ten words 30 times each, the others 3 times (6 "
                                         "and 1 below 4K tokens); the ten most common asked (one solved example "
                                         "first)"),
    Task("fwe", "aggregation", "all", 40, "coded words with Zipf(2) counts, the most frequent one noise ('...'); "
                                         "the three most frequent others asked"),
    Task("qa", "question answering", "part", 24, "one contiguous part of the document; the number of a section "
                                                 "asked by its title"),
)}

# The suite of the GPU run: every category, the single needle's three value types in one task.
DEFAULT_TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa"]

# RULER's needle depths: 40 points from 0 to 100% of the haystack.
DEPTHS = [round(i / 39, 4) for i in range(40)]
_VALUE_TYPES = ("numbers", "words", "uuids")


def postprocess(pred: str) -> str:
    """RULER's postprocess_pred: strip, control characters to newlines, strip."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """The fraction of refs found in pred (case-insensitive substrings)."""
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1.0 when any ref is found in pred (case-insensitive substring), else 0.0."""
    p = pred.lower()
    return float(any(r.lower() in p for r in refs))


def score(task: str, pred: str, refs: Sequence[str]) -> float:
    """A sample's score in [0, 1] under its task's metric (RULER reports 100 x the mean)."""
    fn = string_match_all if TASKS[task].metric == "all" else string_match_part
    return fn(postprocess(pred), refs)


@dataclass(frozen=True)
class ChatFrame:
    """The chat template around one user message: tokens before it and after it (up to the
    start of the assistant's turn). Empty for a tokenizer without a chat template (RULER's
    'base' template)."""

    prefix: List[int]
    suffix: List[int]


class Encoder:
    """A tokenizer's encode (no special tokens added; special tokens written in the text are
    recognised), cached per text, with batched encoding of new texts where the tokenizer takes
    a list."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: Dict[str, List[int]] = {}
        self._frame: Optional[ChatFrame] = None

    def __call__(self, text: str) -> List[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._cache[text] = list(self.tokenizer(text, add_special_tokens=False).input_ids)
        return ids

    def many(self, texts: Sequence[str]) -> List[List[int]]:
        new = sorted({t for t in texts if t not in self._cache})
        if new:
            out = self.tokenizer(new, add_special_tokens=False).input_ids
            self._cache.update((t, list(ids)) for t, ids in zip(new, out))
        return [self._cache[t] for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    @property
    def frame(self) -> ChatFrame:
        if self._frame is None:
            template = getattr(self.tokenizer, "chat_template", None)
            if not template:
                self._frame = ChatFrame([], [])
            else:
                mark = "@@RULER-MESSAGE@@"
                text = self.tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                                          add_generation_prompt=True)
                if text.count(mark) != 1:
                    raise ValueError("chat template: the user message does not appear exactly once")
                before, after = text.split(mark)
                self._frame = ChatFrame(self(before) if before else [], self(after) if after else [])
        return self._frame


def split_units(text: str) -> List[str]:
    """Lines, each with the newline run that ends it (blank lines go with the line before)."""
    return re.findall(r"[^\n]*\n+|[^\n]+", text)


def vocabulary(text: str, min_len: int = 4, max_len: int = 10) -> List[str]:
    """The lowercase words of a text (letters a-z only, min_len..max_len letters), sorted."""
    return sorted({w for w in re.findall(r"\b[a-z]+\b", text) if min_len <= len(w) <= max_len})


_HEADING = re.compile(r"^(\d+(?:\.\d+)+)\. (\S.*)\n$")
_UNDERLINE = re.compile(r"^([=\-~^\"*#])\1{2,}\n+$")


@dataclass(frozen=True)
class Section:
    """A numbered section heading of the haystack's document: unit index of the heading line
    (its underline is the next unit), number and title."""

    unit: int
    number: str
    title: str


@dataclass
class Haystack:
    """A document as units (lines with their newline runs) and their tokens. The body starts at
    the first numbered heading with an underline (Sphinx's text output: after the table of
    contents) or at the first unit when there is none; contexts are cut from the body.
    `ends` marks the units after which a needle may be inserted (a line ending a sentence, or
    the end of a paragraph); `starts` the units a context may begin with (paragraph starts);
    `sections` the headings whose number is asked by the QA task (see qa_sections)."""

    name: str
    units: List[str]
    ids: List[List[int]]
    body: int
    starts: List[int]
    ends: List[bool]
    sections: List[Section]

    @classmethod
    def from_text(cls, name: str, text: str, enc: Encoder) -> "Haystack":
        units = split_units(text)
        ids = enc.many(units)
        heads = [Section(i, m.group(1), m.group(2)) for i, u in enumerate(units[:-1])
                 if (m := _HEADING.match(u)) and _UNDERLINE.match(units[i + 1])]
        body = heads[0].unit if heads else 0
        starts = [i for i in range(body, len(units)) if i == body or units[i - 1].endswith("\n\n")]
        ends = [u.endswith("\n\n") or u.rstrip().endswith((".", "!", "?")) for u in units]
        return cls(name, units, ids, body, starts, ends, qa_sections(heads, text))

    def body_tokens(self) -> int:
        return sum(len(x) for x in self.ids[self.body:])

    def take(self, start: int, n: int) -> List[Tuple[int, List[int]]]:
        """Units from `start` until exactly n tokens, [(unit index, tokens)]; the last one may be
        cut short; after the last unit it goes on from the body's start (RULER repeats its essays
        likewise)."""
        out: List[Tuple[int, List[int]]] = []
        got, i = 0, start
        while got < n:
            ids = self.ids[i]
            if not ids:
                i = i + 1 if i + 1 < len(self.units) else self.body
                continue
            if got + len(ids) > n:
                ids = ids[:n - got]
            out.append((i, ids))
            got += len(ids)
            i = i + 1 if i + 1 < len(self.units) else self.body
        return out


def qa_sections(heads: List[Section], text: str) -> List[Section]:
    """The headings whose number the QA task may ask: the title is no other heading's, holds no
    digit or double quote (no number to confuse with the answer, a question that quotes it
    plainly), is never cited in curly quotes (the upgrading checklist cites old numbers so), and
    the number is no substring of another heading's number (RULER's substring match would take
    5.6.1 in an answer 5.6.12)."""
    titles = [h.title for h in heads]
    numbers = [h.number for h in heads]
    return [h for h in heads if titles.count(h.title) == 1 and not re.search(r'[0-9"]', h.title)
            and f"\u201c{h.title}\u201d" not in text and not any(h.number in n and n != h.number for n in numbers)]


@dataclass
class Sample:
    """One prompt: ids (exactly length - max_new tokens), the expected strings, and what the
    generator placed where (info: needles' token offsets in ids and depths, chain, section)."""

    task: str
    length: int
    index: int
    ids: List[int]
    max_new: int
    outputs: List[str]
    info: Dict[str, Any] = field(default_factory=dict)


class _Builder:
    """Assembles chat prefix + head + context + tail + chat suffix + answer prefix, the context
    sized so that the whole has exactly `total` tokens."""

    def __init__(self, enc: Encoder, total: int, head: str, tail: str, answer_prefix: str):
        frame = enc.frame
        self.before = frame.prefix + enc(head)
        self.after = enc(tail) + frame.suffix + enc(answer_prefix)
        self.budget = total - len(self.before) - len(self.after)
        if self.budget <= 0:
            raise ValueError(f"length: {total} tokens leave no room for the context "
                             f"({len(self.before) + len(self.after)} tokens of instructions)")

    def ids(self, context: List[int]) -> List[int]:
        if len(context) != self.budget:
            raise AssertionError(f"context of {len(context)} tokens, expected {self.budget}")
        return self.before + context + self.after


def _haystack_with(hay: Haystack, rng: random.Random, n: int, inserts: List[Tuple[float, List[int]]],
                   start: Optional[int] = None) -> Tuple[List[int], List[Dict[str, Any]]]:
    """n tokens: the haystack from `start` (default: a random paragraph start of the body) with
    each insert (depth, tokens), in the given order, placed after the sentence end nearest to
    depth times the haystack's own tokens. Returns (tokens, [{offset, depth}]): each insert's
    offset in the result and the depth where it went."""
    room = n - sum(len(x) for _, x in inserts)
    if room <= 0:
        raise ValueError(f"context: {n} tokens cannot hold inserts of {n - room} tokens")
    if start is None:
        start = rng.choice(hay.starts)
    pieces = hay.take(start, room)
    # Boundaries: token offsets (in the haystack part) after a complete unit ending a sentence.
    bounds, at = [0], 0
    for k, (i, ids) in enumerate(pieces):
        at += len(ids)
        if len(ids) == len(hay.ids[i]) and hay.ends[i] and k + 1 < len(pieces):
            bounds.append(at)
    placed = []
    for depth, ids in inserts:
        target = depth * room
        b = min(bounds, key=lambda x: (abs(x - target), x))
        placed.append((b, ids))
    if any(p[0] > q[0] for p, q in zip(placed, placed[1:])):
        raise ValueError("inserts: depths must be given in ascending order")
    flat = [t for _, ids in pieces for t in ids]
    out: List[int] = []
    where = []
    prev = 0
    for b, ids in placed:
        out += flat[prev:b]
        where.append({"offset": len(out), "depth": round(b / room, 4)})
        out += ids
        prev = b
    out += flat[prev:]
    return out, where


def _uniq(rng: random.Random, make: Any, count: int, avoid: Iterable[str] = ()) -> List[str]:
    seen = set(avoid)
    out: List[str] = []
    while len(out) < count:
        v = make(rng)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def _value(kind: str, words: Sequence[str]) -> Any:
    if kind == "numbers":
        return lambda r: str(r.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return lambda r: "-".join(r.sample(list(words), 2))
    if kind == "uuids":
        return lambda r: str(uuid.UUID(int=r.getrandbits(128), version=4))
    raise ValueError(f"value type: expected one of {_VALUE_TYPES}, got {kind}")


def _niah(enc: Encoder, hay: Haystack, words: Sequence[str], rng: random.Random, total: int, kind: str,
          keys: int, values: int, queries: int) -> Tuple[List[int], List[str], Dict[str, Any]]:
    """RULER's niah: needles "One of the special magic {kind} for {key} is: {value}." in real
    text; keys are two words joined by '-'. The wording is RULER's (singular when one value is
    asked)."""
    key_list = _uniq(rng, _value("words", words), keys)
    vals = _uniq(rng, _value(kind, words), keys * values, key_list)
    needles = [(k, vals[i * values + j]) for i, k in enumerate(key_list) for j in range(values)]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(key_list, queries)
    query = asked[0] if queries == 1 else ", ".join(asked[:-1]) + ", and " + asked[-1]
    one = queries * values == 1
    v = kind[:-1] if one else kind
    head = (f"A special magic {v} is hidden within the following text. Make sure to memorize it. I will quiz you "
            f"about the {v} afterwards.\n") if one else (
        f"Some special magic {v} are hidden within the following text. Make sure to memorize it. I will quiz you "
        f"about the {v} afterwards.\n")
    tail = (f"\nWhat is the special magic {v} for {query} mentioned in the provided text?" if one else
            f"\nWhat are all the special magic {v} for {query} mentioned in the provided text?")
    prefix = f"The special magic {v} for {query} mentioned in the provided text {'is' if one else 'are'}"
    b = _Builder(enc, total, head, tail, prefix)
    texts = [f"One of the special magic {kind} for {k} is: {val}.\n" for k, val in needles]
    context, where = _haystack_with(hay, rng, b.budget, [(d, enc(t)) for d, t in zip(depths, texts)])
    info = {"value_type": kind, "asked": asked,
            "needles": [{"key": k, "value": val, "offset": len(b.before) + w["offset"], "tokens": len(enc(t)),
                         "depth": d, "placed_depth": w["depth"]}
                        for (k, val), t, d, w in zip(needles, texts, depths, where)]}
    outputs = [val for a in asked for k, val in needles if k == a]
    return b.ids(context), outputs, info


def _vt(enc: Encoder, hay: Haystack, rng: random.Random, total: int, hops: int = 4) -> Tuple[List[int], List[str],
                                                                                            Dict[str, Any]]:
    """RULER's variable tracking (one chain): "VAR A = 12345." then "VAR B = VAR A." ... placed in
    order among the text's lines; every variable holding the value is asked. One solved example
    of the task (a short haystack, its own names) comes first, as in RULER."""
    def chain(r: random.Random, avoid: Sequence[str] = ()) -> Tuple[List[str], str, List[str]]:
        names = _uniq(r, lambda q: "".join(q.choices("ABCDEFGHIJKLMNOPQRSTUVWXYZ", k=5)), hops + 1, avoid)
        value = str(r.randint(10000, 99999))
        lines = [f"VAR {names[0]} = {value}.\n"] + [f"VAR {names[j + 1]} = VAR {names[j]}.\n" for j in range(hops)]
        return names, value, lines

    def task_text(value: str) -> Tuple[str, str, str]:
        return ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n",
                f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
                f"Answer: According to the chain(s) of variable assignment in the text above, {hops + 1} variables "
                f"are assigned the value {value}, they are:")

    ex_names, ex_value, ex_lines = chain(rng)
    ex_head, ex_tail, ex_prefix = task_text(ex_value)
    ex_context, _ = _haystack_with(hay, rng, 160 + sum(len(enc(t)) for t in ex_lines),
                                   [(d, enc(t)) for d, t in zip(sorted(rng.sample(DEPTHS, hops + 1)), ex_lines)])
    example = ex_head + enc.decode(ex_context) + ex_tail + " " + ex_prefix + " " + " ".join(ex_names) + "\n\n"
    names, value, lines = chain(rng, ex_names)
    head, tail, prefix = task_text(value)
    b = _Builder(enc, total, example + head, tail, prefix)
    depths = sorted(rng.sample(DEPTHS, hops + 1))
    context, where = _haystack_with(hay, rng, b.budget, [(d, enc(t)) for d, t in zip(depths, lines)])
    info = {"value": value, "chain": [{"name": n, "line": t.strip(), "offset": len(b.before) + w["offset"],
                                       "tokens": len(enc(t)), "depth": d, "placed_depth": w["depth"]}
                                      for n, t, d, w in zip(names, lines, depths, where)],
            "example_names": ex_names}
    return b.ids(context), names, info


def _word_list(enc: Encoder, items: Sequence[str], first: int = 1) -> List[List[int]]:
    """Tokens of a numbered list "1. w1 2. w2 ..." (numbered from `first`), item by item: the
    number unit, then the word unit."""
    nums = enc.many([f"{i}." if i == 1 else f" {i}." for i in range(first, first + len(items))])
    ws = enc.many([f" {w}" for w in items])
    return [a + b for a, b in zip(nums, ws)]


def _cwe(enc: Encoder, words: Sequence[str], rng: random.Random, total: int, short: bool,
         common: int = 10) -> Tuple[List[int], List[str], Dict[str, Any]]:
    """RULER's common-words extraction: `common` words 30 times each and the others 3 times
    (6 and 1 for a short length, below 4096 tokens, as RULER), shuffled, as a numbered list; the
    list grows with the length, and the tokens the last whole item leaves are filled with words
    once each and a cut-off item. One solved example (40 words, 10 of them 10 times, 30 three
    times; short: 20 words, 3 and 1 times) first, as RULER's default num_fewshot = 1."""
    f_common, f_uncommon = (6, 1) if short else (30, 3)
    ex_n, ex_common, ex_uncommon = (20, 3, 1) if short else (40, 10, 3)
    pool = list(words)
    rng.shuffle(pool)
    ex_words, pool = pool[:ex_n], pool[ex_n:]
    head = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
            "ones that appear most often.\n")
    question = f"\nQuestion: What are the {common} most common words in the above list?"
    prefix = f"Answer: The top {common} words that appear most often in the list are:"
    ex = ex_words[:common] * ex_common + ex_words[common:] * ex_uncommon
    random.Random(f"{rng.random()}").shuffle(ex)
    example = (head + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex)) + question + " " + prefix + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_words[:common])) + "\n\n")
    b = _Builder(enc, total, example + head, question, prefix)
    top, rest = pool[:common], pool[common:]
    order_seed = rng.random()

    def listing(u: int) -> List[str]:
        items = top * f_common + rest[:u] * f_uncommon
        random.Random(f"{order_seed}:{u}").shuffle(items)
        return items

    def size(u: int) -> int:
        return sum(len(x) for x in _word_list(enc, listing(u)))

    lo, hi = 0, len(rest)
    if size(0) > b.budget:
        raise ValueError(f"cwe: {b.budget} tokens cannot hold the {common} common words {f_common} times")
    while lo < hi:  # the largest u whose list fits
        mid = (lo + hi + 1) // 2
        if size(mid) <= b.budget:
            lo = mid
        else:
            hi = mid - 1
    if lo == len(rest):
        raise ValueError(f"cwe: the vocabulary ({len(words)} words) is too small for {b.budget} tokens")
    items = listing(lo)
    toks = _word_list(enc, items)
    got = sum(len(x) for x in toks)
    spare = rest[lo:]
    while True:  # words once each, then one item cut to the tokens left
        extra = _word_list(enc, spare[:1], len(items) + 1)[0]
        if got + len(extra) <= b.budget and len(spare) > 1:
            items.append(spare.pop(0))
            toks.append(extra)
            got += len(extra)
            continue
        toks.append(extra[:b.budget - got])
        break
    context = [t for x in toks for t in x]
    info = {"uncommon": lo, "items": len(items), "example": ex_words[:common]}
    return b.ids(context), top, info


ZETA_2 = math.pi ** 2 / 6


def _fwe(enc: Encoder, rng: random.Random, total: int, word_len: int = 6,
         alpha: float = 2.0) -> Tuple[List[int], List[str], Dict[str, Any]]:
    """RULER's frequent-words extraction: a vocabulary of (length - max_new) // 50 coded words
    (word_len random lowercase letters), the k-th appearing floor(N k^-alpha / zeta(alpha))
    times, the first one replaced by '...' (noise), shuffled; N the smallest count whose text
    fills the context, cut to the exact size. The answer is the three most frequent coded words
    of the prompt as cut (checked to lead the fourth)."""
    if alpha != 2.0:
        raise ValueError("alpha: only RULER's 2.0 is implemented (zeta(2) = pi^2 / 6)")
    size = max(total // 50, 8)
    vocab = _uniq(rng, lambda r: "".join(r.choices("abcdefghijklmnopqrstuvwxyz", k=word_len)), size)
    vocab[0] = "..."
    head = ("Read the following coded text and track the frequency of each coded word. Find the three most "
            "frequently appeared coded words.")
    tail = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
            "frequently appeared words in the above coded text?")
    b = _Builder(enc, total, head, tail, "Answer: According to the coded text above, the three most frequently "
                                         "appeared words are:")
    unit = dict(zip(vocab, enc.many([f" {w}" for w in vocab])))
    order_seed = rng.random()

    def stream(n: int) -> List[str]:
        out = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -alpha / ZETA_2))]
        random.Random(f"{order_seed}:{n}").shuffle(out)
        return out

    def tokens(n: int) -> int:
        return sum(len(unit[w]) for w in stream(n))

    lo, hi = 1, 8
    while tokens(hi) < b.budget:
        lo, hi = hi, hi * 2
    while lo < hi:  # the smallest n whose text fills the context
        mid = (lo + hi) // 2
        if tokens(mid) >= b.budget:
            hi = mid
        else:
            lo = mid + 1
    context: List[int] = []
    kept: List[str] = []
    for w in stream(lo):
        if len(context) + len(unit[w]) > b.budget:
            context += unit[w][:b.budget - len(context)]
            break
        context += unit[w]
        kept.append(w)
    counts: Dict[str, int] = {}
    for w in kept:
        if w != "...":
            counts[w] = counts.get(w, 0) + 1
    ranked = sorted(counts, key=lambda w: (-counts[w], w))
    if len(ranked) < 4 or counts[ranked[2]] <= counts[ranked[3]]:
        raise ValueError(f"fwe: {b.budget} tokens are too few for three clearly most frequent words")
    info = {"words": lo, "counts": [counts[w] for w in ranked[:4]]}
    return b.ids(context), ranked[:3], info


def _qa(enc: Encoder, hay: Haystack, rng: random.Random, total: int) -> Tuple[List[int], List[str], Dict[str, Any]]:
    """QA over one long document: a contiguous part of it holding one numbered section heading
    (at a RULER depth), and the question of that section's number by its title; the wording is
    RULER's qa template, for one document."""
    if not hay.sections:
        raise ValueError(f"qa: {hay.name} has no numbered section headings to ask about")
    sec = rng.choice(hay.sections)
    head = ("Answer the question based on the given document. Only give me the answer and do not output any other "
            "words.\n\nThe following is the given document.\n\n")
    tail = ("\n\nAnswer the question based on the given document. Only give me the answer and do not output any other "
            f"words.\n\nQuestion: What is the number of the section titled \"{sec.title}\"?")
    b = _Builder(enc, total, head, tail, "Answer:")
    n = b.budget
    need = len(hay.ids[sec.unit]) + len(hay.ids[sec.unit + 1])
    if need > n:
        raise ValueError(f"qa: {n} tokens cannot hold the heading")
    depth = rng.choice(DEPTHS)
    start, before = sec.unit, 0
    while start > hay.body and before + len(hay.ids[start - 1]) <= depth * (n - need):
        start -= 1
        before += len(hay.ids[start])
    context, _ = _haystack_with(hay, rng, n, [], start=start)
    info = {"number": sec.number, "title": sec.title, "offset": len(b.before) + before, "depth": depth,
            "placed_depth": round(before / n, 4)}
    return b.ids(context), [sec.number], info


def make_sample(task: str, length: int, index: int, seed: int, enc: Encoder, hay: Haystack,
                words: Sequence[str]) -> Sample:
    """Sample `index` of `task` at `length` tokens (prompt + generation budget), a function of
    (seed, task, length, index) and the inputs alone."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {sorted(TASKS)}, got {task}")
    spec = TASKS[task]
    total = length - spec.max_new
    rng = random.Random(f"ruler:{seed}:{task}:{length}:{index}")
    if task.startswith("niah_single"):
        kind = _VALUE_TYPES[index % 3] if task == "niah_single" else task.rsplit("_", 1)[1] + "s"
        ids, outputs, info = _niah(enc, hay, words, rng, total, kind, 1, 1, 1)
    elif task == "niah_multikey":
        ids, outputs, info = _niah(enc, hay, words, rng, total, "numbers", 4, 1, 1)
    elif task == "niah_multivalue":
        ids, outputs, info = _niah(enc, hay, words, rng, total, "numbers", 1, 4, 1)
    elif task == "niah_multiquery":
        ids, outputs, info = _niah(enc, hay, words, rng, total, "numbers", 4, 1, 4)
    elif task == "vt":
        ids, outputs, info = _vt(enc, hay, rng, total)
    elif task == "cwe":
        ids, outputs, info = _cwe(enc, words, rng, total, length < 4096)
    elif task == "fwe":
        ids, outputs, info = _fwe(enc, rng, total)
    else:
        ids, outputs, info = _qa(enc, hay, rng, total)
    if len(ids) != total:
        raise AssertionError(f"{task}: {len(ids)} tokens, expected {total}")
    return Sample(task, length, index, ids, spec.max_new, outputs, info)
