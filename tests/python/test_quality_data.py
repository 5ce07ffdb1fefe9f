# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality: the calibration / held-out text split never overlaps, token windows
are disjoint, passkey prompts have the exact length with the needle at the asked depth, and
metric helpers (relative error, matched-density interpolation) compute what they say."""

import numpy as np
import pytest

from sparseprefill.quality import data, metrics


def test_split_at_paragraph_break_and_disjoint(tmp_path):
    text = "".join(f"paragraph {i} " + "word " * (i % 7 + 3) + "\n\n" for i in range(200))
    path = tmp_path / "doc.txt"
    path.write_text(text, encoding="utf-8")
    s = data.read_split(str(path), 0.4)
    assert s.calibration + s.evaluation == text
    assert s.boundary >= int(0.4 * len(text))
    assert s.calibration.endswith("\n\n") and s.evaluation.startswith("paragraph ")
    # The cut is at the first break after the fraction: no earlier break lies past it.
    assert text.find("\n\n", int(0.4 * len(text))) + 2 == s.boundary
    d = s.describe()
    assert d["calibration_chars"] == [0, s.boundary] and d["evaluation_chars"] == [s.boundary, len(text)]


def test_split_without_break_and_bad_fraction():
    assert data.split_text("no break at all", 0.5) == len("no break at all")
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="fraction"):
            data.split_text("a\n\nb", bad)


def test_windows_disjoint_and_too_short():
    tokens = list(range(1000))
    w = data.windows(tokens, 128, 3, start=100)
    assert [off for off, _ in w] == [100, 228, 356]
    assert w[1][1] == list(range(228, 356))
    with pytest.raises(ValueError, match="need 1100 tokens"):
        data.windows(tokens, 500, 2, start=100)


class CharTokenizer:
    """One token per character (ord), enough to check prompt assembly."""

    class Out:
        def __init__(self, ids):
            self.input_ids = ids

    def __call__(self, s, add_special_tokens=False):
        return self.Out([ord(c) for c in s])


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 1.0])
def test_passkey_prompt(depth):
    tok = CharTokenizer()
    filler = [ord("~")] * 5000
    p = data.passkey_prompt(tok, filler, 1000, depth, "12345")
    assert len(p.ids) == 1000
    text = "".join(map(chr, p.ids))
    assert text.endswith("The pass key is 12345") and p.answer == [ord(c) for c in " 12345"]
    needle = text.index("\n\nThe pass key is 12345. Remember it.")
    assert needle == p.needle_at
    head = text.index("memorize it.\n\n") + len("memorize it.\n\n")  # the filler starts here
    n_filler = text.count("~")
    assert abs((needle - head) - depth * n_filler) <= 1
    with pytest.raises(ValueError, match="filler"):
        data.passkey_prompt(tok, filler[:10], 1000, depth, "12345")


def test_passkeys_distinct_and_seeded():
    keys = data.passkeys(3, 50)
    assert len(set(keys)) == 50 and all(len(k) == 5 and k.isdigit() for k in keys)
    assert keys == data.passkeys(3, 50) and keys != data.passkeys(4, 50)


def test_relative_error():
    rng = np.random.default_rng(1)
    ref = rng.standard_normal((7, 3, 5)).astype(np.float32)
    assert metrics.relative_error(ref, ref) == 0.0
    noise = rng.standard_normal(ref.shape)
    expect = np.linalg.norm(noise) / np.linalg.norm(ref.astype(np.float64))
    assert metrics.relative_error(ref + noise, ref) == pytest.approx(expect, rel=1e-6)


def test_interpolate_at_log_linear_and_no_extrapolation():
    d, v = [0.2, 0.6, 0.4], [1e-1, 1e-3, 1e-2]
    assert metrics.interpolate_at(d, v, 0.4) == pytest.approx(1e-2)
    assert metrics.interpolate_at(d, v, 0.3) == pytest.approx(10 ** -1.5)
    assert metrics.interpolate_at(d, v, 0.1) is None and metrics.interpolate_at(d, v, 0.7) is None
    assert metrics.interpolate_at([0.5], [0.2], 0.5) == 0.2
