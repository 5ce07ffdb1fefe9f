# SPDX-License-Identifier: Apache-2.0
"""Torch test helpers: float64 attention, the low-precision reference of docs/numerics.md and
FlashAttention's tolerance rule, on any device; the devices and dtypes to test."""

from __future__ import annotations

import math
import os

import pytest
import torch

import sparseprefill as sp

CUDA = torch.cuda.is_available()
# SP_TEST_DEVICES=cuda limits a GPU run to the CUDA backend (scripts/python_check.sh).
DEVICES = [d for d in os.environ.get("SP_TEST_DEVICES", "cpu,cuda").split(",") if d == "cpu" or (d == "cuda" and CUDA)]
# The CPU backend computes in fp32 for every input dtype; the kernels take bf16 and fp16.
DTYPES = {"cpu": [torch.float32, torch.bfloat16], "cuda": [torch.bfloat16, torch.float16]}
DEVICE_DTYPES = [(d, t) for d in DEVICES for t in DTYPES[d]]


def ids(params):
    return [f"{d}-{str(t).replace('torch.', '')}" for d, t in params]


def attention(q, k, v, causal, scale=None, mask=None, low_precision=False, window=(-1, -1), softcap=0.0,
              sinks=None, chunk=0):
    """q [b, s_q, h_q, d], k [b, s_k, h_kv, d], v [b, s_k, h_kv, d_v]; mask: optional bool
    [b, h_q, s_q, s_k]. window: FlashAttention's (left, right), -1 no bound (query i at
    a = i + s_k - s_q sees keys a - left .. a + right); chunk C > 0 (FlashAttention's
    attention_chunk): only keys of a's chunk, a - a mod C .. a - a mod C + C - 1; softcap c:
    scores c * tanh(s / c);
    sinks: [h_q] logits, one more term in every row's softmax denominator (docs/semantics.md
    §1). float64 by default; low_precision: fp32 scores, P rounded to q's dtype, fp32
    accumulation. Returns (out [b, s_q, h_q, d_v] in float64 or q's dtype, lse float64
    [b, h_q, s_q]); rows without keys 0 and -inf (with a sink: 0 and the sink's logit)."""
    s_q, s_k, d = q.shape[1], k.shape[1], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    g = q.shape[2] // k.shape[2]
    work = torch.float32 if low_precision else torch.float64
    qf, kf, vf = q.to(work), k.to(work).repeat_interleave(g, 2), v.to(work).repeat_interleave(g, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    a = torch.arange(s_q, device=q.device)[:, None] + (s_k - s_q)
    j = torch.arange(s_k, device=q.device)[None, :]
    allowed = (j <= a) if causal else torch.ones(s_q, s_k, dtype=torch.bool, device=q.device)
    if window[0] >= 0:
        allowed = allowed & (j >= a - window[0])
    if window[1] >= 0:
        allowed = allowed & (j <= a + window[1])
    if chunk:
        start = a - a % chunk  # torch's % of a negative a is non-negative, as FlashAttention's
        allowed = allowed & (j >= start) & (j < start + chunk)
    allowed = allowed.expand(s.shape)
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, -math.inf)
    m = s.amax(-1, keepdim=True)
    sink = None if sinks is None else sinks.to(work).reshape(1, -1, 1, 1).expand(m.shape)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m).masked_fill(~allowed, 0)
    l = p.sum(-1, keepdim=True)
    if low_precision:
        p = p.to(q.dtype).to(work)
    den = l if sink is None else l + torch.exp(sink - m)
    o = torch.einsum("bhqk,bkhd->bqhd", p, vf) / den.transpose(1, 2).clamp_min(torch.finfo(work).tiny)
    o = torch.where(den.transpose(1, 2) > 0, o, torch.zeros_like(o))
    lse = torch.where(den[..., 0] > 0, torch.log(den[..., 0].clamp_min(torch.finfo(work).tiny)) + m[..., 0],
                      torch.full_like(m[..., 0], -math.inf))
    return (o.to(q.dtype) if low_precision else o), lse.to(torch.float64)


def assert_calibrated(out, ref, pt, what="out"):
    """max|out - ref| <= 2 max|pt - ref| + 2 * rounding noise of out's dtype (FA's rule)."""
    ref64 = ref.to(torch.float64)
    assert torch.isfinite(out).all(), f"{what}: non-finite values"
    err = (out.to(torch.float64) - ref64).abs().max().item() if out.numel() else 0.0
    pt_err = (pt.to(torch.float64) - ref64).abs().max().item() if out.numel() else 0.0
    r = ref.to(out.dtype)
    atol = 2 * ((r + 0.3 - 0.3) - r).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * pt_err + atol, f"{what}: max error {err:.3e} > 2 x {pt_err:.3e} + {atol:.3e}"


def assert_lse(lse, ref_lse, tol=2e-3):
    lse = lse.to(torch.float64).cpu()
    ref_lse = ref_lse.cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf rows differ"
    finite = torch.isfinite(ref_lse)
    if finite.any():
        err = (lse[finite] - ref_lse[finite]).abs().max().item()
        assert err <= tol, f"lse: max error {err:.3e} > {tol}"


def skip_unless_runs(q, k, v, policy, causal=True, **layout):
    """Skips (with the library's list of what is compiled) when the backend of q's device
    does not run this combination: the test is then about a kernel that was not built."""
    ok, message = sp.can_run(q, k, v, policy, causal=causal, **layout)
    if not ok:
        pytest.skip(f"{q.device.type} backend: {message}")
