# SPDX-License-Identifier: Apache-2.0
"""Measures of one policy against dense: next-token metrics of a window's logits (negative
log-likelihood, KL(dense || policy), top-1 agreement), the operator-level relative error of an
attention output, densities per layer and head from a stats log, the density at which a
measured error curve crosses a level (for comparisons at matched density), and 95% confidence
intervals of task scores (Wilson's score interval for one task; a stratified percentile
bootstrap over samples for the average over tasks and for paired differences between
settings)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["TokenSums", "token_sums", "hidden_sums", "relative_error", "layer_densities", "total_density",
           "interpolate_at", "curves", "wilson_interval", "task_average_ci"]


class TokenSums:
    """Sums over predicted positions; add() merges windows. nll: -log p(target); kl:
    KL(dense || policy) in nats; agree: argmax(policy) == argmax(dense); correct: argmax == target."""

    def __init__(self) -> None:
        self.count = 0
        self.nll = 0.0
        self.kl = 0.0
        self.agree = 0
        self.correct = 0

    def add(self, other: "TokenSums") -> None:
        self.count += other.count
        self.nll += other.nll
        self.kl += other.kl
        self.agree += other.agree
        self.correct += other.correct

    def summary(self) -> Dict[str, float]:
        n = max(self.count, 1)
        return {"tokens": self.count, "nll": self.nll / n, "ppl": float(np.exp(self.nll / n)),
                "kl": self.kl / n, "top1_agreement": self.agree / n, "top1_accuracy": self.correct / n}


def token_sums(logits: Any, targets: Any, dense_logprobs: Optional[Any] = None, chunk: int = 1024) -> TokenSums:
    """logits [s, V] (any float dtype; computed in fp32) predicting targets [s]; dense_logprobs
    [s, V] fp32 log-softmax of dense's logits for the same positions (None: no KL/agreement,
    dense itself). Chunked over positions to bound memory."""
    import torch

    out = TokenSums()
    for i in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[i:i + chunk].float(), dim=-1)
        t = targets[i:i + chunk]
        out.count += int(t.shape[0])
        out.nll -= float(lp.gather(1, t[:, None]).sum())
        top = lp.argmax(dim=-1)
        out.correct += int((top == t).sum())
        if dense_logprobs is None:
            out.agree += int(t.shape[0])
            continue
        d = dense_logprobs[i:i + chunk]
        # KL(p_d || p) = sum p_d (log p_d - log p); terms with p_d = 0 contribute 0 (exp(-inf) * finite).
        out.kl += float((d.exp() * (d - lp)).sum())
        out.agree += int((top == d.argmax(dim=-1)).sum())
    return out


def hidden_sums(lm_head: Any, hidden: Any, targets: Any, dense_hidden: Optional[Any] = None,
                chunk: int = 4096) -> TokenSums:
    """token_sums of the logits lm_head(hidden) [s, V] against dense's lm_head(dense_hidden),
    both computed `chunk` positions at a time: a window's dense reference is kept as its final
    hidden states [s, hidden] rather than its log-probabilities [s, V] (a 32K-token window of a
    150K-token vocabulary would hold 20 GB of them)."""
    import torch

    out = TokenSums()
    for i in range(0, hidden.shape[0], chunk):
        logits = lm_head(hidden[i:i + chunk])
        ref = None
        if dense_hidden is not None:
            ref = torch.log_softmax(lm_head(dense_hidden[i:i + chunk]).float(), dim=-1)
        out.add(token_sums(logits, targets[i:i + chunk], ref, chunk))
    return out


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref||_F / ||ref||_F in float64."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def layer_densities(log: Any) -> Dict[int, Dict[str, Any]]:
    """{layer: {"density": kept/visible blocks, "pair_density": computed/visible pairs,
    "head_pair_density": [h_q]}} summed over the layer's calls in a StatsLog."""
    out: Dict[int, Dict[str, Any]] = {}
    for layer in log.layers():
        heads = np.sum([c.heads.sum(axis=0) for c in log.calls if c.layer == layer], axis=0)  # [h_q, 5]
        vis_b, kept_b, _, vis_p, comp_p = (heads[:, i].astype(np.float64) for i in range(5))
        out[int(layer) if layer is not None else -1] = {
            "density": float(kept_b.sum() / max(vis_b.sum(), 1)),
            "pair_density": float(comp_p.sum() / max(vis_p.sum(), 1)),
            "head_pair_density": [float(x) for x in comp_p / np.maximum(vis_p, 1)],
        }
    return out


def total_density(log: Any) -> Tuple[float, float]:
    """(block density, pair density) over every call of the log."""
    heads = np.sum([c.heads.sum(axis=(0, 1)) for c in log.calls], axis=0)
    return float(heads[1] / max(heads[0], 1)), float(heads[4] / max(heads[3], 1))


def interpolate_at(densities: Sequence[float], values: Sequence[float], at: float) -> Optional[float]:
    """A measured curve value(density) read at density `at`: linear interpolation of
    log(value) between the two nearest measured densities on either side; None when `at` lies
    outside the measured range (no extrapolation)."""
    pts = sorted((float(d), float(v)) for d, v in zip(densities, values) if np.isfinite(v) and v > 0)
    for (d0, v0), (d1, v1) in zip(pts, pts[1:]):
        if d0 <= at <= d1:
            if d1 == d0:
                return min(v0, v1)
            w = (at - d0) / (d1 - d0)
            return float(np.exp((1 - w) * np.log(v0) + w * np.log(v1)))
    if len(pts) == 1 and pts[0][0] == at:
        return pts[0][1]
    return None


def curves(points: List[Dict[str, Any]], key: str, value: str) -> Dict[str, Tuple[List[float], List[float]]]:
    """{policy: (densities, values)} of the records in `points`, grouped by record['policy']."""
    out: Dict[str, Tuple[List[float], List[float]]] = {}
    for p in points:
        ds, vs = out.setdefault(p["policy"], ([], []))
        ds.append(p[key])
        vs.append(p[value])
    return out


Z95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> Tuple[float, float]:
    """Wilson's score interval (95% by default) of a proportion successes / n. For the mean of
    scores in [0, 1] that are not all 0 or 1 (RULER's string_match_all), pass their sum: the
    variance of such scores is at most p(1 - p), so the interval is conservative there."""
    if n <= 0:
        raise ValueError(f"n: expected a positive sample count, got {n}")
    p = successes / n
    den = 1.0 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return float(max(0.0, mid - half)), float(min(1.0, mid + half))


def task_average_ci(scores: Dict[str, Sequence[float]], baseline: Optional[Dict[str, Sequence[float]]] = None,
                    resamples: int = 10000, seed: int = 0, level: float = 0.95) -> Tuple[float, float, float]:
    """(estimate, low, high) of the mean over tasks of each task's mean score (RULER's average)
    or, with `baseline` (the same tasks' scores of another setting on the same samples, in the
    same order), of the paired difference mean(scores) - mean(baseline): a stratified
    percentile bootstrap, each task's samples resampled with replacement (the same indices for
    both settings), `resamples` times from a seeded generator."""
    if not scores:
        raise ValueError("scores: no task")
    rng = np.random.default_rng(seed)
    total = np.zeros(resamples)
    estimate = 0.0
    for task, xs in scores.items():
        x = np.asarray(xs, dtype=np.float64)
        if baseline is not None:
            b = np.asarray(baseline[task], dtype=np.float64)
            if b.shape != x.shape:
                raise ValueError(f"{task}: {x.size} samples against a baseline of {b.size}")
            x = x - b
        if x.size == 0:
            raise ValueError(f"{task}: no sample")
        estimate += float(x.mean())
        idx = rng.integers(0, x.size, size=(resamples, x.size))
        total += x[idx].mean(axis=1)
    k = len(scores)
    lo, hi = np.quantile(total / k, [(1 - level) / 2, (1 + level) / 2])
    return estimate / k, float(lo), float(hi)
