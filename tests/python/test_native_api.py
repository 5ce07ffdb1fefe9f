# SPDX-License-Identifier: Apache-2.0
"""The native select / plan / run API on NumPy arrays (CPU backend; no torch needed):
select() returns exactly the selection run() makes, with its density; a selection run as a
block mask equals attention under the expanded mask; run(plan, ...) gives run()'s bits,
statistics and decisions, follows new data, and refuses other shapes; decisions of the
in-kernel policies come back from run(decisions=True)."""

import numpy as np
import pytest

import sparseprefill as sp
from _refs import assert_close_calibrated, assert_lse_close, attention, expand_blocks, low_precision, visible_blocks
from test_numpy_binding import POLICIES, calibration_file, cu, qkv, structured_qkv

SELECT = sp.EstimateSelect(block=8, alpha=0.5, sink=1, window=1, tail=1, mean_correction=True)


def assert_same_mask(a, b):
    assert (a.batch, a.heads, a.num_q_blocks, a.num_k_blocks, a.block_q, a.block_k, a.per_kv_head) == \
           (b.batch, b.heads, b.num_q_blocks, b.num_k_blocks, b.block_q, b.block_k, b.per_kv_head)
    np.testing.assert_array_equal(a.indptr, b.indptr)
    np.testing.assert_array_equal(a.indices, b.indices)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("pack_gqa", [False, True])
def test_select_equals_run_decisions(backend, pack_gqa):
    q, k, v = structured_qkv(21, 2, 60, 90, 4, 2, 32)
    policy = sp.EstimateSelect(block=8, alpha=0.5, sink=1, window=1, tail=1, mean_correction=True, pack_gqa=pack_gqa)
    sel = sp.select(q, k, v, policy, backend=backend)
    ran = sp.run(q, k, v, policy, backend=backend, decisions=True)
    assert ran.decisions.policy == "estimate_select"
    assert_same_mask(sel.mask, ran.decisions.kept)
    assert_same_mask(sel.corrected, ran.decisions.corrected)
    np.testing.assert_array_equal(sel.stats.heads, ran.stats.heads)
    assert 0.0 < sel.mask.density < 1.0, "the selection must skip something for this test to mean anything"
    assert sel.mask.density == pytest.approx(sel.stats.density)
    assert sel.corrected.indices.size > 0
    heads = 2 if pack_gqa else 4
    assert sel.mask.heads == heads and sel.mask.per_kv_head == pack_gqa
    # Every selected block is causally visible, and the dense map has the CSR's blocks.
    dense = sel.mask.to_dense()
    assert dense.shape == (2, heads, 8, 12)
    vis = visible_blocks(60, 90, True, 8, 8)
    assert not (dense & ~vis).any()
    assert dense.sum() == sel.mask.indices.size
    np.testing.assert_array_equal(sel.mask.counts(), dense.sum(-1))


def test_selection_runs_as_block_mask():
    q, k, v = structured_qkv(22, 1, 64, 64, 4, 4, 32)
    policy = sp.EstimateSelect(block=8, alpha=0.5, sink=1, window=1, tail=1)
    sel = sp.select(q, k, v, policy)
    plan = sp.plan(q, k, v, sel.mask.to_policy())
    r = sp.run(plan, q, k, v)
    mask = expand_blocks(sel.mask.to_dense(), 64, 64, 8, 8)
    ref, ref_lse = attention(q, k, v, True, mask=mask)
    assert_close_calibrated(r.out, ref, low_precision(q, k, v, True, mask=mask), np.float32)
    assert_lse_close(r.lse, ref_lse)
    assert r.stats.density == pytest.approx(sel.mask.density)
    direct = sp.run(q, k, v, policy)
    assert_close_calibrated(direct.out, ref, low_precision(q, k, v, True, mask=mask), np.float32)


def test_select_dense_and_block_sparse():
    q, k, v = qkv(23, 2, 300, 400, 2, 1, 16)
    sel = sp.select(q, k, v)
    np.testing.assert_array_equal(sel.mask.to_dense(), np.broadcast_to(visible_blocks(300, 400, True, 128, 128),
                                                                       (2, 2, 3, 4)))
    assert sel.mask.density == 1.0 and sel.corrected is None
    bmap = visible_blocks(300, 400, True, 64, 32) & (np.arange(13)[None, :] % 3 != 0)
    given = np.broadcast_to(bmap, (2, 2) + bmap.shape)
    sel = sp.select(q, k, v, sp.BlockSparse(dense=given, block_q=64, block_k=32))
    np.testing.assert_array_equal(sel.mask.to_dense(), given)
    assert sel.mask.density == pytest.approx(given.sum() / (visible_blocks(300, 400, True, 64, 32).sum() * 4))


@pytest.mark.parametrize("name", ["softmax_skip", "exact_gate", "permute_stop"])
def test_select_of_in_kernel_policies_is_unsupported(name):
    q, k, v = qkv(24, 1, 40, 40, 8, 2, 32)
    with pytest.raises(sp.UnsupportedError, match=r"run\(\)"):
        sp.select(q, k, v, POLICIES[name])


def layouts(seed):
    """(name, q, k, v, kwargs) of one problem in the batched and the varlen layout."""
    q, k, v = structured_qkv(seed, 2, 48, 80, 8, 2, 32)
    yield "batched", q, k, v, {}
    lens_q, lens_k = [48, 30], [80, 45]
    qv = np.concatenate([q[0, :lens_q[0]], q[1, :lens_q[1]]])
    kv_ = np.concatenate([k[0, :lens_k[0]], k[1, :lens_k[1]]])
    vv = np.concatenate([v[0, :lens_k[0]], v[1, :lens_k[1]]])
    yield "varlen", qv, kv_, vv, {"cu_seqlens_q": cu(lens_q), "cu_seqlens_k": cu(lens_k)}


@pytest.mark.parametrize("name", sorted(POLICIES) + ["dense", "block_sparse"])
def test_plan_run_equals_run(name):
    for layout, q, k, v, kw in layouts(25):
        extra = {"dense": sp.Dense(),
                 "block_sparse": sp.BlockSparse(dense=visible_blocks(48, 80, True, 8, 8)[None, None]
                                                & (np.arange(10) % 2 == 0), block_q=8, block_k=8)}
        policy = extra[name] if name in extra else POLICIES[name]
        if layout == "varlen" and name == "block_sparse":
            continue  # a dense map broadcast over the batch needs equal lengths
        plan = sp.plan(q, k, v, policy, backend="cpu", **kw)
        assert plan.describe().startswith(policy.name)
        for seed in (0, 1):
            qq = q + np.float32(seed) * np.float32(0.25)  # new contents, same shapes
            direct = sp.run(qq, k, v, policy, backend="cpu", num_threads=1, decisions=True, **kw)
            planned = sp.run(plan, qq, k, v, num_threads=1, decisions=True, **kw)
            np.testing.assert_array_equal(planned.out, direct.out, err_msg=f"{name} {layout}")
            np.testing.assert_array_equal(planned.lse, direct.lse)
            np.testing.assert_array_equal(planned.stats.heads, direct.stats.heads)
            assert planned.decisions.policy == direct.decisions.policy
            for part in ("kept", "corrected"):
                a, b = getattr(planned.decisions, part), getattr(direct.decisions, part)
                assert (a is None) == (b is None)
                if a is not None:
                    assert_same_mask(a, b)
            np.testing.assert_array_equal(planned.decisions.tiles, direct.decisions.tiles)
            np.testing.assert_array_equal(planned.decisions.query_order, direct.decisions.query_order)


def test_plan_refuses_other_shapes():
    q, k, v = qkv(26, 1, 40, 40, 4, 2, 32)
    plan = sp.plan(q, k, v, sp.SoftmaxSkip(block_q=8, block_k=8))
    q2, k2, v2 = qkv(26, 1, 40, 41, 4, 2, 32)
    with pytest.raises(sp.InvalidArgumentError, match="does not match the plan: key lengths"):
        sp.run(plan, q2, k2, v2)
    q3, k3, v3 = qkv(26, 1, 40, 40, 8, 2, 32)
    with pytest.raises(sp.InvalidArgumentError, match="does not match the plan: h_q"):
        sp.run(plan, q3, k3, v3)
    with pytest.raises(sp.InvalidArgumentError, match="out"):
        sp.run(plan, q, k, v, out=np.empty((1, 40, 4, 16), dtype=np.float32))
    with pytest.raises(TypeError):
        sp.run(plan, q, k, v, policy=sp.Dense())  # the plan's policy is fixed
    # A mask the geometry does not allow (blocks above the causal diagonal) never makes a plan.
    with pytest.raises(sp.InvalidArgumentError, match="not visible"):
        sp.plan(q, k, v, sp.BlockSparse(dense=np.ones((1, 1, 5, 5), dtype=bool), block_q=8, block_k=8))


def test_decisions_of_in_kernel_policies():
    q, k, v = structured_qkv(27, 2, 64, 64, 8, 2, 32)
    skip = sp.run(q, k, v, POLICIES["softmax_skip"], decisions=True)
    kept = skip.decisions.kept
    assert kept.block_q == 8 and kept.heads == 8
    assert kept.indices.size == skip.stats.heads[..., 1].sum()
    assert kept.density == pytest.approx(skip.stats.density)
    stop = sp.run(q, k, v, POLICIES["permute_stop"], decisions=True)
    assert stop.decisions.kept is None
    tiles = stop.decisions.tiles
    assert tiles.shape[1] == len(sp.native.TILE_COLUMNS) and tiles.shape[0] > 0
    assert (tiles[:, 4] <= tiles[:, 5]).all()  # chunks_visited <= chunks_total
    order = stop.decisions.query_order
    assert order.shape == (2, 8, 64)
    for b in range(2):
        for h in range(8):
            assert sorted(order[b, h]) == list(range(64))  # a permutation of the rows
    dense = sp.run(q, k, v, decisions=True)
    assert dense.decisions.policy == "dense" and dense.decisions.kept is None


def test_plan_with_calibrated_thresholds_and_collected_stats(tmp_path):
    table = np.random.default_rng(3).uniform(1.5, 3.0, size=(3, 2, 8, 16)).astype(np.float32)
    path = tmp_path / "cal.safetensors"
    calibration_file(path, table)
    q, k, v = qkv(28, 1, 100, 100, 8, 2, 32)
    gate = sp.ExactGate(calibration=str(path), layer=2, budget=16)
    plan = sp.plan(q, k, v, gate)
    del gate  # the plan keeps the policy and its table alive
    given = sp.run(q, k, v, sp.ExactGate(block_q=8, block_k=8, thresholds=table[2, 1]))
    with sp.collect_stats() as log:
        for layer in range(2):
            r = sp.run(plan, q, k, v, layer=layer)
            np.testing.assert_array_equal(r.out, given.out)
    assert log.layers() == [0, 1]
    assert log.density(0) == pytest.approx(given.stats.density) and given.stats.density < 1.0


def test_block_mask_helpers():
    m = sp.BlockMask(np.array([0, 2, 2, 3], dtype=np.int32), np.array([0, 3, 1], dtype=np.int32), batch=1,
                     heads=1, num_q_blocks=3, num_k_blocks=4, block_q=8, block_k=8, per_kv_head=False)
    np.testing.assert_array_equal(m.to_dense()[0, 0], [[1, 0, 0, 1], [0, 0, 0, 0], [0, 1, 0, 0]])
    np.testing.assert_array_equal(m.counts()[0, 0], [2, 0, 1])
    policy = m.to_policy()
    assert isinstance(policy, sp.BlockSparse) and policy.block_q == 8


def block_means(x, block):
    """Means of the complete blocks of x [b, s, h, d] as the library stores them: summed in
    float64, rounded to float32 (the inputs' dtype here), as [b, h, blocks, d]."""
    b, s, h, d = x.shape
    n = s // block
    m = x[:, :n * block].astype(np.float64).reshape(b, n, block, h, d).sum(axis=2) / block
    return m.astype(np.float32).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_estimate_select_chunked_prefill_with_cached_means(backend):
    """A prompt prefilled in chunks of 24 (a multiple of the block) with prompt_len and the
    cache of block means kept across the chunks decides exactly as the one-shot call (the tail
    is the prompt's), matches its output, and the cache holds the means of the complete blocks
    (NaN past them: never written)."""
    b, s, h_q, h_kv, d, block = 2, 72, 4, 2, 32, 8
    q, k, v = structured_qkv(61, b, s, s, h_q, h_kv, d)
    base = dict(block=block, alpha=0.5, sink=1, window=1, tail=2, mean_correction=True)
    one_shot = sp.run(q, k, v, sp.EstimateSelect(**base), backend=backend, decisions=True)
    kept = one_shot.decisions.kept.to_dense()
    corrected = one_shot.decisions.corrected.to_dense()
    km = np.full((b, h_kv, s // block, d), np.nan, dtype=np.float32)
    vm = np.full_like(km, np.nan)
    valid = np.zeros(b, dtype=np.int32)
    prompt_len = np.full(b, s, dtype=np.int32)
    policy = sp.EstimateSelect(**base, prompt_len=prompt_len, k_block_means=km, v_block_means=vm,
                               block_means_valid=valid)
    for c0 in range(0, s, 24):
        c1 = c0 + 24
        r = sp.run(np.ascontiguousarray(q[:, c0:c1]), np.ascontiguousarray(k[:, :c1]),
                   np.ascontiguousarray(v[:, :c1]), policy, backend=backend, decisions=True)
        rows = slice(c0 // block, c1 // block)
        np.testing.assert_array_equal(r.decisions.kept.to_dense(), kept[:, :, rows, :c1 // block])
        np.testing.assert_array_equal(r.decisions.corrected.to_dense(), corrected[:, :, rows, :c1 // block])
        np.testing.assert_allclose(r.out, one_shot.out[:, c0:c1], rtol=1e-5, atol=1e-5)
        valid[:] = c1 // block  # the blocks this chunk completed are in the cache now
    np.testing.assert_array_equal(km, block_means(k, block))
    np.testing.assert_array_equal(vm, block_means(v, block))


def test_estimate_select_cached_means_errors_name_the_argument():
    q, k, v = structured_qkv(62, 1, 16, 32, 2, 1, 32)
    km = np.zeros((1, 1, 4, 32), dtype=np.float32)
    with pytest.raises(sp.InvalidArgumentError, match="block_means_valid"):
        sp.run(q, k, v, sp.EstimateSelect(block=8, k_block_means=km, v_block_means=km), backend="cpu")
    with pytest.raises(sp.InvalidArgumentError, match=r"block_means_valid\[0\]"):
        sp.run(q, k, v, sp.EstimateSelect(block=8, k_block_means=km, v_block_means=km.copy(),
                                          block_means_valid=np.array([5], dtype=np.int32)), backend="cpu")
    with pytest.raises(sp.InvalidArgumentError, match=r"prompt_len\[0\]"):
        sp.run(q, k, v, sp.EstimateSelect(block=8, prompt_len=np.array([31], dtype=np.int32)), backend="cpu")
