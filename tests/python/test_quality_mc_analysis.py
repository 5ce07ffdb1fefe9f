# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.quality.mc_analysis.decompose: nothing to correct when every visible block is
kept; the true mass and value of the corrected blocks rebuild dense; blocks of identical keys
make the zero-order mass exact (and identical values its value too); its zero-order column is
the library's mean-corrected output, and the library's selection leaves no visible block both
unkept and uncorrected."""

import numpy as np
import sparseprefill as sp
from sparseprefill.quality import mc_analysis, metrics

BLOCK = 64


def inputs(s=300, h_q=4, h_kv=2, d=16, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((s, h, d)) * 1.5 for h in (h_q, h_kv, h_kv))


def visible(s, h_q):
    """bool [h_q, nqb, nkb]: key blocks a causal query block sees at all."""
    n = (s + BLOCK - 1) // BLOCK
    return np.broadcast_to(np.tril(np.ones((n, n), dtype=bool)), (h_q, n, n)).copy()


def split(s, h_q):
    """Kept: the diagonal block and block 0; corrected: the other blocks before the diagonal."""
    vis = visible(s, h_q)
    kept = vis & (np.eye(vis.shape[1], dtype=bool)[None] | (np.arange(vis.shape[2]) == 0)[None, None])
    return kept, vis & ~kept


def test_every_visible_block_kept_leaves_nothing_to_correct():
    q, k, v = inputs()
    kept = visible(q.shape[0], q.shape[1])
    r = mc_analysis.decompose(q, k, v, [kept], [np.zeros_like(kept)], BLOCK)[0]
    assert all(r[name] < 1e-12 for name in mc_analysis.VARIANTS)
    assert r["mass_share"] is None


def test_true_mass_and_value_rebuild_dense():
    q, k, v = inputs(seed=1)
    kept, corrected = split(q.shape[0], q.shape[1])
    r = mc_analysis.decompose(q, k, v, [kept], [corrected], BLOCK)[0]
    assert r["exact"] < 1e-12
    assert r["none"] > 1e-2  # the corrected blocks carry real mass here
    assert 0.0 < r["mass_share"] < 1.0  # Jensen: e^{mean score} < mean of e^{score}


def test_identical_keys_in_a_block_make_the_zero_order_mass_exact():
    q, k, v = inputs(s=256, seed=2)
    for j in range(0, 256, BLOCK):
        k[j:j + BLOCK] = k[j]  # every key of a block equal: s_t = s(k̄)
    kept, corrected = split(256, q.shape[1])
    r = mc_analysis.decompose(q, k, v, [kept], [corrected], BLOCK)[0]
    assert abs(r["mass_share"] - 1.0) < 1e-12
    assert abs(r["zero_order"] - r["exact_mass"]) < 1e-12 and abs(r["exact_value"] - r["exact"]) < 1e-12
    for j in range(0, 256, BLOCK):
        v[j:j + BLOCK] = v[j]  # and every value: the pseudo-token is the block
    r = mc_analysis.decompose(q, k, v, [kept], [corrected], BLOCK)[0]
    assert r["zero_order"] < 1e-12


def test_zero_order_is_the_library_mean_correction():
    q, k, v = inputs(s=700, seed=3)
    # Every third key block shares a direction with the queries: the selector prunes the rest.
    w = np.random.default_rng(4).standard_normal(q.shape[2])
    q += w
    for j in range(0, 700, 3 * BLOCK):
        k[j:j + BLOCK] += w
    q, k, v = (x.astype(np.float32)[None] for x in (q, k, v))
    dense = sp.run(q, k, v, sp.Dense(), causal=True, backend="cpu").out
    kept, corrected, lib = [], [], []
    for alpha in (0.05, 0.5):
        policy = sp.EstimateSelect(block=BLOCK, alpha=alpha, sink=1, window=2, tail=1, mean_correction=True)
        sel = sp.select(q, k, v, policy, causal=True, backend="cpu")
        kept.append(sel.mask.to_dense()[0])
        corrected.append(sel.corrected.to_dense()[0])
        lib.append(metrics.relative_error(sp.run(q, k, v, policy, causal=True, backend="cpu").out, dense))
    got = mc_analysis.decompose(q[0], k[0], v[0], kept, corrected, BLOCK)
    assert any(c.any() for c in corrected)
    for r, want in zip(got, lib):
        assert abs(r["zero_order"] - want) < 1e-5 * max(want, 1e-3)
        assert r["exact"] < 1e-12  # every visible block is kept or corrected

