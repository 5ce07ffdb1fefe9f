# SPDX-License-Identifier: Apache-2.0
"""The PyTorch layer on every available device (CPU backend always, CUDA backend on a GPU):
FlashAttention-compatible functions in every layout against float64, every policy against
the fp64 oracle with identical work statistics, the ops under torch.compile and CUDA graph
replay, statistics collection, and every bad-input path."""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparseprefill as sp  # noqa: E402
from sparseprefill.flash_attn_interface import (  # noqa: E402
    flash_attn_combine, flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
from _torch_refs import (CUDA, DEVICE_DTYPES, DEVICES, assert_calibrated, assert_lse, attention, ids,  # noqa: E402
                         skip_unless_runs)


def randn(gen, shape, dtype, device):
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)


def qkv(seed, b, s_q, s_k, h_q, h_kv, d, dtype, device):
    gen = torch.Generator().manual_seed(seed)
    return (randn(gen, (b, s_q, h_q, d), dtype, device), randn(gen, (b, s_k, h_kv, d), dtype, device),
            randn(gen, (b, s_k, h_kv, d), dtype, device))


def structured(seed, b, s_q, s_k, h_q, h_kv, d, dtype, device, block):
    """Banded inputs, far from every decision boundary: queries share a direction u (per KV
    head); even key blocks align with it and odd ones oppose it, so that scale*q.k is about
    +3 on even and -3 on odd blocks plus N(0, 1) noise. Every policy then keeps the even
    blocks and can drop the odd ones with a wide margin."""
    q, k, v = qkv(seed, b, s_q, s_k, h_q, h_kv, d, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed + 1)
    u = torch.nn.functional.normalize(torch.randn((h_kv, d), generator=gen), dim=-1)
    scale = 1.0 / math.sqrt(d)
    q = q + 4.0 * u.repeat_interleave(h_q // h_kv, 0)
    sign = 1.0 - 2.0 * ((torch.arange(s_k) // block) % 2).float()  # +1 even blocks, -1 odd
    k = k + (3.0 / (4.0 * scale)) * sign[None, :, None, None] * u
    return q.to(dtype).to(device), k.to(dtype).to(device), v.to(dtype).to(device)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (17, 15), (113, 203), (128, 128), (239, 1)])
@pytest.mark.parametrize("h_q,h_kv", [(6, 6), (6, 2), (6, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_dense(device, dtype, s_q, s_k, h_q, h_kv, causal):
    q, k, v = qkv(s_q + s_k, 2, s_q, s_k, h_q, h_kv, 64, dtype, device)
    out, lse = flash_attn_func(q, k, v, causal=causal, return_softmax_lse=True)
    ref, ref_lse = attention(q, k, v, causal)
    assert_calibrated(out, ref, attention(q, k, v, causal, low_precision=True)[0])
    assert_lse(lse, ref_lse)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, h_q, s_q)
    # out= is written in full (poisoned first) and returned.
    buf = torch.full_like(q, math.nan)
    same, lse2, s_dmask = flash_attn_func(q, k, v, causal=causal, out=buf, return_attn_probs=True)
    assert same is buf and s_dmask is None
    assert torch.equal(buf, out) and torch.equal(lse2, lse)


@pytest.mark.parametrize("device", DEVICES)
def test_window_minus_one_zero_is_causal_and_scale_is_used(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = qkv(3, 1, 40, 64, 4, 2, 64, dtype, device)
    a = flash_attn_func(q, k, v, window_size=(-1, 0), softmax_scale=0.05)
    b = flash_attn_func(q, k, v, causal=True, softmax_scale=0.05)
    assert torch.equal(a, b)
    assert_calibrated(b, attention(q, k, v, True, scale=0.05)[0], attention(q, k, v, True, 0.05, low_precision=True)[0])


# The model-family features (docs/semantics.md §1) on the CPU backend against float64, in every
# FlashAttention layout; the CUDA backend runs local windows, softcap and sinks (dense and
# block_sparse: test_model_family_features_on_cuda) and refuses the others by name (bad_cases).
# Each case names its
# keyword arguments of flash_attn_func plus the head dims d (q, k) and d_v (v).
FEATURE_CASES = {
    "sliding window 8": dict(causal=True, window_size=(7, 0)),
    "causal window, right bound": dict(causal=True, window_size=(12, 4)),
    "non-causal window": dict(causal=False, window_size=(20, 5)),
    "non-causal right bound only": dict(causal=False, window_size=(-1, 3)),
    "window beyond the sequence": dict(causal=True, window_size=(500, 500)),
    "softcap": dict(causal=True, softcap=1.5),
    "sinks, window 16 (gpt-oss)": dict(causal=True, window_size=(15, 0), sinks=[0.5, -math.inf, 2.0, -1.0]),
    "head_dim 96": dict(causal=True, d=96),
    "head_dim 256, softcap": dict(causal=True, d=256, softcap=5.0),
    "q/k 192, v 128, sinks": dict(causal=False, d=192, d_v=128, sinks=[1.0, 0.0, -2.0, 3.0]),
    "chunks of 16 (Llama 4)": dict(causal=True, attention_chunk=16),
    "chunks of 24, window 10": dict(causal=True, attention_chunk=24, window_size=(9, 0)),
    "non-causal chunks of 20": dict(causal=False, attention_chunk=20),
}
HOST_DTYPES = [t for d, t in DEVICE_DTYPES if d == "cpu"]


def feature_call(case, dtype, s_q, s_k, b=2, seed=60):
    """(q, k, v, flash_attn keyword arguments, reference keyword arguments) of a FEATURE_CASES case."""
    args = dict(FEATURE_CASES[case])
    d, d_v = args.pop("d", 64), args.pop("d_v", None)
    q, k, v = qkv(seed, b, s_q, s_k, 4, 2, d, dtype, "cpu")
    if d_v is not None:
        v = randn(torch.Generator().manual_seed(seed + 1), (b, s_k, 2, d_v), dtype, "cpu")
    if "sinks" in args:
        args["sinks"] = torch.tensor(args["sinks"], dtype=torch.float32)
    ref = dict(causal=args["causal"], window=args.get("window_size", (-1, -1)), softcap=args.get("softcap", 0.0),
               sinks=args.get("sinks"), chunk=args.get("attention_chunk", 0))
    return q, k, v, args, ref


@pytest.mark.skipif("cpu" not in DEVICES, reason="the CPU backend runs the model-family features")
@pytest.mark.parametrize("dtype", HOST_DTYPES, ids=[str(t).replace("torch.", "") for t in HOST_DTYPES])
@pytest.mark.parametrize("case", list(FEATURE_CASES))
@pytest.mark.parametrize("s_q,s_k", [(37, 53), (53, 37)])
def test_model_family_features_match_float64(dtype, case, s_q, s_k):
    q, k, v, args, ref = feature_call(case, dtype, s_q, s_k)
    want, want_lse = attention(q, k, v, **ref)
    plain = attention(q, k, v, ref["causal"])[0]
    if case == "window beyond the sequence":
        assert torch.equal(want, plain)  # a window that hides nothing is none
    elif ref["window"] != (-1, -1) or ref["softcap"] or ref["sinks"] is not None or ref["chunk"]:
        assert not torch.allclose(want, plain, atol=1e-3), "the feature changes nothing on these inputs"
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **args)
    assert out.shape == q.shape[:-1] + v.shape[-1:] and out.dtype == dtype
    assert_calibrated(out, want, attention(q, k, v, low_precision=True, **ref)[0])
    assert_lse(lse, want_lse)
    # Varlen (sequences of other lengths each against float64) and the paged cache call.
    lens_q, lens_k = [s_q, s_q // 2], [s_k, s_k - 9]
    out_v, lse_v = flash_attn_varlen_func(pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q, "cpu"),
                                          cu(lens_k, "cpu"), max(lens_q), max(lens_k), return_softmax_lse=True,
                                          **args)
    start = 0
    for i, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        qs, ks, vs = q[i:i + 1, :n_q], k[i:i + 1, :n_k], v[i:i + 1, :n_k]
        seq, seq_lse = attention(qs, ks, vs, **ref)
        assert_calibrated(out_v[None, start:start + n_q], seq, attention(qs, ks, vs, low_precision=True, **ref)[0],
                          what=f"varlen sequence {i}")
        assert_lse(lse_v[None, :, start:start + n_q], seq_lse)
        start += n_q
    pages = -(-s_k // 16)
    paged = [x[:, :pages * 16].new_zeros(2 * pages, 16, *x.shape[2:]) for x in (k, v)]
    for cache, x in zip(paged, (k, v)):
        cache.view(2, pages * 16, *x.shape[2:])[:, :s_k] = x
    table = torch.arange(2 * pages, dtype=torch.int32).reshape(2, pages)
    out_p = flash_attn_with_kvcache(q, *paged, cache_seqlens=s_k, page_table=table, **args)
    assert torch.equal(out_p, out)


# The features the CUDA kernels take (dense and block_sparse): windows, chunks, softcap, sinks,
# head dims 96 and 256, and MLA's q/k 192 with v 128: every case.
CUDA_FEATURE_CASES = list(FEATURE_CASES)


@pytest.mark.skipif("cuda" not in DEVICES, reason="the CUDA kernels run windows, softcap and sinks")
@pytest.mark.parametrize("case", CUDA_FEATURE_CASES)
@pytest.mark.parametrize("s_q,s_k", [(37, 53), (53, 37), (300, 700)])
def test_model_family_features_on_cuda(case, s_q, s_k):
    # Dense attention with FlashAttention's window_size, softcap and sinks on the CUDA kernels
    # against float64, and the paged cache call equal to it.
    q, k, v, args, ref = feature_call(case, torch.bfloat16, s_q, s_k)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    if "sinks" in args:
        args["sinks"] = ref["sinks"] = args["sinks"].cuda()
    want, want_lse = attention(q, k, v, **ref)
    low = attention(q, k, v, low_precision=True, **ref)[0]
    out, lse = flash_attn_func(q, k, v, return_softmax_lse=True, **args)
    assert_calibrated(out, want, low)
    assert_lse(lse, want_lse)
    pages = -(-s_k // 16)
    paged = [x[:, :pages * 16].new_zeros(2 * pages, 16, *x.shape[2:]) for x in (k, v)]
    for cache, x in zip(paged, (k, v)):
        cache.view(2, pages * 16, *x.shape[2:])[:, :s_k] = x
    table = torch.arange(2 * pages, dtype=torch.int32, device="cuda").reshape(2, pages)
    out_p = flash_attn_with_kvcache(q, *paged, cache_seqlens=s_k, page_table=table, **args)
    assert_calibrated(out_p, want, low, what="paged")


@pytest.mark.skipif("cpu" not in DEVICES, reason="the CPU backend runs the model-family features")
def test_sinks_nan_and_inf_make_their_head_nan_alone():
    q, k, v = qkv(61, 1, 20, 30, 4, 2, 64, torch.float32, "cpu")
    sinks = torch.tensor([math.nan, math.inf, 0.5, -math.inf])
    out, lse = flash_attn_func(q, k, v, causal=True, sinks=sinks, return_softmax_lse=True)
    assert out[:, :, :2].isnan().all() and lse[:, :2].isnan().all()
    assert not out[:, :, 2:].isnan().any() and not lse[:, 2:].isnan().any()
    # A sink of -inf is no sink.
    assert torch.equal(out[:, :, 3], flash_attn_func(q, k, v, causal=True)[:, :, 3])


def pack(x, lengths):
    return torch.cat([x[b, :n] for b, n in enumerate(lengths)])


def cu(lengths, device):
    return torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32, device=device)


def check_per_sequence(out, lse, q, k, v, lens_q, lens_k, causal, varlen_q=True):
    start = 0
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        qs, ks, vs = q[b:b + 1, :n_q], k[b:b + 1, :n_k], v[b:b + 1, :n_k]
        ref, ref_lse = attention(qs, ks, vs, causal)
        got = out[None, start:start + n_q] if varlen_q else out[b:b + 1, :n_q]
        got_lse = lse[None, :, start:start + n_q] if varlen_q else lse[b:b + 1, :, :n_q]
        assert_calibrated(got, ref, attention(qs, ks, vs, causal, low_precision=True)[0], what=f"sequence {b}")
        assert_lse(got_lse, ref_lse)
        start += n_q


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
@pytest.mark.parametrize("causal", [False, True])
def test_varlen(device, dtype, causal):
    lens_q, lens_k = [1, 113, 0, 64, 17], [203, 113, 5, 64, 1]
    q, k, v = qkv(21, 5, 113, 203, 8, 2, 64, dtype, device)
    out, lse = flash_attn_varlen_func(pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q, device),
                                      cu(lens_k, device), max(lens_q), max(lens_k), causal=causal,
                                      return_softmax_lse=True)
    assert lse.shape == (8, sum(lens_q))
    check_per_sequence(out, lse, q, k, v, lens_q, lens_k, causal)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
def test_varlen_seqused(device, dtype):
    lens_q, lens_k = [40, 33, 7], [64, 50, 90]
    used_q, used_k = [31, 0, 7], [64, 20, 61]
    q, k, v = qkv(22, 3, 40, 90, 4, 4, 64, dtype, device)
    out, lse = flash_attn_varlen_func(pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q, device),
                                      cu(lens_k, device), 40, 90, causal=True, return_softmax_lse=True,
                                      seqused_q=torch.tensor(used_q, dtype=torch.int32, device=device),
                                      seqused_k=torch.tensor(used_k, dtype=torch.int32, device=device))
    starts = [0, 40, 73]
    for b in range(3):
        rows = slice(starts[b], starts[b] + used_q[b])
        ref, ref_lse = attention(q[b:b + 1, :used_q[b]], k[b:b + 1, :used_k[b]], v[b:b + 1, :used_k[b]], True)
        pt = attention(q[b:b + 1, :used_q[b]], k[b:b + 1, :used_k[b]], v[b:b + 1, :used_k[b]], True,
                       low_precision=True)[0]
        assert_calibrated(out[None, rows], ref, pt)
        assert_lse(lse[None, :, rows], ref_lse)
        unused = slice(starts[b] + used_q[b], starts[b] + lens_q[b])
        assert (out[unused] == 0).all() and torch.isneginf(lse[:, unused]).all()


def paged(k, v, page_size, seed, extra_pages=3):
    """Scatter [b, s_k, h, d] caches into shuffled pages; returns (k_pages, v_pages, table)."""
    b, s_k = k.shape[:2]
    per = -(-s_k // page_size)
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(b * per + extra_pages, generator=gen).to(torch.int32)
    table = perm[:b * per].reshape(b, per)
    pad = per * page_size - s_k
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).reshape(b * per, page_size, *k.shape[2:])
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).reshape(b * per, page_size, *v.shape[2:])
    k_pages = torch.randn((perm.numel(), page_size) + tuple(k.shape[2:]), generator=gen).to(k.dtype).to(k.device)
    v_pages = torch.randn_like(k_pages)
    k_pages[table.reshape(-1).long().to(k.device)] = kp
    v_pages[table.reshape(-1).long().to(k.device)] = vp
    return k_pages, v_pages, table.to(k.device)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_kvcache_paged_and_varlen_q(device, dtype, page_size):
    b, s_q, s_k, h_q, h_kv = 3, 37, 150, 6, 2
    q, k, v = qkv(23 + page_size, b, s_q, s_k, h_q, h_kv, 64, dtype, device)
    k_pages, v_pages, table = paged(k, v, page_size, page_size)
    lengths = [150, 37, 90]
    cache_seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    skip_unless_runs(q, k_pages, v_pages, sp.Dense(), block_table=table, seqused_k=cache_seqlens.cpu())
    out, lse = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=cache_seqlens, page_table=table,
                                       causal=True, return_softmax_lse=True)
    check_per_sequence(out, lse, q, k, v, [s_q] * b, lengths, True, varlen_q=False)
    lens_q = [37, 1, 20]
    out, lse = flash_attn_with_kvcache(pack(q, lens_q), k_pages, v_pages, cache_seqlens=cache_seqlens,
                                       page_table=table, cu_seqlens_q=cu(lens_q, device), max_seqlen_q=37,
                                       causal=True, return_softmax_lse=True)
    check_per_sequence(out, lse, q, k, v, lens_q, lengths, True)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
def test_kvcache_append_batch_idx_leftpad(device, dtype):
    b, b_cache, s_cache, s_new, h_q, h_kv = 3, 5, 120, 16, 4, 2
    gen = torch.Generator().manual_seed(24)
    k_cache = randn(gen, (b_cache, s_cache, h_kv, 64), dtype, device)
    v_cache = randn(gen, (b_cache, s_cache, h_kv, 64), dtype, device)
    q = randn(gen, (b, s_new, h_q, 64), dtype, device)
    k_new = randn(gen, (b, s_new, h_kv, 64), dtype, device)
    v_new = randn(gen, (b, s_new, h_kv, 64), dtype, device)
    batch_idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=device)
    cached = [30, 0, 104]
    leftpad = [5, 0, 50]
    before_k, before_v = k_cache.clone(), v_cache.clone()
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                  cache_seqlens=torch.tensor(cached, dtype=torch.int32, device=device),
                                  cache_batch_idx=batch_idx, cache_leftpad=torch.tensor(leftpad, dtype=torch.int32,
                                                                                        device=device),
                                  causal=True)
    for i, row in enumerate(batch_idx.tolist()):
        n = cached[i]
        assert torch.equal(k_cache[row, n:n + s_new], k_new[i]) and torch.equal(v_cache[row, n:n + s_new], v_new[i])
        assert torch.equal(k_cache[row, :n], before_k[row, :n]) and torch.equal(v_cache[row, n + s_new:],
                                                                                before_v[row, n + s_new:])
        keys = slice(leftpad[i], n + s_new)
        ks, vs = k_cache[row:row + 1, keys], v_cache[row:row + 1, keys]
        ref, _ = attention(q[i:i + 1], ks, vs, True)
        assert_calibrated(out[i:i + 1], ref, attention(q[i:i + 1], ks, vs, True, low_precision=True)[0])
    untouched = [r for r in range(b_cache) if r not in batch_idx.tolist()]
    assert torch.equal(k_cache[untouched], before_k[untouched])
    with pytest.raises(sp.InvalidArgumentError, match=r"cache_seqlens\[2\]: 110 cached \+ 16 new keys exceed"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_batch_idx=batch_idx,
                                cache_seqlens=torch.tensor([0, 0, 110], dtype=torch.int32, device=device))


def test_flash_attn_combine_merges_by_lse():
    gen = torch.Generator().manual_seed(25)
    q, k, v = qkv(25, 2, 16, 64, 4, 4, 32, torch.float32, "cpu")
    full, full_lse = flash_attn_func(q, k, v, return_softmax_lse=True)
    parts = [flash_attn_func(q, k[:, a:a + 32], v[:, a:a + 32], return_softmax_lse=True) for a in (0, 32)]
    outs = torch.stack([p[0] for p in parts])
    lses = torch.stack([p[1].transpose(1, 2) for p in parts])  # [splits, b, s_q, h]
    merged, lse = flash_attn_combine(outs, lses)
    assert torch.allclose(merged, full, atol=1e-5) and torch.allclose(lse, full_lse.transpose(1, 2), atol=1e-5)
    del gen


# The CUDA kernels take block_q = 128 (and block_k 64 or 128); the CPU backend any size.
POLICY_BLOCK = {"cpu": 16, "cuda": 128}


def policies(device):
    bl = POLICY_BLOCK[device]
    return {
        "softmax_skip": sp.SoftmaxSkip(block_q=bl, block_k=bl, a=40.0),
        "estimate_select": sp.EstimateSelect(block=bl, alpha=0.5, sink=1, window=1, tail=1),
        "estimate_select_mean_correction_pack_gqa": sp.EstimateSelect(block=bl, alpha=0.5, sink=1, window=1, tail=1,
                                                                      mean_correction=True, pack_gqa=True),
        "permute_stop": sp.PermuteStop(segment=bl, tau=0.1, block_q=bl, block_k=bl),
        "exact_gate": sp.ExactGate(block_q=bl, block_k=bl, thresholds=torch.full((8, 64), 4.0)),
        "block_sparse": None,  # built per test from the geometry
    }


POLICY_NAMES = sorted(policies("cpu"))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
@pytest.mark.parametrize("d", [64, 96])  # 96: Phi-3's, every portable kernel at its row pitch
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_matches_oracle(device, dtype, d, name):
    bl = POLICY_BLOCK[device]
    s = 4 * bl + 17
    q, k, v = structured(31, 1, s, s, 8, 2, d, dtype, device, bl)
    policy = policies(device)[name]
    if name == "block_sparse":
        nb = -(-s // bl)
        gen = torch.Generator().manual_seed(32)
        keep = torch.rand((1, 2, nb, nb), generator=gen) < 0.5
        keep |= torch.eye(nb, dtype=torch.bool)  # the diagonal keeps every row non-empty
        policy = sp.BlockSparse(dense=keep & torch.ones(nb, nb, dtype=torch.bool).tril(), block_q=bl, block_k=bl,
                                per_kv_head=True)
    skip_unless_runs(q, k, v, policy)
    with sp.collect_stats() as log:
        out, lse = flash_attn_func(q, k, v, causal=True, policy=policy, return_softmax_lse=True, layer=3)
    oracle = sp.run(q.cpu(), k.cpu(), v.cpu(), policy, causal=True, backend="reference")
    # Same decisions as the oracle: identical per-head work; outputs within the calibrated
    # bound whose scale is dense attention's low-precision error on these inputs.
    assert len(log.calls) == 1 and log.calls[0].layer == 3
    np.testing.assert_array_equal(log.calls[0].heads, oracle.stats.heads)
    assert 0.0 < oracle.stats.density < 1.0
    dense_ref, _ = attention(q, k, v, True)
    dense_err = attention(q, k, v, True, low_precision=True)[0].to(torch.float64) - dense_ref
    ref = oracle.out.to(torch.float64).to(device)
    assert_calibrated(out, ref, ref + dense_err)
    assert_lse(lse, oracle.lse.to(torch.float64), tol=2e-2)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
@pytest.mark.parametrize("d,d_v", [(96, 96), (256, 256), (192, 128)])
@pytest.mark.parametrize("name", ["estimate_select", "estimate_select_mean_correction_pack_gqa", "exact_gate",
                                  "softmax_skip"])
def test_head_dims_match_oracle(device, dtype, d, d_v, name):
    # Phi-3's, Gemma 3's and MLA prefill's head dims: the selector's, exact_gate's and
    # softmax_skip's decisions are the oracle's (identical per-head work), the output within the
    # calibrated bound, as at 64 above.
    bl = POLICY_BLOCK[device]
    s = 4 * bl + 17
    q, k, v = structured(35, 1, s, s, 8, 2, d, dtype, device, bl)
    if d_v != d:
        v = randn(torch.Generator().manual_seed(36), (1, s, 2, d_v), dtype, device)
    policy = policies(device)[name]
    skip_unless_runs(q, k, v, policy)
    with sp.collect_stats() as log:
        out, lse = flash_attn_func(q, k, v, causal=True, policy=policy, return_softmax_lse=True)
    oracle = sp.run(q.cpu(), k.cpu(), v.cpu(), policy, causal=True, backend="reference")
    np.testing.assert_array_equal(log.calls[0].heads, oracle.stats.heads)
    assert 0.0 < oracle.stats.density < 1.0
    dense_ref, _ = attention(q, k, v, True)
    dense_err = attention(q, k, v, True, low_precision=True)[0].to(torch.float64) - dense_ref
    ref = oracle.out.to(torch.float64).to(device)
    assert out.shape == q.shape[:-1] + (d_v,)
    assert_calibrated(out, ref, ref + dense_err)
    assert_lse(lse, oracle.lse.to(torch.float64), tol=2e-2)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
@pytest.mark.parametrize("name", POLICY_NAMES)
def test_kvcache_paged_chunked_prefill_every_policy(device, dtype, name):
    """A prompt prefilled in two chunks through flash_attn_with_kvcache into a paged cache
    (pages of 16 keys, shuffled, NaN where nothing was written): each chunk appends its keys
    and attends to the cached prefix plus itself, and matches the oracle of that call with
    identical per-head work."""
    bl = POLICY_BLOCK[device]
    s, h_q, h_kv, d, page = 4 * bl + 17, 8, 2, 64, 16
    q, k, v = structured(33, 1, s, s, h_q, h_kv, d, dtype, device, bl)
    pages = -(-s // page) + 3
    gen = torch.Generator().manual_seed(34)
    table = torch.randperm(pages, generator=gen)[:pages - 3].to(torch.int32).reshape(1, -1).to(device)
    k_cache = torch.full((pages, page, h_kv, d), math.nan, dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, math.nan)
    nb = -(-s // bl)
    keep_all = (torch.rand((1, 2, nb, nb), generator=gen) < 0.5) | torch.eye(nb, dtype=torch.bool)
    keep_all &= torch.ones(nb, nb, dtype=torch.bool).tril()
    for c0, c1 in ((0, 2 * bl), (2 * bl, s)):
        policy = policies(device)[name]
        if name == "block_sparse":
            # The one-shot mask's rows of this chunk's query blocks (bottom-right aligned:
            # chunk block i is block c0 / bl + i of the prompt), over the chunk's key blocks.
            rows = keep_all[:, :, c0 // bl:-(-c1 // bl), :-(-c1 // bl)]
            policy = sp.BlockSparse(dense=rows.contiguous(), block_q=bl, block_k=bl, per_kv_head=True)
        qc = q[:, c0:c1].contiguous()
        skip_unless_runs(qc, k_cache, v_cache, policy, block_table=table.cpu(),
                         seqused_k=torch.tensor([c1], dtype=torch.int32))
        with sp.collect_stats() as log:
            out, lse = flash_attn_with_kvcache(qc, k_cache, v_cache, k[:, c0:c1].contiguous(),
                                               v[:, c0:c1].contiguous(),
                                               cache_seqlens=torch.tensor([c0], dtype=torch.int32, device=device),
                                               page_table=table, causal=True, policy=policy,
                                               return_softmax_lse=True, layer=1)
        oracle = sp.run(qc.cpu(), k[:, :c1].cpu(), v[:, :c1].cpu(), policy, causal=True, backend="reference")
        assert len(log.calls) == 1
        np.testing.assert_array_equal(log.calls[0].heads, oracle.stats.heads)
        ks, vs = k[:, :c1], v[:, :c1]
        dense_ref, _ = attention(qc, ks, vs, True)
        dense_err = attention(qc, ks, vs, True, low_precision=True)[0].to(torch.float64) - dense_ref
        ref = oracle.out.to(torch.float64).to(device)
        assert_calibrated(out, ref, ref + dense_err, what=f"chunk [{c0}, {c1})")
        assert_lse(lse, oracle.lse.to(torch.float64), tol=2e-2)
    # The cache holds the prompt's keys and values, in the table's pages.
    rows = table[0].long()
    assert torch.equal(k_cache[rows].flatten(0, 1)[:s], k[0]) and torch.equal(v_cache[rows].flatten(0, 1)[:s], v[0])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES, ids=ids(DEVICE_DTYPES))
def test_kvcache_chunked_estimate_select_with_cached_means(device, dtype):
    """estimate_select through flash_attn_with_kvcache in two chunks into a paged cache, with
    the prompt's length and the cache of block means in the policy: each chunk matches the
    one-shot oracle's rows (the tail is the prompt's, the prefix means come from the cache),
    and the cache holds the means of the complete blocks (NaN past them: never written)."""
    bl = POLICY_BLOCK[device]
    s, h_q, h_kv, d, page = 4 * bl, 8, 2, 64, 16
    q, k, v = structured(35, 1, s, s, h_q, h_kv, d, dtype, device, bl)
    pages = s // page + 3
    gen = torch.Generator().manual_seed(36)
    table = torch.randperm(pages, generator=gen)[:pages - 3].to(torch.int32).reshape(1, -1).to(device)
    k_cache = torch.full((pages, page, h_kv, d), math.nan, dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, math.nan)
    base = dict(block=bl, alpha=0.5, sink=1, window=1, tail=2, mean_correction=True)
    one_shot = sp.run(q.cpu(), k.cpu(), v.cpu(), sp.EstimateSelect(**base), causal=True, backend="reference")
    k_means = torch.full((1, h_kv, s // bl + 1, d), math.nan, dtype=dtype, device=device)
    v_means = torch.full_like(k_means, math.nan)
    valid = torch.zeros(1, dtype=torch.int32)
    policy = sp.EstimateSelect(**base, prompt_len=torch.tensor([s], dtype=torch.int32), k_block_means=k_means,
                               v_block_means=v_means, block_means_valid=valid)
    for c0, c1 in ((0, 2 * bl), (2 * bl, s)):
        qc = q[:, c0:c1].contiguous()
        skip_unless_runs(qc, k_cache, v_cache, policy, block_table=table.cpu(),
                         seqused_k=torch.tensor([c1], dtype=torch.int32))
        out, lse = flash_attn_with_kvcache(qc, k_cache, v_cache, k[:, c0:c1].contiguous(), v[:, c0:c1].contiguous(),
                                           cache_seqlens=torch.tensor([c0], dtype=torch.int32, device=device),
                                           page_table=table, causal=True, policy=policy, return_softmax_lse=True)
        ks, vs = k[:, :c1], v[:, :c1]
        dense_ref, _ = attention(qc, ks, vs, True)
        dense_err = attention(qc, ks, vs, True, low_precision=True)[0].to(torch.float64) - dense_ref
        ref = one_shot.out[:, c0:c1].to(torch.float64).to(device)
        assert_calibrated(out, ref, ref + dense_err, what=f"chunk [{c0}, {c1})")
        assert_lse(lse, one_shot.lse[:, :, c0:c1].to(torch.float64), tol=2e-2)
        valid[0] = c1 // bl
    for x, cache in ((k, k_means), (v, v_means)):
        want = (x[0].double().reshape(s // bl, bl, h_kv, d).sum(1) / bl).float().to(dtype).transpose(0, 1)
        assert torch.equal(cache[0, :, :s // bl].cpu(), want.cpu())
        assert torch.isnan(cache[0, :, s // bl:].float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    bl = POLICY_BLOCK[device]
    q, k, v = structured(41, 2, 4 * bl, 4 * bl, 8, 2, 64, dtype, device, bl)
    gate = sp.ExactGate(block_q=bl, block_k=bl, thresholds=torch.full((8, 8), 4.0, device=device))
    select = sp.EstimateSelect(block=bl, alpha=0.5)

    def fn(q, k, v):
        a = flash_attn_func(q, k, v, causal=True)
        b = flash_attn_func(q, k, v, causal=True, policy=select)
        c, lse = flash_attn_func(q, k, v, causal=True, policy=gate, return_softmax_lse=True)
        return a, b, c, lse

    for policy in (select, gate):
        skip_unless_runs(q, k, v, policy)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    eager = fn(q, k, v)
    got = compiled(q, k, v)
    for g, e in zip(got, eager):
        assert torch.equal(g, e)
    lens = [3 * bl, bl + 5]
    cu_q = cu(lens, device)
    varlen = torch.compile(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_q, max(lens), max(lens),
                                                                  causal=True), fullgraph=True)
    qp, kp, vp = pack(q, lens), pack(k, lens), pack(v, lens)
    assert torch.equal(varlen(qp, kp, vp), flash_attn_varlen_func(qp, kp, vp, cu_q, cu_q, max(lens), max(lens),
                                                                  causal=True))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = qkv(42, 2, 33, 47, 4, 2, 64, dtype, device)
    args = (q, k, v, None, None, None, None, None, None, None, True, 0.0, -1, -1, 0, 0.0, None, "dense", "", None,
            None, None, 0, 0, False, -1, None, None, None, None)
    torch.library.opcheck(torch.ops.sparseprefill.attention.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    out = torch.empty_like(q)
    lse = torch.empty((2, 4, 33), dtype=torch.float32, device=device)
    torch.library.opcheck(torch.ops.sparseprefill.attention_out.default, args + (out, lse),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.skipif("cpu" not in DEVICES, reason="the CPU backend runs the model-family features")
def test_model_family_features_compile_and_opcheck():
    # The fakes give out v's head dim and check the features as the ops do; compiled calls with
    # a window, chunks, softcap, sinks and d_v equal eager ones.
    q, k, v, args, _ = feature_call("q/k 192, v 128, sinks", torch.float32, 33, 47)
    sinks = args["sinks"]
    op_args = (q, k, v, None, None, None, None, None, None, None, False, 0.0, 9, 3, 20, 2.5, sinks, "dense", "", None,
               None, None, 0, 0, False, -1, None, None, None, None)
    torch.library.opcheck(torch.ops.sparseprefill.attention.default, op_args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    out = torch.empty(2, 33, 4, 128)
    lse = torch.empty((2, 4, 33), dtype=torch.float32)
    torch.library.opcheck(torch.ops.sparseprefill.attention_out.default, op_args + (out, lse),
                          test_utils=("test_schema", "test_faketensor"))

    def fn(q, k, v, sinks):
        return flash_attn_func(q, k, v, causal=True, window_size=(9, 0), attention_chunk=20, softcap=2.5, sinks=sinks)

    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True)(q, k, v, sinks), fn(q, k, v, sinks))
    with pytest.raises(sp.InvalidArgumentError, match="softcap"):
        torch.ops.sparseprefill.attention(*op_args[:15], -1.0, *op_args[16:])
    with pytest.raises(sp.InvalidArgumentError, match="attention_chunk"):
        torch.ops.sparseprefill.attention(*op_args[:14], -3, *op_args[15:])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_capture_without_warm_up_is_refused_cleanly():
    # Metadata a captured call needs (here its sequence table: a shape no other test runs) must
    # have been uploaded by an earlier uncaptured call of the same shapes: a first call under
    # capture raises before any CUDA work, the capture ends cleanly and the device stays usable.
    q, k, v = qkv(50, 1, 251, 263, 4, 2, 64, torch.bfloat16, "cuda")
    sp.clear_call_cache()  # nor a prepared call of it (one needs no warm-up: test_call_cache.py)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(sp.UnsupportedError, match="capturing a CUDA graph"):
        with torch.cuda.graph(graph):
            flash_attn_func(q, k, v, causal=True)
    out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert_calibrated(out, attention(q, k, v, True)[0], attention(q, k, v, True, low_precision=True)[0])


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    dtype, device, bl = torch.bfloat16, "cuda", POLICY_BLOCK["cuda"]
    q, k, v = structured(43, 2, 4 * bl + 3, 4 * bl + 3, 8, 2, 64, dtype, device, bl)
    gate = sp.ExactGate(block_q=bl, block_k=bl, thresholds=torch.full((8, 8), 4.0, device=device))
    cases = [sp.Dense(), sp.SoftmaxSkip(block_q=bl, block_k=bl, a=40.0), gate]
    cases = [p for p in cases if sp.can_run(q, k, v, p, causal=True)[0]]
    assert cases and isinstance(cases[0], sp.Dense)
    static = [x.clone() for x in (q, k, v)]

    def step():
        return [flash_attn_func(*static, causal=True, policy=p, return_softmax_lse=True) for p in cases]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside capture (first calls copy thresholds to the device)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    q2, k2, v2 = structured(44, 2, 4 * bl + 3, 4 * bl + 3, 8, 2, 64, dtype, device, bl)
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for policy, (out, lse) in zip(cases, captured):
        want, want_lse = flash_attn_func(q2, k2, v2, causal=True, policy=policy, return_softmax_lse=True)
        assert torch.equal(out, want) and torch.equal(lse, want_lse), policy.name


def fa_bad(device, **overrides):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = qkv(45, 2, 16, 16, 4, 2, 64, dtype, device)
    args = dict(q=q, k=k, v=v)
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return lambda: flash_attn_func(q, k, v, **args)


def bad_cases(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    z = lambda *s, dt=dtype: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
    cases = [
        ("dtype", fa_bad(device, q=z(2, 16, 4, 64, dt=torch.float64)), sp.InvalidArgumentError, "q: expected dtype"),
        ("rank", fa_bad(device, q=z(2, 16, 4, 64, 1)), sp.InvalidArgumentError, "q: expected"),
        ("heads", fa_bad(device, k=z(2, 16, 3, 64), v=z(2, 16, 3, 64)), sp.InvalidArgumentError, "k: h_kv"),
        ("head dim", fa_bad(device, k=z(2, 16, 2, 32), v=z(2, 16, 2, 32)), sp.InvalidArgumentError,
         "k: expected head_dim 64"),
        ("lengths", fa_bad(device, v=z(2, 15, 2, 64)), sp.InvalidArgumentError, "v: expected the shape of k"),
        ("batch", fa_bad(device, k=z(3, 16, 2, 64), v=z(3, 16, 2, 64)), sp.InvalidArgumentError, "k: expected batch"),
        ("out", fa_bad(device, out=z(2, 16, 4, 32)), sp.InvalidArgumentError, "out: expected q's shape"),
        ("out dtype", fa_bad(device, out=z(2, 16, 4, 64, dt=torch.float16 if dtype != torch.float16 else torch.bfloat16)),
         sp.InvalidArgumentError, "out: expected q's dtype"),
        ("scale", fa_bad(device, softmax_scale=float("nan")), sp.InvalidArgumentError, "softmax_scale"),
        ("policy", fa_bad(device, policy="sparse"), sp.InvalidArgumentError, "policy: expected"),
        ("policy value", fa_bad(device, policy=sp.PermuteStop(tau=-1.0)), sp.InvalidArgumentError, "tau"),
        ("dropout_p", fa_bad(device, dropout_p=0.1), sp.UnsupportedError, "dropout_p"),
        ("window_size", fa_bad(device, window_size=(-2, 0)), sp.InvalidArgumentError,
         r"window_size: left must be -1 \(no bound\) or a number of keys >= 0"),
        ("window_size type", fa_bad(device, window_size=(8.5, 0)), sp.InvalidArgumentError,
         r"window_size: expected integers"),
        ("window_size arity", fa_bad(device, window_size=(8,)), sp.InvalidArgumentError,
         r"window_size: expected \(left, right\)"),
        ("softcap", fa_bad(device, softcap=-30.0), sp.InvalidArgumentError, "softcap: expected 0 .none. or a finite"),
        ("softcap nan", fa_bad(device, softcap=float("nan")), sp.InvalidArgumentError, "softcap: expected 0"),
        ("softcap inf", fa_bad(device, softcap=float("inf")), sp.InvalidArgumentError, "softcap: expected 0"),
        ("sinks shape", fa_bad(device, sinks=z(3, dt=torch.float32)), sp.InvalidArgumentError,
         r"sinks: expected float32 \[h_q\] = \[4\]"),
        ("sinks dtype", fa_bad(device, sinks=z(4, dt=torch.bfloat16)), sp.InvalidArgumentError, r"sinks: expected float32"),
        ("sinks type", fa_bad(device, sinks=[0.0] * 4), sp.InvalidArgumentError, "sinks: expected a torch.Tensor"),
        ("alibi_slopes", fa_bad(device, alibi_slopes=z(4, dt=torch.float32)), sp.UnsupportedError, "alibi_slopes"),
        ("qv", fa_bad(device, qv=z(2, 16, 4, 64)), sp.UnsupportedError, "qv"),
        ("q_descale", fa_bad(device, q_descale=z(2, 2, dt=torch.float32)), sp.InvalidArgumentError,
         f"q_descale: only with float8_e4m3fn inputs, got {str(dtype).replace('torch.', '')} inputs"),
        ("attention_chunk", fa_bad(device, attention_chunk=-4), sp.InvalidArgumentError,
         r"attention_chunk: expected 0 \(none\) or a chunk of positions > 0, got -4"),
    ]
    q, k, v = qkv(46, 1, 20, 20, 2, 1, 64, dtype, device)
    qp, kp, vp = q[0], k[0], v[0]
    cu_ok = torch.tensor([0, 10, 20], dtype=torch.int32, device=device)
    cases += [
        ("cu_seqlens dtype", lambda: flash_attn_varlen_func(qp, kp, vp, cu_ok.long(), cu_ok, 10, 10),
         sp.InvalidArgumentError, "cu_seqlens_q: expected dtype int32"),
        ("cu_seqlens length", lambda: flash_attn_varlen_func(qp, kp, vp, cu_ok, cu_ok[:2], 10, 10),
         sp.InvalidArgumentError, "cu_seqlens_k: expected int32"),
        ("cu_seqlens order", lambda: flash_attn_varlen_func(
            qp, kp, vp, torch.tensor([0, 12, 10], dtype=torch.int32, device=device), cu_ok, 12, 10),
         sp.InvalidArgumentError, "cu_seqlens_q: must be non-decreasing"),
        ("seqused_q", lambda: flash_attn_varlen_func(qp, kp, vp, cu_ok, cu_ok, 10, 10,
                                                     seqused_q=torch.tensor([11, 1], dtype=torch.int32)),
         sp.InvalidArgumentError, r"seqused_q\[0\]"),
        ("paged lengths", lambda: flash_attn_with_kvcache(q, k.reshape(2, 10, 1, 64), v.reshape(2, 10, 1, 64),
                                                          cache_seqlens=torch.tensor([21], dtype=torch.int32),
                                                          page_table=torch.tensor([[0, 1]], dtype=torch.int32,
                                                                                  device=device)),
         sp.InvalidArgumentError, "cache_seqlens"),
        ("rotary", lambda: flash_attn_with_kvcache(q, k, v, rotary_cos=z(20, 32), rotary_sin=z(20, 32)),
         sp.UnsupportedError, "rotary_cos"),
    ]
    if device == "cuda":
        qc, kc, vc = qkv(47, 1, 8, 8, 2, 2, 64, dtype, device)
        cases += [
            ("device", lambda: flash_attn_func(qc, kc.cpu(), vc), sp.InvalidArgumentError, "k: expected q's device"),
            ("out device", lambda: flash_attn_func(qc, kc, vc, out=torch.empty_like(qc).cpu()),
             sp.InvalidArgumentError, "out: expected q's device"),
            ("sinks device", lambda: flash_attn_func(qc, kc, vc, sinks=torch.zeros(2)), sp.InvalidArgumentError,
             "sinks: expected q's device"),
            # The CUDA kernels take local windows, softcap and sinks for dense and block_sparse
            # only (test_model_family_features_on_cuda), permute_stop not at head dims 256 and
            # MLA's 192/128, and other V head dims unlike Q/K's not at all: each is refused by name.
            ("cuda window", lambda: flash_attn_func(qc, kc, vc, causal=True, window_size=(3, 0),
                                                    policy=sp.SoftmaxSkip()),
             sp.UnsupportedError, "window_left/window_right: local .sliding-window. attention runs dense and "
             "block_sparse on CUDA, not softmax_skip"),
            ("cuda softcap", lambda: flash_attn_func(qc, kc, vc, softcap=5.0, policy=sp.SoftmaxSkip()),
             sp.UnsupportedError, "softcap: score soft-capping runs dense and block_sparse on CUDA, not softmax_skip"),
            ("cuda chunks", lambda: flash_attn_func(qc, kc, vc, causal=True, attention_chunk=64,
                                                    policy=sp.SoftmaxSkip()),
             sp.UnsupportedError, "attention_chunk: chunked local attention runs dense and block_sparse on CUDA, "
             "not softmax_skip"),
            ("cuda sinks", lambda: flash_attn_func(qc, kc, vc, sinks=torch.zeros(2, device=device),
                                                   policy=sp.SoftmaxSkip()),
             sp.UnsupportedError, "sinks: learned attention sinks runs dense and block_sparse on CUDA, not "
             "softmax_skip"),
            ("cuda d_v", lambda: flash_attn_func(qc, kc, vc[..., :32].contiguous()), sp.UnsupportedError,
             "v: a V head dim unlike Q/K's"),
            ("cuda head_dim 256", lambda: flash_attn_func(*qkv(47, 1, 8, 8, 2, 2, 256, dtype, device), causal=True,
                                                          policy=sp.PermuteStop()),
             sp.UnsupportedError, "head_dim 256 runs dense, block_sparse, exact_gate, softmax_skip and "
             "estimate_select on CUDA, not permute_stop"),
        ]
    return cases


BAD_IDS = [c[0] for c in bad_cases("cpu")]


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_name_the_argument(device):
    cases = bad_cases(device)
    for case, call, error, message in cases:
        with pytest.raises(error, match=message):
            call()
    assert len(cases) >= len(BAD_IDS)


@pytest.mark.parametrize("device", DEVICES)
def test_last_dim_contiguity(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = qkv(48, 1, 16, 16, 2, 2, 64, dtype, device)
    # The op itself rejects a strided last dimension; the FA functions copy it, as FA does.
    strided = torch.zeros(1, 16, 2, 128, dtype=dtype, device=device)[..., ::2]
    with pytest.raises(sp.InvalidArgumentError, match="q: the last dimension"):
        torch.ops.sparseprefill.attention(strided, k, v, None, None, None, None, None, None, None, True, 0.0, -1, -1,
                                          0, 0.0, None, "dense", "", None, None, None, 0, 0, False, -1, None, None, None,
                                          None)
    strided.copy_(q)
    assert torch.equal(flash_attn_func(strided, k, v, causal=True), flash_attn_func(q, k, v, causal=True))


def test_native_run_on_torch_returns_stats():
    q, k, v = structured(49, 1, 64, 64, 4, 2, 32, torch.float32, "cpu", 16)
    r = sp.run(q, k, v, sp.EstimateSelect(block=16, alpha=0.5, sink=1, window=1, tail=1))
    assert isinstance(r.out, torch.Tensor) and r.lse.dtype == torch.float32
    assert r.stats.heads.shape == (1, 4, 5) and 0 < r.stats.density < 1
    assert torch.allclose(r.out, flash_attn_func(q, k, v, causal=True,
                                                 policy=sp.EstimateSelect(block=16, alpha=0.5, sink=1, window=1,
                                                                          tail=1)))


@pytest.mark.parametrize("device", DEVICES)
def test_native_select_plan_run(device):
    dtype, bl = (torch.bfloat16, POLICY_BLOCK["cuda"]) if device == "cuda" else (torch.float32, 16)
    q, k, v = structured(51, 2, 5 * bl + 3, 6 * bl + 1, 8, 2, 64, dtype, device, bl)
    policy = sp.EstimateSelect(block=bl, alpha=0.5, sink=1, window=1, tail=1, mean_correction=True)
    sel = sp.select(q, k, v, policy)
    assert 0 < sel.mask.density < 1 and sel.corrected is not None
    # The device's selection is the CPU backend's (the banded inputs sit far from every tie).
    host = sp.select(q.cpu(), k.cpu(), v.cpu(), policy, backend="cpu")
    np.testing.assert_array_equal(sel.mask.indptr, host.mask.indptr)
    np.testing.assert_array_equal(sel.mask.indices, host.mask.indices)
    np.testing.assert_array_equal(sel.corrected.indices, host.corrected.indices)
    np.testing.assert_array_equal(sel.stats.heads, host.stats.heads)
    ran = sp.run(q, k, v, policy, decisions=True)
    np.testing.assert_array_equal(ran.decisions.kept.indices, sel.mask.indices)
    # The selection as a block mask, planned once and run twice, equals the one-shot call.
    mask_policy = sp.select(q, k, v, sp.EstimateSelect(block=bl, alpha=0.5, sink=1, window=1, tail=1)).mask.to_policy()
    plan = sp.plan(q, k, v, mask_policy)
    direct = sp.run(q, k, v, mask_policy)
    for _ in range(2):
        planned = sp.run(plan, q, k, v)
        assert torch.equal(planned.out, direct.out) and torch.equal(planned.lse, direct.lse)
        np.testing.assert_array_equal(planned.stats.heads, direct.stats.heads)
    with pytest.raises(sp.InvalidArgumentError, match="does not match the plan"):
        sp.run(plan, q[:, :-1], k, v)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_native_plan_captures_without_warm_up():
    # A shape no other test runs: nothing of it is cached on the device before the capture;
    # the plan holds the mask and the sequence table, so the first call may be captured.
    dtype, device, bl = torch.bfloat16, "cuda", POLICY_BLOCK["cuda"]
    s = 7 * bl + 5
    q, k, v = structured(52, 2, s, s, 8, 2, 64, dtype, device, bl)
    vis = np.tril(np.ones((8, 8), dtype=bool))
    dense = vis & (np.add.outer(np.arange(8), np.arange(8)) % 3 != 1)
    policy = sp.BlockSparse(dense=dense[None, None], block_q=bl, block_k=bl)
    static = [x.clone() for x in (q, k, v)]
    out, lse = torch.empty_like(q), torch.empty((2, 8, s), dtype=torch.float32, device=device)
    plan = sp.plan(*static, policy)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = sp.run(plan, *static, out=out, lse=lse)
    assert r.stats is None  # nothing is read back under capture
    q2, k2, v2 = structured(53, 2, s, s, 8, 2, 64, dtype, device, bl)
    for dst, src in zip(static, (q2, k2, v2)):
        dst.copy_(src)
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    want = sp.run(q2, k2, v2, policy)
    assert torch.equal(out, want.out) and torch.equal(lse, want.lse)
    mask = torch.from_numpy(dense).repeat_interleave(bl, 0).repeat_interleave(bl, 1)[:s, :s].to(device)
    full = mask[None, None].expand(2, 8, s, s)
    assert_calibrated(out, attention(q2, k2, v2, True, mask=full)[0],
                      attention(q2, k2, v2, True, mask=full, low_precision=True)[0])
