# SPDX-License-Identifier: Apache-2.0
"""The binding on NumPy arrays (CPU backend; no torch needed): dense attention in every layout
against float64 NumPy, every policy against the fp64 oracle backend with identical work
statistics, block masks in their three forms against the expanded-mask reference,
calibration files (read, and written by Calibrator), statistics collection, and the errors of
bad arguments."""

import math
import struct
import json

import numpy as np
import pytest

import sparseprefill as sp
from _refs import (allowed_mask, assert_close_calibrated, assert_lse_close, attention, expand_blocks,
                   low_precision, randn, rng, visible_blocks)


def qkv(seed, b, s_q, s_k, h_q, h_kv, d, dtype=np.float32):
    g = rng(seed)
    return randn(g, (b, s_q, h_q, d), dtype), randn(g, (b, s_k, h_kv, d), dtype), randn(g, (b, s_k, h_kv, d), dtype)


def structured_qkv(seed, b, s_q, s_k, h_q, h_kv, d, block=8, strength=1.5, dtype=np.float32):
    """Keys with a shared component per `block` positions, so that blocks differ in weight and
    the sparse policies have something to select (random keys make every block alike)."""
    q, k, v = qkv(seed, b, s_q, s_k, h_q, h_kv, d, np.float32)
    per_block = randn(rng(seed + 1), (b, -(-s_k // block), h_kv, d))
    k = k + strength * np.repeat(per_block, block, axis=1)[:, :s_k]
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def poisoned(shape, dtype):
    return np.full(shape, np.nan, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("s_q,s_k", [(1, 1), (15, 17), (17, 15), (113, 113), (1, 64), (64, 1)])
@pytest.mark.parametrize("h_q,h_kv", [(4, 4), (4, 1), (8, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_batched_matches_float64(dtype, s_q, s_k, h_q, h_kv, causal):
    q, k, v = qkv(s_q * 131 + s_k + h_kv, 2, s_q, s_k, h_q, h_kv, 32, dtype)
    out, lse = poisoned(q.shape, dtype), poisoned((2, h_q, s_q), np.float32)
    r = sp.run(q, k, v, causal=causal, out=out, lse=lse)
    assert r.out is out and r.lse is lse
    ref, ref_lse = attention(q, k, v, causal)
    assert_close_calibrated(out, ref, low_precision(q, k, v, causal), dtype)
    assert_lse_close(lse, ref_lse)
    # Rows that see no key (causal, s_q > s_k): O = 0, LSE = -inf.
    empty = ~allowed_mask(s_q, s_k, causal).any(axis=1)
    assert (out[:, empty] == 0).all() and np.isneginf(lse[:, :, empty]).all()
    assert r.stats.density == 1.0 and r.stats.heads.shape == (2, h_q, 5)


def test_scale_and_noncontiguous_strides():
    q, k, v = qkv(1, 2, 33, 40, 8, 2, 16)
    # [b, h, s, d] storage viewed as [b, s, h, d]: only the last dimension is contiguous.
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    r = sp.run(qt, kt, v, causal=True, softmax_scale=0.3)
    ref, ref_lse = attention(q, k, v, True, scale=0.3)
    assert_close_calibrated(r.out, ref, low_precision(q, k, v, True, scale=0.3), np.float32)
    assert_lse_close(r.lse, ref_lse)


def varlen_pack(x, lengths):
    return np.concatenate([x[b, :n] for b, n in enumerate(lengths)], axis=0)


def cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_per_sequence(causal):
    lens_q, lens_k = [1, 17, 0, 40], [5, 17, 3, 113]
    q, k, v = qkv(7, 4, 40, 113, 6, 3, 32)
    qp, kp, vp = varlen_pack(q, lens_q), varlen_pack(k, lens_k), varlen_pack(v, lens_k)
    r = sp.run(qp, kp, vp, causal=causal, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k))
    assert r.out.shape == qp.shape and r.lse.shape == (6, sum(lens_q))
    start = 0
    for b, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        sl = slice(start, start + n_q)
        ref, ref_lse = attention(q[b:b + 1, :n_q], k[b:b + 1, :n_k], v[b:b + 1, :n_k], causal)
        pt = low_precision(q[b:b + 1, :n_q], k[b:b + 1, :n_k], v[b:b + 1, :n_k], causal)
        assert_close_calibrated(r.out[None, sl], ref, pt, np.float32, what=f"sequence {b}")
        assert_lse_close(r.lse[None, :, sl], ref_lse)
        start += n_q


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_equals_contiguous(page_size):
    b, s_q, s_k, h_q, h_kv, d = 3, 9, 45, 4, 2, 16
    q, k, v = qkv(page_size, b, s_q, s_k, h_q, h_kv, d)
    used = np.array([45, 9, 30], dtype=np.int32)
    pages_per_seq = math.ceil(s_k / page_size)
    g = rng(99)
    perm = g.permutation(b * pages_per_seq + 5).astype(np.int32)
    table = perm[:b * pages_per_seq].reshape(b, pages_per_seq)
    k_pages = randn(g, (perm.size, page_size, h_kv, d))
    v_pages = randn(g, (perm.size, page_size, h_kv, d))
    for bi in range(b):
        for p in range(pages_per_seq):
            rows = slice(p * page_size, min((p + 1) * page_size, s_k))
            n = rows.stop - rows.start
            k_pages[table[bi, p], :n] = k[bi, rows]
            v_pages[table[bi, p], :n] = v[bi, rows]
    r = sp.run(q, k_pages, v_pages, causal=True, block_table=table, seqused_k=used)
    for bi in range(b):
        n = used[bi]
        ref, ref_lse = attention(q[bi:bi + 1], k[bi:bi + 1, :n], v[bi:bi + 1, :n], True)
        pt = low_precision(q[bi:bi + 1], k[bi:bi + 1, :n], v[bi:bi + 1, :n], True)
        assert_close_calibrated(r.out[bi:bi + 1], ref, pt, np.float32, what=f"sequence {bi}")
        assert_lse_close(r.lse[bi:bi + 1], ref_lse)


def gate_table(h_q, positions, value):
    return np.full((h_q, positions), value, dtype=np.float32)


POLICIES = {
    "softmax_skip": sp.SoftmaxSkip(block_q=8, block_k=8, a=40.0),
    "estimate_select": sp.EstimateSelect(block=8, alpha=0.5, sink=1, window=1, tail=1),
    "estimate_select_mc_gqa": sp.EstimateSelect(block=8, alpha=0.5, sink=1, window=1, tail=1,
                                                mean_correction=True, pack_gqa=True),
    "permute_stop": sp.PermuteStop(segment=32, tau=0.05, block_q=8, block_k=8),
    "exact_gate": sp.ExactGate(block_q=8, block_k=8, thresholds=gate_table(8, 16, 2.2)),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_cpu_matches_oracle(name):
    policy = POLICIES[name]
    q, k, v = structured_qkv(11, 2, 97, 113, 8, 2, 32)
    cpu = sp.run(q, k, v, policy, causal=True, backend="cpu")
    ref = sp.run(q, k, v, policy, causal=True, backend="reference")
    # Same decisions: identical work accounting per head; outputs within the calibrated bound.
    np.testing.assert_array_equal(cpu.stats.heads, ref.stats.heads)
    assert 0.0 < cpu.stats.density < 1.0, f"{name}: expected some blocks skipped and some kept"
    assert cpu.stats.policy.startswith(policy.name)
    # The bound's scale is the low-precision error of dense attention on these inputs.
    dense_ref, _ = attention(q, k, v, True)
    dense_error = low_precision(q, k, v, True) - dense_ref
    assert_close_calibrated(cpu.out, ref.out, ref.out + dense_error, np.float32)
    finite = np.isfinite(ref.lse)
    assert np.allclose(cpu.lse[finite], ref.lse[finite], atol=1e-4)


# Local windows, softcap, learned sinks and a V head dim of its own (docs/semantics.md §1).
FEATURES = {"window": dict(window_size=(40, 0)), "softcap": dict(softcap=2.0),
            "all": dict(window_size=(30, 0), softcap=3.0, sinks=np.linspace(-1.0, 2.0, 8).astype(np.float32))}


@pytest.mark.parametrize("features", sorted(FEATURES))
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_with_model_family_features_matches_oracle(name, features):
    # The CPU backend makes the oracle's decisions under each feature set (identical work per
    # head; policies decide within the window's blocks) and attends within the calibrated bound;
    # v has head dim 16 (q and k 32). A plan runs as run().
    policy, kw = POLICIES[name], FEATURES[features]
    q, k, _ = structured_qkv(11, 2, 97, 113, 8, 2, 32)
    v = randn(rng(12), (2, 113, 2, 16))
    cpu = sp.run(q, k, v, policy, causal=True, backend="cpu", **kw)
    ref = sp.run(q, k, v, policy, causal=True, backend="reference", **kw)
    np.testing.assert_array_equal(cpu.stats.heads, ref.stats.heads)
    assert cpu.out.shape == (2, 97, 8, 16)
    dense_ref, _ = attention(q, k, v, True)
    dense_error = low_precision(q, k, v, True) - dense_ref
    assert_close_calibrated(cpu.out, ref.out, ref.out + dense_error, np.float32)
    finite = np.isfinite(ref.lse)
    assert np.allclose(cpu.lse[finite], ref.lse[finite], atol=1e-4)
    planned = sp.run(sp.plan(q, k, v, policy, causal=True, backend="cpu", **kw), q, k, v)
    np.testing.assert_array_equal(planned.out, cpu.out)
    assert sp.can_run(q, k, v, policy, causal=True, backend="cpu", **kw) == (True, "")


def test_window_keeps_selections_within_it():
    # estimate_select's selection under a causal window of 24 keys (blocks of 8): no selected
    # block lies outside every row's window, forced sink blocks included.
    q, k, v = structured_qkv(13, 1, 64, 96, 4, 2, 32)
    policy = sp.EstimateSelect(block=8, alpha=0.5, sink=2, window=1, tail=1)
    sel = sp.select(q, k, v, policy, causal=True, window_size=(23, 0))
    dense = sel.mask.to_dense()[0, 0]
    a = np.arange(64) + 32  # positions of the rows
    for qb in range(dense.shape[0]):
        first_key = a[qb * 8] - 23  # the block's first row sees the lowest keys
        assert not dense[qb, :max(first_key, 0) // 8].any(), f"query block {qb} selects a block its window hides"
    assert sel.mask.density < 1.0
    unwindowed = sp.select(q, k, v, policy, causal=True).mask.to_dense()[0, 0]
    assert unwindowed[:, :2].all()  # without the window the sink blocks are forced everywhere


def test_all_kept_policies_equal_dense():
    q, k, v = qkv(12, 2, 64, 64, 4, 2, 32)
    dense = sp.run(q, k, v, causal=True)
    for policy in (sp.ExactGate(block_q=16, block_k=16, thresholds=gate_table(4, 4, -np.inf)),
                   sp.EstimateSelect(block=16, alpha=0.0), sp.SoftmaxSkip(block_q=16, block_k=16, a=1e9)):
        r = sp.run(q, k, v, policy, causal=True)
        assert r.stats.density == 1.0, policy
        np.testing.assert_allclose(r.out, dense.out, atol=2e-6, err_msg=policy.name)


def random_block_map(g, batch, heads, s_q, s_k, bq, bk, p=0.5):
    vis = visible_blocks(s_q, s_k, True, bq, bk)
    return vis & (g.random((batch, heads) + vis.shape) < p)


@pytest.mark.parametrize("per_kv_head", [False, True])
def test_block_sparse_forms_match_expanded_mask(per_kv_head):
    b, s_q, s_k, h_q, h_kv, bq, bk = 2, 37, 50, 4, 2, 8, 16
    q, k, v = qkv(13, b, s_q, s_k, h_q, h_kv, 32)
    heads = h_kv if per_kv_head else h_q
    bmap = random_block_map(rng(5), b, heads, s_q, s_k, bq, bk)
    nqb, nkb = bmap.shape[2:]
    # FlexAttention form: partial blocks (cut by the causal mask) and full blocks separately.
    allowed = allowed_mask(s_q, s_k, True)
    full = np.zeros((nqb, nkb), dtype=bool)
    for qb in range(nqb):
        for kb in range(nkb):
            full[qb, kb] = allowed[qb * bq:(qb + 1) * bq, kb * bk:(kb + 1) * bk].all()
    def flex(sel):
        counts = sel.sum(-1).astype(np.int32)
        idx = np.full(sel.shape, -1, dtype=np.int32)
        for pos in np.ndindex(*sel.shape[:3]):
            found = np.nonzero(sel[pos])[0]
            idx[pos][:found.size] = found[::-1]  # any order is accepted
        return counts, idx
    kv_n, kv_i = flex(bmap & ~full)
    f_n, f_i = flex(bmap & full)
    rows = bmap.reshape(-1, nkb)
    indptr = np.concatenate([[0], np.cumsum(rows.sum(1))]).astype(np.int32)
    indices = np.nonzero(rows)[1].astype(np.int32)
    forms = [
        sp.BlockSparse(kv_num_blocks=kv_n, kv_indices=kv_i, full_kv_num_blocks=f_n, full_kv_indices=f_i,
                       block_q=bq, block_k=bk, per_kv_head=per_kv_head),
        sp.BlockSparse(indptr=indptr, indices=indices, block_q=bq, block_k=bk, per_kv_head=per_kv_head),
        sp.BlockSparse(dense=bmap, block_q=bq, block_k=bk, per_kv_head=per_kv_head),
    ]
    head_map = np.repeat(bmap, h_q // h_kv, axis=1) if per_kv_head else bmap
    mask = expand_blocks(head_map, s_q, s_k, bq, bk)
    ref, ref_lse = attention(q, k, v, True, mask=mask)
    pt = low_precision(q, k, v, True, mask=mask)
    visible = visible_blocks(s_q, s_k, True, bq, bk).sum() * b * h_q
    for policy in forms:
        r = sp.run(q, k, v, policy, causal=True)
        assert_close_calibrated(r.out, ref, pt, np.float32)
        assert_lse_close(r.lse, ref_lse)
        assert r.stats.heads[..., 1].sum() == head_map.sum()
        assert r.stats.density == pytest.approx(head_map.sum() / visible)


def test_block_sparse_rejects_invisible_block():
    q, k, v = qkv(14, 1, 16, 16, 2, 2, 16)
    bmap = np.zeros((1, 2, 2, 2), dtype=bool)
    bmap[0, 0, 0, 1] = True  # keys 8..15 are invisible to queries 0..7 (causal)
    with pytest.raises(sp.InvalidArgumentError):
        sp.run(q, k, v, sp.BlockSparse(dense=bmap, block_q=8, block_k=8), causal=True)


def write_safetensors(path, metadata, tensors):
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        dtype = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}[arr.dtype]
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def calibration_file(path, table):
    layers, budgets, heads, positions = table.shape
    meta = {"format": "sparseprefill.calibration", "format_version": "1", "layers": str(layers),
            "exact_gate.layers": str(layers), "exact_gate.heads": str(heads), "exact_gate.positions": str(positions),
            "exact_gate.block_q": "8", "exact_gate.block_k": "8", "model": "test"}
    write_safetensors(path, meta, {"exact_gate.thresholds": table,
                                   "exact_gate.budgets": np.array([4, 16][:budgets], dtype=np.int32)})


def test_calibration_file_drives_exact_gate(tmp_path):
    table = rng(3).uniform(1.5, 3.0, size=(3, 2, 8, 16)).astype(np.float32)
    table[1, 0, :, :2] = -np.inf
    path = tmp_path / "cal.safetensors"
    calibration_file(path, table)
    cal = sp.load_calibration(path)
    assert cal.gate_budgets == [4, 16] and cal.metadata == {"model": "test"}
    np.testing.assert_array_equal(cal.thresholds(1, 4), table[1, 0])
    q, k, v = qkv(15, 1, 100, 100, 8, 2, 32)
    from_file = sp.run(q, k, v, sp.ExactGate(calibration=str(path), layer=2, budget=16), causal=True)
    given = sp.run(q, k, v, sp.ExactGate(block_q=8, block_k=8, thresholds=table[2, 1]), causal=True)
    np.testing.assert_array_equal(from_file.out, given.out)
    np.testing.assert_array_equal(from_file.stats.heads, given.stats.heads)
    assert from_file.stats.density < 1.0
    with pytest.raises(sp.InvalidArgumentError, match="budget"):
        cal.thresholds(0, 8)
    with pytest.raises(sp.InvalidArgumentError, match="layer"):
        cal.thresholds(3, 4)


@pytest.mark.parametrize("damage,message", [
    ("truncate", "data_offsets|header"),
    ("format", "format"),
    ("shape", "exact_gate.thresholds"),
    ("nan", "finite or -inf"),
    ("section", "missing"),
])
def test_corrupt_calibration_files_raise(tmp_path, damage, message):
    table = np.zeros((2, 1, 4, 3), dtype=np.float32)
    path = tmp_path / "bad.safetensors"
    calibration_file(path, table)
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[:-5])
    else:
        meta = {"format": "sparseprefill.calibration", "format_version": "1", "layers": "2",
                "exact_gate.layers": "2", "exact_gate.heads": "4", "exact_gate.positions": "3",
                "exact_gate.block_q": "8", "exact_gate.block_k": "8"}
        tensors = {"exact_gate.thresholds": table, "exact_gate.budgets": np.array([4], dtype=np.int32)}
        if damage == "format":
            meta["format"] = "something.else"
        elif damage == "shape":
            tensors["exact_gate.thresholds"] = np.zeros((2, 1, 4, 2), dtype=np.float32)
        elif damage == "nan":
            table[0, 0, 1, 2] = np.nan
        elif damage == "section":
            del meta["exact_gate.heads"]
        write_safetensors(path, meta, tensors)
    with pytest.raises(sp.CorruptDataError, match=message):
        sp.load_calibration(path)


def test_missing_calibration_file_raises(tmp_path):
    with pytest.raises(sp.FileError):
        sp.load_calibration(tmp_path / "absent.safetensors")


def test_collect_stats_per_layer_and_head():
    q, k, v = qkv(16, 2, 64, 64, 4, 2, 32)
    gate = sp.ExactGate(block_q=8, block_k=8, thresholds=gate_table(4, 8, 2.0))
    with sp.collect_stats() as outer:
        sp.run(q, k, v, layer=0, stats=False)
        with sp.collect_stats() as inner:
            r = sp.run(q, k, v, gate, layer=1, stats=False)
    assert r.stats is None
    assert len(outer.calls) == 2 and len(inner.calls) == 1
    assert outer.layers() == [0, 1]
    assert outer.density(0) == 1.0
    assert 0.0 < outer.density(1) < 1.0
    per_head = outer.head_density(1)
    assert per_head.shape == (4,)
    direct = sp.run(q, k, v, gate)
    counts = direct.stats.heads.sum(axis=0)
    np.testing.assert_allclose(per_head, counts[:, 1] / counts[:, 0])
    assert "layer 1" in outer.summary()
    sp.run(q, k, v, layer=2)
    assert outer.layers() == [0, 1]  # closed collectors record nothing more


def bad(**overrides):
    q, k, v = qkv(17, 2, 16, 16, 4, 2, 8)
    args = dict(q=q, k=k, v=v)
    args.update(overrides)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    return lambda: sp.run(q, k, v, **args)


BAD_INPUTS = [
    ("dtype", bad(q=np.zeros((2, 16, 4, 8), np.float64)), "q: expected dtype"),
    ("rank", bad(q=np.zeros((16, 4, 8), np.float32)), "cu_seqlens_q: required"),
    ("rank of k", bad(k=np.zeros((32, 2, 8), np.float32), v=np.zeros((32, 2, 8), np.float32)),
     r"k: expected \[b, s_k, h_kv, d\]"),
    ("heads", bad(k=np.zeros((2, 16, 3, 8), np.float32), v=np.zeros((2, 16, 3, 8), np.float32)),
     r"k: h_kv \(3\) must divide h_q \(4\)"),
    ("head dim", bad(k=np.zeros((2, 16, 2, 4), np.float32), v=np.zeros((2, 16, 2, 4), np.float32)),
     "k: expected head_dim 8"),
    ("v shape", bad(v=np.zeros((2, 15, 2, 8), np.float32)), "v: expected the shape of k"),
    ("k dtype", bad(k=np.zeros((2, 16, 2, 8), np.float16)), "k, v: expected q's dtype"),
    ("contiguity", bad(q=np.zeros((2, 16, 4, 16), np.float32)[..., ::2]), "q: the last dimension"),
    ("batch", bad(k=np.zeros((3, 16, 2, 8), np.float32), v=np.zeros((3, 16, 2, 8), np.float32)),
     "k: expected batch 2"),
    ("out shape", bad(out=np.zeros((2, 16, 4, 4), np.float32)), "out: expected q's shape"),
    ("out dtype", bad(out=np.zeros((2, 16, 4, 8), np.float16)), "out: expected q's dtype"),
    ("lse dtype", bad(lse=np.zeros((2, 4, 16), np.float16)), "lse: expected"),
    ("lse shape", bad(lse=np.zeros((2, 16, 4), np.float32)), "lse: expected float32"),
    ("seqused_k range", bad(seqused_k=np.array([16, 17], np.int32)), "seqused_k"),
    ("seqused_k dtype", bad(seqused_k=np.array([16, 16], np.int64)), "seqused_k: expected dtype int32"),
    ("cu_seqlens_q on batched q", bad(cu_seqlens_q=np.array([0, 16, 32], np.int32)), "cu_seqlens_q: given"),
    ("scale", bad(softmax_scale=-1.0), "softmax_scale"),
    ("backend", bad(backend="tpu"), "backend"),
    ("policy type", bad(policy="dense"), "policy: expected"),
    ("policy value", bad(policy=sp.SoftmaxSkip(block_q=0)), "block_q"),
    ("policy value nan", bad(policy=sp.EstimateSelect(alpha=float("nan"))), "alpha"),
    ("thresholds heads", bad(policy=sp.ExactGate(thresholds=np.zeros((3, 4), np.float32))), "thresholds"),
    # FP8 descales (NumPy has no float8_e4m3fn: test_fp8.py covers them on torch tensors).
    ("descale without fp8", bad(k_descale=np.ones((2, 2), np.float32)),
     "k_descale: only with float8_e4m3fn inputs, got float32 inputs"),
    ("can_run descale", lambda: sp.can_run(*qkv(17, 2, 16, 16, 4, 2, 8), v_descale=np.ones((2, 2), np.float32)),
     "v_descale: only with float8_e4m3fn inputs"),
    ("window", bad(window_size=(-3, 0)), r"window_size: left must be -1 \(no bound\)"),
    ("window right", bad(window_size=(4, -2)), r"window_size: right must be -1 \(no bound\)"),
    ("window type", bad(window_size=4), r"window_size: expected \(left, right\), got 4"),
    ("softcap", bad(softcap=-2.0), r"softcap: expected 0 \(none\) or a finite positive number"),
    ("softcap nan", bad(softcap=float("nan")), r"softcap: expected 0 \(none\)"),
    ("sinks shape", bad(sinks=np.zeros(3, np.float32)),
     r"sinks: expected float32 \[h_q\] = \[4\], got float32 \[3\]"),
    ("sinks dtype", bad(sinks=np.zeros(4, np.float16)), r"sinks: expected float32 \[h_q\]"),
    ("v head dim", bad(v=np.zeros((2, 16, 2, 0), np.float32)), "v: head_dim must be positive"),
    ("out head dim", bad(v=np.zeros((2, 16, 2, 4), np.float32), out=np.zeros((2, 16, 4, 8), np.float32)),
     r"out: expected q's shape with v's head dim \[2, 16, 4, 4\]"),
    ("plan softcap", lambda: sp.plan(*qkv(17, 2, 16, 16, 4, 2, 8), softcap=math.inf), "softcap"),
]


@pytest.mark.parametrize("case,call,message", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_name_the_argument(case, call, message):
    with pytest.raises(sp.InvalidArgumentError, match=message):
        call()


def test_varlen_index_errors_surface_library_messages():
    q, k, v = qkv(18, 1, 20, 20, 2, 1, 8)
    qp, kp, vp = q[0], k[0], v[0]
    with pytest.raises(sp.InvalidArgumentError, match="cu_seqlens_q: must be non-decreasing"):
        sp.run(qp, kp, vp, cu_seqlens_q=np.array([0, 12, 10], np.int32), cu_seqlens_k=np.array([0, 10, 20], np.int32))
    with pytest.raises(sp.InvalidArgumentError, match="cu_seqlens_k: last entry 30 exceeds"):
        sp.run(qp, kp, vp, cu_seqlens_q=np.array([0, 10, 20], np.int32), cu_seqlens_k=np.array([0, 10, 30], np.int32))
    pages = np.zeros((4, 8, 1, 8), np.float32)
    with pytest.raises(sp.InvalidArgumentError, match=r"block_table\[0\]\[1\]: page 9 out of range"):
        sp.run(q, pages, pages, block_table=np.array([[0, 9]], np.int32), seqused_k=np.array([16], np.int32))


def test_unsupported_combination_raises_unsupported():
    q, k, v = qkv(19, 1, 16, 16, 2, 2, 8)
    with pytest.raises(sp.UnsupportedError):
        sp.run(q, k, v, sp.EstimateSelect(block=8), causal=False)
    ok, message = sp.can_run(q, k, v, sp.EstimateSelect(block=8), causal=False, backend="cpu")
    assert not ok and message
    assert sp.can_run(q, k, v, causal=True, backend="cpu") == (True, "")


def test_build_info_lists_backends():
    info = sp.build_info()
    assert "backend cpu" in info and "backend reference" in info


def test_calibrator_writes_a_file_the_package_reads(tmp_path):
    """The CPU route of Calibrator: two layers of one structured sample, every section, the
    metadata kept; thresholds keep budget k at the last position (it has enough full blocks);
    bad layers and reserved metadata keys raise with the library's message."""
    cal = sp.Calibrator(2, 4, budgets=[1, 2], skip_targets=[0.3, 0.6], density_targets=[0.5],
                        block_q=16, block_k=16, select_block=16)
    for layer in range(2):
        q, k, _ = structured_qkv(40 + layer, 1, 96, 96, 4, 2, 32, block=16)
        cal.add(layer, q, k)
    path = tmp_path / "cal.safetensors"
    cal.save(path, {"model": "numpy-test"})
    c = sp.load_calibration(path)
    assert c.layers == 2 and c.gate_budgets == [1, 2] and c.gate_block_q == 16
    assert c.gate_values.shape == (2, 2, 4, 6)
    assert np.all(np.isfinite(c.gate_values[:, :, :, 5])) and np.all(np.isneginf(c.gate_values[:, :, :, :2]))
    assert c.skip_a.shape == (2, 2) and np.all(c.skip_a > 0) and np.all(c.skip_a[:, 0] <= c.skip_a[:, 1])
    assert c.metadata["model"] == "numpy-test"
    with pytest.raises(sp.InvalidArgumentError, match="layer: expected 0 .. 1, got 2"):
        cal.add(2, q, k)
    with pytest.raises(sp.InvalidArgumentError, match="reserved"):
        cal.save(path, {"format": "x"})
    with pytest.raises(sp.InvalidArgumentError, match="at least one of budgets"):
        sp.Calibrator(1, 4)
