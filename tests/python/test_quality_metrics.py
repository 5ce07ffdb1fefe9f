# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality.metrics.token_sums against direct computations on random logits:
negative log-likelihood, KL(dense || policy), top-1 agreement; chunking changes nothing."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sparseprefill.quality import metrics  # noqa: E402


def test_token_sums_match_direct_formulas():
    g = torch.Generator().manual_seed(5)
    s, vocab = 37, 50
    dense_logits = torch.randn(s, vocab, generator=g) * 3
    logits = dense_logits + 0.5 * torch.randn(s, vocab, generator=g)
    targets = torch.randint(0, vocab, (s,), generator=g)
    dense_lp = torch.log_softmax(dense_logits.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    nll = -lp[torch.arange(s), targets].mean().item()
    kl = (dense_lp.exp() * (dense_lp - lp)).sum(-1).mean().item()
    agree = (lp.argmax(-1) == dense_lp.argmax(-1)).double().mean().item()
    for chunk in (1, 8, 1024):
        r = metrics.token_sums(logits, targets, dense_lp.float(), chunk=chunk).summary()
        assert r["tokens"] == s
        assert r["nll"] == pytest.approx(nll, rel=1e-5)
        assert r["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
        assert r["kl"] == pytest.approx(kl, rel=1e-4)
        assert r["top1_agreement"] == pytest.approx(agree)
    assert 0 < agree < 1 and kl > 0  # the case distinguishes the quantities


def test_token_sums_against_itself_and_merging():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(20, 30, generator=g)
    targets = torch.randint(0, 30, (20,), generator=g)
    lp = torch.log_softmax(logits, -1)
    r = metrics.token_sums(logits, targets, lp)
    assert abs(r.kl) < 1e-5 and r.agree == 20
    a = metrics.token_sums(logits[:7], targets[:7], lp[:7])
    a.add(metrics.token_sums(logits[7:], targets[7:], lp[7:]))
    assert a.count == 20 and a.nll == pytest.approx(r.nll, rel=1e-6) and a.correct == r.correct
