# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality.ruler: every task's prompt has exactly the asked number of tokens, is a
function of (seed, task, length, index), and holds what its expected answer says, derived here
again from the prompt's text alone (needles at their recorded offsets and depths, the variable
chain, the word counts, the section heading); RULER's scoring on hand cases; the confidence
intervals of sparseprefill.quality.metrics. A one-token-per-character tokenizer stands in for
the model's (CI has no transformers); where the Qwen2 tokenizer is in build/models/ the same
checks run on it and on the Debian Policy text."""

import collections
import os
import random
import re

import numpy as np
import pytest

from sparseprefill.quality import metrics, ruler

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


class CharTokenizer:
    """One token per character; batched calls like a transformers tokenizer."""

    class Out:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, s, add_special_tokens=False):
        if isinstance(s, list):
            return self.Out([[ord(c) for c in x] for x in s])
        return self.Out([ord(c) for c in s])

    def decode(self, ids):
        return "".join(map(chr, ids))


class ChatCharTokenizer(CharTokenizer):
    chat_template = "<user>{message}</user><assistant>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        return f"<s>system: be brief\n<user>{messages[0]['content']}</user>\n<assistant>"


def document(seed=0, sections=44):
    """A Sphinx-like text: a title, a table of contents, then numbered sections (heading,
    underline, paragraphs of sentences of made-up words)."""
    rng = random.Random(seed)
    lexicon = sorted({"".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(4, 9))) for _ in range(900)})
    heads = [f"{i // 4 + 1}.{i % 4 + 1}" for i in range(sections)]
    titles = [" ".join(rng.sample(lexicon, 3)).capitalize() for _ in heads]
    out = ["Title\n*****\n\n"] + [f"  * {h}. {t}\n\n" for h, t in zip(heads, titles)]
    for h, t in zip(heads, titles):
        line = f"{h}. {t}"
        out.append(f"{line}\n{'-' * len(line)}\n\n")
        for _ in range(4):
            sentences = [" ".join(rng.sample(lexicon, 8)).capitalize() + "." for _ in range(5)]
            words = " ".join(sentences).split(" ")
            lines, cur = [], ""
            for w in words:
                if len(cur) + len(w) > 60:
                    lines.append(cur)
                    cur = w
                else:
                    cur = f"{cur} {w}".strip()
            out.append("\n".join(lines + [cur]) + "\n\n")
    return "".join(out)


@pytest.fixture(scope="module")
def suite():
    text = document()
    enc = ruler.Encoder(CharTokenizer())
    return enc, ruler.Haystack.from_text("doc.txt", text, enc), ruler.vocabulary(text), text


def test_units_vocabulary_and_body(suite):
    enc, hay, words, text = suite
    assert "".join(hay.units) == text
    assert all(u.endswith("\n") for u in hay.units)
    assert hay.units[hay.body] == "1.1. " + hay.units[hay.body].split(". ", 1)[1]  # the first body heading
    assert not any(u.startswith("  * ") for u in hay.units[hay.body:])  # the table of contents is left out
    assert words == sorted(set(words)) and all(w.isalpha() and w.islower() and 4 <= len(w) <= 10 for w in words)
    assert len(hay.sections) > 10 and all(hay.units[s.unit] == f"{s.number}. {s.title}\n" for s in hay.sections)
    numbers = [s.number for s in hay.sections]
    # 1.1 is left out: it is a substring of 11.1, which RULER's match would take for it.
    assert "1.1" not in numbers and "11.1" in numbers and all(not any(a in b for b in numbers if b != a) for a in numbers)
    # take() wraps around to the body's start and stops at exactly n tokens.
    got = hay.take(len(hay.units) - 2, 500)
    assert sum(len(ids) for _, ids in got) == 500 and got[2][0] == hay.body


@pytest.mark.parametrize("task", sorted(ruler.TASKS))
def test_exact_length_and_determinism(suite, task):
    enc, hay, words, _ = suite
    # cwe's solved example and 300 common items take about 5000 characters.
    for length in (12000, 20000) if task == "cwe" else (3000, 7000):
        a = ruler.make_sample(task, length, 3, 11, enc, hay, words)
        assert len(a.ids) == length - ruler.TASKS[task].max_new
        b = ruler.make_sample(task, length, 3, 11, enc, hay, words)
        assert (a.ids, a.outputs, a.info) == (b.ids, b.outputs, b.info)
        c = ruler.make_sample(task, length, 4, 11, enc, hay, words)
        d = ruler.make_sample(task, length, 3, 12, enc, hay, words)
        assert c.ids != a.ids and d.ids != a.ids
        text = enc.decode(a.ids)
        assert all(o in text for o in a.outputs)  # every expected string is in the prompt


def _gap(hay):
    """The most tokens between two units after which a needle may go."""
    ends = [i for i in range(hay.body, len(hay.units)) if hay.ends[i]]
    return max(sum(len(x) for x in hay.ids[a + 1:b + 1]) for a, b in zip(ends, ends[1:]))


def _needles(text):
    return re.findall(r"One of the special magic (\w+) for ([\w-]+) is: ([\w-]+)\.", text)


@pytest.mark.parametrize("task,keys,values,asked", [("niah_single", 1, 1, 1), ("niah_multikey", 4, 1, 1),
                                                    ("niah_multivalue", 1, 4, 1), ("niah_multiquery", 4, 1, 4)])
def test_niah_needles_at_their_depths(suite, task, keys, values, asked):
    enc, hay, words, _ = suite
    for index in range(6):
        s = ruler.make_sample(task, 6000, index, 0, enc, hay, words)
        text = enc.decode(s.ids)
        found = _needles(text)
        assert len(found) == keys * values and len({k for _, k, _ in found}) == keys
        kind = found[0][0]
        if task == "niah_single":
            assert kind == ("numbers", "words", "uuids")[index % 3] == s.info["value_type"]
        pattern = {"numbers": r"\d{7}", "words": r"[a-z]+-[a-z]+", "uuids": r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-"
                   r"[89ab][0-9a-f]{3}-[0-9a-f]{12}"}[kind]
        assert all(re.fullmatch(pattern, v) for _, _, v in found)
        # The question names the asked keys; their values, read off the prompt, are the answer.
        question = text[text.rindex("What "):]
        q_keys = [k for _, k, _ in found if k in question]
        assert len(set(q_keys)) == asked
        assert sorted(s.outputs) == sorted(v for _, k, v in found if k in question)
        # Each needle sits at its recorded token offset, after a sentence end, near its depth.
        room = len(s.ids) - sum(n["tokens"] for n in s.info["needles"])
        for n in s.info["needles"]:
            piece = enc.decode(s.ids[n["offset"]:n["offset"] + n["tokens"]])
            assert piece == f"One of the special magic {kind} for {n['key']} is: {n['value']}.\n"
            before = enc.decode(s.ids[:n["offset"]])
            assert before.endswith((".\n", "\n\n"))  # a sentence's or a paragraph's end (or the instructions')
            assert abs(n["placed_depth"] - n["depth"]) <= _gap(hay) / room, (n, room)
        assert n["depth"] in ruler.DEPTHS
        singular = values * asked == 1  # RULER's wording: singular when one value is asked
        assert ("is hidden within" in text) == singular and text.endswith(
            "mentioned in the provided text " + ("is" if singular else "are"))


def test_niah_depths_cover_the_haystack(suite):
    enc, hay, words, _ = suite
    depths = [ruler.make_sample("niah_single_number", 5000, i, 0, enc, hay, words).info["needles"][0]["placed_depth"]
              for i in range(40)]
    assert min(depths) < 0.1 and max(depths) > 0.9


def test_vt_chain_follows_from_the_prompt(suite):
    enc, hay, words, _ = suite
    for index in range(5):
        s = ruler.make_sample("vt", 6000, index, 0, enc, hay, words)
        text = enc.decode(s.ids)
        main = text[text.rindex("Memorize and track"):]  # after the solved example
        value = s.info["value"]
        assert main.count(value) == 3  # the first assignment, the question, the answer prefix
        holders = set(re.findall(rf"VAR ([A-Z]{{5}}) = {value}\.", main))
        links = re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", main)
        grew = True
        while grew:
            new = {a for a, b in links if b in holders} - holders
            holders |= new
            grew = bool(new)
        assert holders == set(s.outputs) and len(holders) == 5
        # In the text's order, each line follows the one it reads.
        order = [main.index(f"VAR {n} =") for n in s.outputs]
        assert order == sorted(order)
        for c in s.info["chain"]:
            assert enc.decode(s.ids[c["offset"]:c["offset"] + c["tokens"]]) == c["line"] + "\n"
        assert not set(s.info["example_names"]) & holders
        assert text.endswith(f"{len(s.outputs)} variables are assigned the value {value}, they are:")


def test_cwe_answer_is_the_ten_most_common(suite):
    enc, hay, words, _ = suite
    for length in (12000, 20000):
        s = ruler.make_sample("cwe", length, 1, 0, enc, hay, words)
        text = enc.decode(s.ids)
        main = text[text.rindex("Below is a numbered list"):text.rindex("\nQuestion:")]
        counts = collections.Counter(re.findall(r"\d+\. ([a-z]+)\b", main))
        top = counts.most_common()
        assert {w for w, _ in top[:10]} == set(s.outputs)
        assert top[9][1] >= 29 and top[10][1] <= 3  # 30 each (a cut-off item may take one), the others 3 or 1
        numbers = [int(n) for n in re.findall(r"(\d+)\. [a-z]", main)]
        assert numbers == list(range(1, len(numbers) + 1))
        example = text[:text.rindex("Below is a numbered list")]
        assert example.count("Question: What are the 10 most common words") == 1
        assert not set(s.info["example"]) & set(s.outputs)


def test_cwe_short_length_as_ruler(suite):
    enc, hay, words, _ = suite
    s = ruler.make_sample("cwe", 3500, 0, 0, enc, hay, words)  # below 4096: 6 and 1 times, a smaller example
    text = enc.decode(s.ids)
    main = text[text.rindex("Below is a numbered list"):text.rindex("\nQuestion:")]
    top = collections.Counter(re.findall(r"\d+\. ([a-z]+)\b", main)).most_common()
    assert {w for w, _ in top[:10]} == set(s.outputs) and top[9][1] >= 5 and top[10][1] == 1
    example = text[:text.rindex("Below is a numbered list")]
    assert len(re.findall(r"\d+\. [a-z]+", example)) == 10 * 3 + 10 * 1 + 10  # the list, then its answer


def test_fwe_answer_is_the_three_most_frequent(suite):
    enc, hay, words, _ = suite
    for length in (4000, 9000):
        s = ruler.make_sample("fwe", length, 2, 0, enc, hay, words)
        text = enc.decode(s.ids)
        body = text[text.index("coded words.") + len("coded words."):text.rindex("\nQuestion:")]
        tokens = body.split()
        counts = collections.Counter(t for t in tokens[:-1] if t != "...")  # the last one may be cut off
        top = counts.most_common(4)
        assert [w for w, _ in top[:3]] == s.outputs and top[2][1] > top[3][1]
        assert collections.Counter(tokens)["..."] > top[0][1]  # the noise word is the most frequent
        assert all(len(t) == 6 for t in tokens[:-1] if t != "...")


def test_qa_heading_in_the_context(suite):
    enc, hay, words, _ = suite
    for index in range(6):
        s = ruler.make_sample("qa", 5000, index, 0, enc, hay, words)
        text = enc.decode(s.ids)
        title = re.search(r'titled "([^"]+)"\?', text).group(1)
        heading = f"\n{s.outputs[0]}. {title}\n"
        context = text[:text.rindex("Answer the question")]
        assert context.count(heading) == 1 and s.info["title"] == title
        assert enc.decode(s.ids[s.info["offset"]:]).startswith(heading[1:])
        assert abs(s.info["placed_depth"] - s.info["depth"]) < 0.1 or s.info["placed_depth"] < s.info["depth"]


def test_chat_frame_wraps_the_message(suite):
    _, _, words, text = suite
    enc = ruler.Encoder(ChatCharTokenizer())
    hay = ruler.Haystack.from_text("doc.txt", text, enc)
    s = ruler.make_sample("niah_single", 3000, 0, 0, enc, hay, words)
    out = enc.decode(s.ids)
    assert len(s.ids) == 3000 - ruler.TASKS["niah_single"].max_new
    assert out.startswith("<s>system: be brief\n<user>A special magic")
    assert "mentioned in the provided text?</user>\n<assistant>The special magic" in out
    assert enc.frame == ruler.ChatFrame(enc("<s>system: be brief\n<user>"), enc("</user>\n<assistant>"))


def test_too_short_and_unknown():
    enc = ruler.Encoder(CharTokenizer())
    text = document()
    hay = ruler.Haystack.from_text("d", text, enc)
    with pytest.raises(ValueError, match="no room for the context"):
        ruler.make_sample("niah_multiquery", 300, 0, 0, enc, hay, ruler.vocabulary(text))
    with pytest.raises(ValueError, match="task: expected one of"):
        ruler.make_sample("niah", 3000, 0, 0, enc, hay, [])
    with pytest.raises(ValueError, match="too small"):
        ruler.make_sample("cwe", 60000, 0, 0, enc, hay, ruler.vocabulary(text)[:100])


def test_scoring_as_ruler():
    assert ruler.postprocess("  1234567\x00and\tmore \n") == "1234567\nand\nmore"
    assert ruler.string_match_all("The numbers are 111 and 222.", ["111", "222", "333"]) == pytest.approx(2 / 3)
    assert ruler.string_match_all("APPLE pear", ["apple", "Pear"]) == 1.0
    assert ruler.string_match_part("It is 5.6.12.", ["5.6.12", "x"]) == 1.0
    assert ruler.string_match_part("It is 5.6.1.", ["5.6.12"]) == 0.0
    assert ruler.score("cwe", " 1. a 2. b", ["a", "b", "c", "d"]) == 0.5
    assert ruler.score("qa", "no idea", ["4.4", "x"]) == 0.0 and ruler.score("qa", "x", ["4.4", "x"]) == 1.0


def test_wilson_interval():
    lo, hi = metrics.wilson_interval(40, 40)
    assert (round(lo, 4), hi) == (0.9124, 1.0)
    lo, hi = metrics.wilson_interval(20, 40)
    assert lo == pytest.approx(1 - hi) and lo == pytest.approx(0.3520, abs=1e-4)
    assert metrics.wilson_interval(0, 10)[0] == 0.0
    with pytest.raises(ValueError):
        metrics.wilson_interval(1, 0)


def test_task_average_bootstrap():
    rng = np.random.default_rng(0)
    a = {t: (rng.random(40) < p).astype(float) for t, p in (("x", 0.9), ("y", 0.5))}
    est, lo, hi = metrics.task_average_ci(a)
    assert est == pytest.approx((a["x"].mean() + a["y"].mean()) / 2) and lo < est < hi
    assert metrics.task_average_ci(a) == (est, lo, hi)  # seeded
    # The interval's width is that of the average of two independent proportions.
    se = np.sqrt(sum(v.mean() * (1 - v.mean()) / v.size for v in a.values())) / 2
    assert hi - lo == pytest.approx(2 * 1.96 * se, rel=0.15)
    # Paired: identical settings differ by exactly 0; one flipped sample moves the mean by 1/80.
    assert metrics.task_average_ci(a, a) == (0.0, 0.0, 0.0)
    b = {t: v.copy() for t, v in a.items()}
    b["y"][np.argmax(b["y"] == 0)] = 1.0
    est, lo, hi = metrics.task_average_ci(b, a)
    # The flipped sample drawn 0 to 3 times (Poisson(1)'s 2.5% and 97.5% quantiles) out of 40, over two tasks.
    assert est == pytest.approx(1 / 80) and lo == 0.0 and hi == pytest.approx(3 / 80)
    with pytest.raises(ValueError, match="baseline"):
        metrics.task_average_ci(a, {"x": a["x"], "y": a["y"][:3]})


QWEN = os.path.join(ROOT, "build", "models", "qwen-bf16")
POLICY = os.path.join(ROOT, "build", "models", "text", "policy.txt")


@pytest.mark.skipif(not (os.path.isdir(QWEN) and os.path.isfile(POLICY)),
                    reason="the Qwen2.5 checkpoint or the Policy text is not in build/models/ "
                           "(scripts/model/fetch_qwen.sh, python -m sparseprefill.quality.convert)")
def test_qwen_tokenizer_prompts():
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(QWEN)
    enc = ruler.Encoder(tok)
    text = open(POLICY, encoding="utf-8").read()
    hay = ruler.Haystack.from_text("policy.txt", text, enc)
    # Units concatenated are the whole text's own tokenization.
    assert [t for ids in hay.ids for t in ids] == tok(text, add_special_tokens=False).input_ids
    assert hay.units[hay.body] == "1.1. Scope\n" and len(hay.sections) > 50  # after the table of contents
    words = ruler.vocabulary(text)
    for task in ruler.DEFAULT_TASKS:
        s = ruler.make_sample(task, 8192, 0, 0, enc, hay, words)
        assert len(s.ids) == 8192 - s.max_new
        out = tok.decode(s.ids)
        assert out.startswith("<|im_start|>system\n") and "<|im_end|>\n<|im_start|>assistant\n" in out
        assert all(o in out for o in s.outputs)
