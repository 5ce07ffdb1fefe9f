# SPDX-License-Identifier: Apache-2.0
"""Test helpers: float64 NumPy attention (the oracle the Python tests compare against), the
low-precision reference of docs/numerics.md (inputs in the low dtype, fp32 accumulation, P
rounded to the input dtype) with FlashAttention's tolerance rule, seeded inputs, and block
geometry for building masks."""

from __future__ import annotations

import math
from typing import Optional, Tuple

import numpy as np


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def randn(g: np.random.Generator, shape, dtype=np.float32) -> np.ndarray:
    return g.standard_normal(shape).astype(dtype)


def allowed_mask(s_q: int, s_k: int, causal: bool) -> np.ndarray:
    """bool [s_q, s_k]: bottom-right aligned causal (query i sees keys j <= i + s_k - s_q)."""
    if not causal:
        return np.ones((s_q, s_k), dtype=bool)
    i = np.arange(s_q)[:, None]
    j = np.arange(s_k)[None, :]
    return j <= i + (s_k - s_q)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: Optional[float] = None,
              mask: Optional[np.ndarray] = None, dtype=np.float64, round_p=None) -> Tuple[np.ndarray, np.ndarray]:
    """Batched attention q [b, s_q, h_q, d], k/v [b, s_k, h_kv, d] in `dtype` arithmetic, with an
    optional extra bool mask [b, h_q, s_q, s_k]. round_p rounds P (the low-precision reference).
    Returns (out [b, s_q, h_q, d] float64, lse [b, h_q, s_q] float64); empty rows: 0 and -inf."""
    b, s_q, h_q, d = q.shape
    s_k, h_kv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = h_q // h_kv
    qf, kf, vf = (x.astype(dtype) for x in (q, k, v))
    kf, vf = np.repeat(kf, g, axis=2), np.repeat(vf, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", qf, kf) * dtype(scale)
    allowed = np.broadcast_to(allowed_mask(s_q, s_k, causal), s.shape)
    if mask is not None:
        allowed = allowed & mask
    s = np.where(allowed, s, -np.inf)
    m = s.max(axis=-1, keepdims=True) if s_k else np.full(s.shape[:-1] + (1,), -np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.where(allowed, np.exp(s - m_safe), 0).astype(dtype)
    l = p.sum(axis=-1, keepdims=True)
    if round_p is not None:
        p = p.astype(round_p).astype(dtype)
    o = np.einsum("bhqk,bkhd->bqhd", p, vf)
    l_q = np.transpose(l, (0, 2, 1, 3))  # [b, s_q, h, 1]
    out = np.where(l_q > 0, o / np.where(l_q > 0, l_q, 1), 0)
    lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1)) + m_safe[..., 0], -np.inf)
    return out.astype(np.float64), lse.astype(np.float64)


def low_precision(q, k, v, causal, scale=None, mask=None) -> np.ndarray:
    """docs/numerics.md's low-precision reference, output cast to q's dtype."""
    out, _ = attention(q, k, v, causal, scale, mask, dtype=np.float32, round_p=q.dtype)
    return out.astype(q.dtype)


def fwd_atol(ref: np.ndarray, dtype) -> float:
    """FlashAttention's rounding allowance: twice the noise of one add/subtract in `dtype`."""
    r = ref.astype(dtype)
    return float(2 * np.abs((r + dtype(0.3)) - dtype(0.3) - r).max()) if r.size else 0.0


def assert_close_calibrated(out, ref, pt, dtype, what="out") -> None:
    """max|out - ref| <= 2 max|pt - ref| + fwd_atol (FA's rule; NaN never passes)."""
    out = np.asarray(out, dtype=np.float64)
    err = np.abs(out - ref).max() if out.size else 0.0
    pt_err = np.abs(pt.astype(np.float64) - ref).max() if out.size else 0.0
    bound = 2 * pt_err + fwd_atol(ref, dtype)
    assert np.isfinite(out).all(), f"{what}: non-finite values"
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e} (2 x {pt_err:.3e} + atol)"


def assert_lse_close(lse, ref_lse, tol=1e-4) -> None:
    lse = np.asarray(lse, dtype=np.float64)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = np.isfinite(ref_lse)
    if finite.any():
        err = np.abs(lse[finite] - ref_lse[finite]).max()
        assert err <= tol, f"lse: max error {err:.3e} > {tol}"


def visible_blocks(s_q: int, s_k: int, causal: bool, block_q: int, block_k: int) -> np.ndarray:
    """bool [num_q_blocks, num_k_blocks]: blocks where some query sees some key."""
    nqb, nkb = math.ceil(s_q / block_q), math.ceil(s_k / block_k)
    allowed = allowed_mask(s_q, s_k, causal)
    vis = np.zeros((nqb, nkb), dtype=bool)
    for qb in range(nqb):
        for kb in range(nkb):
            vis[qb, kb] = allowed[qb * block_q:(qb + 1) * block_q, kb * block_k:(kb + 1) * block_k].any()
    return vis


def expand_blocks(block_map: np.ndarray, s_q: int, s_k: int, block_q: int, block_k: int) -> np.ndarray:
    """[..., num_q_blocks, num_k_blocks] -> element mask [..., s_q, s_k]."""
    rows = np.repeat(block_map, block_q, axis=-2)[..., :s_q, :]
    return np.repeat(rows, block_k, axis=-1)[..., :s_k]
