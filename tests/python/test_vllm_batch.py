# SPDX-License-Identifier: Apache-2.0
"""sparseprefill.vllm's batch split (pure): which requests of a vLLM step run FLASH_ATTN and
which our policy, with bottom-right offsets for chunked prefill and prefix-cache hits, in mixed,
unsorted, padded, all-decode and empty batches; and the benchmark setting's synthetic masks,
whose blocks are exactly the causally visible ones the library accepts."""

import math

import numpy as np
import pytest

import sparseprefill as sp
from _refs import allowed_mask
from sparseprefill.vllm import flex_lists, split_batch, synthetic_mask


def batch(*requests):
    """(query_len, seq_len) pairs -> (query_start_loc, seq_lens) as vLLM's CPU metadata."""
    q = np.array([r[0] for r in requests], dtype=np.int32)
    return np.concatenate([[0], np.cumsum(q)]).astype(np.int32), np.array([r[1] for r in requests], dtype=np.int32)


def test_mixed_batch_decodes_first_then_by_query_length():
    # MRV2's order: 3 decodes (long contexts), a short prefill, a prefix-cache hit, a long chunk.
    qsl, lens = batch((1, 9000), (1, 20000), (1, 50), (300, 300), (904, 5000), (8192, 40960))
    s = split_batch(qsl, lens, min_sparse_len=4096)
    assert [(r.rows, r.tokens) for r in s.dense] == [((0, 4), (0, 303))]
    (run,) = s.sparse
    assert run.tokens == (303, 303 + 904 + 8192)
    assert run.rows.tolist() == [4, 5]
    assert run.cu_seqlens_q.tolist() == [0, 904, 904 + 8192] and run.cu_seqlens_q.dtype == np.int32
    assert run.seqused_k.tolist() == [5000, 40960] and run.seqused_k.dtype == np.int32
    # Bottom-right causal: the keys before each request's queries are its context.
    assert run.context_lens.tolist() == [5000 - 904, 40960 - 8192]
    assert run.max_seqlen_q == 8192 and not s.all_dense


def test_a_chunk_counts_its_context_and_a_short_one_stays_dense():
    qsl, lens = batch((2048, 10240), (512, 3000))
    s = split_batch(qsl, lens, min_sparse_len=4096)
    (run,) = s.sparse
    assert run.rows.tolist() == [0] and run.context_lens.tolist() == [8192] and run.tokens == (0, 2048)
    assert [(r.rows, r.tokens) for r in s.dense] == [((1, 2), (2048, 2560))]


@pytest.mark.parametrize("seq,q,sparse", [(4096, 4096, True), (4095, 4095, False), (4096, 2, True),
                                          (4096, 1, False), (100000, 1, False)])
def test_thresholds_are_inclusive_and_decodes_always_dense(seq, q, sparse):
    s = split_batch(*batch((q, seq)), min_sparse_len=4096)
    assert bool(s.sparse) == sparse and bool(s.dense) != sparse


def test_spec_decode_rows_under_a_raised_threshold_stay_dense():
    qsl, lens = batch((3, 50000), (6000, 6000))
    assert split_batch(qsl, lens, 4096, decode_threshold=1).sparse[0].rows.tolist() == [0, 1]
    s = split_batch(qsl, lens, 4096, decode_threshold=3)
    assert [r.rows for r in s.dense] == [(0, 1)] and s.sparse[0].rows.tolist() == [1]


def test_all_decode_and_empty_batches():
    s = split_batch(*batch((1, 100), (1, 70000), (1, 5)), min_sparse_len=4096)
    assert s.all_dense and [(r.rows, r.tokens) for r in s.dense] == [((0, 3), (0, 3))]
    s = split_batch(np.array([0], np.int32), np.zeros(0, np.int32), 4096)
    assert s.all_dense and s.dense == () and s.sparse == ()
    s = split_batch(*batch((0, 0), (0, 0)), min_sparse_len=4096)
    assert s.dense == () and s.sparse == ()


def test_padding_requests_never_split_a_run_and_are_not_computed():
    # A padding request (no query) between two long prefills, and two at the end (vLLM pads the
    # request count; padded seq_lens are 0).
    qsl, lens = batch((1, 10), (5000, 5000), (0, 0), (6000, 7000), (0, 0), (0, 0))
    s = split_batch(qsl, lens, 4096)
    assert [(r.rows, r.tokens) for r in s.dense] == [((0, 1), (0, 1))]
    (run,) = s.sparse
    assert run.rows.tolist() == [1, 3] and run.tokens == (1, 11001)
    assert run.cu_seqlens_q.tolist() == [0, 5000, 11000] and run.seqused_k.tolist() == [5000, 7000]
    # Leading padding takes the first real request's kind.
    s = split_batch(*batch((0, 0), (5000, 5000), (1, 9)), 4096)
    assert s.sparse[0].rows.tolist() == [1] and [r.rows for r in s.dense] == [(2, 3)]


def test_any_order_is_served_as_runs():
    # The V1 runner without reordering: kinds interleave; each stretch is one call.
    qsl, lens = batch((1, 10), (5000, 5000), (5000, 9000), (30, 30), (1, 8000), (4096, 4096))
    s = split_batch(qsl, lens, 4096)
    assert [(r.rows, r.tokens) for r in s.dense] == [((0, 1), (0, 1)), ((3, 5), (10001, 10032))]
    assert [(r.rows.tolist(), r.tokens) for r in s.sparse] == [([1, 2], (1, 10001)), ([5], (10032, 14128))]


def test_random_batches_keep_the_invariants():
    g = np.random.default_rng(5)
    for _ in range(300):
        n = int(g.integers(0, 12))
        q = g.choice([0, 1, 1, 7, 300, 5000, 9000], size=n)
        ctx = g.choice([0, 0, 64, 4000, 30000], size=n)
        lens = np.where(q == 0, 0, q + ctx)
        qsl = np.concatenate([[0], np.cumsum(q)])
        s = split_batch(qsl, lens, 4096)
        sparse_rows = [int(r) for run in s.sparse for r in run.rows]
        assert sparse_rows == [r for r in range(n) if q[r] > 1 and lens[r] >= 4096]
        dense_rows = [r for run in s.dense for r in range(*run.rows) if q[r] > 0]
        assert dense_rows == [r for r in range(n) if 0 < q[r] and not (q[r] > 1 and lens[r] >= 4096)]
        # The runs' token ranges tile the step's tokens, in order, with no overlap.
        spans = sorted([r.tokens for r in s.dense] + [r.tokens for r in s.sparse])
        assert sum(b - a for a, b in spans) == int(qsl[-1])
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
        for run in s.sparse:
            np.testing.assert_array_equal(run.cu_seqlens_q + run.tokens[0], np.concatenate(
                [[qsl[run.rows[0]]], qsl[run.rows + 1]]))
            assert run.tokens[1] - run.tokens[0] == int(run.cu_seqlens_q[-1])


@pytest.mark.parametrize("qsl,lens,message", [
    ([0, 5, 3], [5, 5], r"query_start_loc: expected non-decreasing starts"),
    ([0, 5, 9], [5, 3], r"seq_lens\[1\]: 3 keys for 4 queries"),
    ([0, 5, 9], [5], r"seq_lens: expected at least 2 entries"),
    (np.zeros(0, np.int32), [], "query_start_loc: expected num_reqs \\+ 1 entries"),
    ([[0, 1]], [1], "query_start_loc: expected a 1-D integer array"),
    ([0.0, 1.0], [1], "query_start_loc: expected a 1-D integer array"),
])
def test_metadata_that_is_not_a_batch_is_refused(qsl, lens, message):
    with pytest.raises(ValueError, match=message):
        split_batch(np.array(qsl), np.array(lens), 4096)


def test_seq_lens_past_the_requests_are_ignored():
    qsl, lens = batch((5000, 5000))
    s = split_batch(qsl, np.concatenate([lens, [7, 7, 7]]), 4096)
    assert s.sparse[0].seqused_k.tolist() == [5000]


# -- the benchmark setting's masks ----------------------------------------------------------------

def visible_blocks(q_len, k_len, block):
    """bool [num_q_blocks, num_k_blocks] from the token-level causal mask (the test's oracle)."""
    allowed = allowed_mask(q_len, k_len, True)
    nqb, nkb = math.ceil(q_len / block), math.ceil(k_len / block)
    out = np.zeros((nqb, nkb), dtype=bool)
    for qb in range(nqb):
        for kb in range(nkb):
            out[qb, kb] = allowed[qb * block:(qb + 1) * block, kb * block:(kb + 1) * block].any()
    return out


@pytest.mark.parametrize("density", [0.05, 0.1, 0.2, 0.5, 1.0])
def test_synthetic_masks_keep_their_density_of_the_visible_blocks(density):
    q_lens, k_lens, block = [640, 300, 64], [640, 1300, 2000], 16
    mask = synthetic_mask(q_lens, k_lens, block, density)
    assert mask.shape == (3, 1, 40, 125) and mask.dtype == bool
    for b, (ql, kl) in enumerate(zip(q_lens, k_lens)):
        vis = visible_blocks(ql, kl, block)
        got = mask[b, 0, :vis.shape[0], :vis.shape[1]]
        assert not (got & ~vis).any(), "a listed block is not causally visible"
        assert not mask[b, 0, vis.shape[0]:].any() and not mask[b, 0, :, vis.shape[1]:].any()
        for qb in range(vis.shape[0]):
            visible = int(vis[qb].sum())
            last = int(np.flatnonzero(vis[qb])[-1])
            assert got[qb, last], "the diagonal block is kept"
            assert int(got[qb].sum()) == max(1, round(density * visible))
            if got[qb].sum() > 1:
                assert got[qb, 0]  # the spread starts at the first block
    if density == 1.0:
        assert all((mask[b, 0, :v.shape[0], :v.shape[1]] == v).all()
                   for b, v in enumerate(visible_blocks(ql, kl, block) for ql, kl in zip(q_lens, k_lens)))


def test_synthetic_masks_run_at_their_density_in_the_library():
    """The library accepts the mask on a varlen chunked batch (every block visible in its
    bottom-right geometry) and reports the mask's own density."""
    q_lens, k_lens, block, density = [96, 40], [96, 200], 16, 0.3
    mask = synthetic_mask(q_lens, k_lens, block, density)
    g = np.random.default_rng(3)
    q = g.standard_normal((sum(q_lens), 4, 32)).astype(np.float32)
    k = g.standard_normal((sum(k_lens), 2, 32)).astype(np.float32)
    v = g.standard_normal((sum(k_lens), 2, 32)).astype(np.float32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    r = sp.run(q, k, v, sp.BlockSparse(dense=mask, block_q=block, block_k=block), causal=True, cu_seqlens_q=cu_q,
               cu_seqlens_k=cu_k, backend="cpu")
    kept = sum(int(mask[b, 0].sum()) for b in range(2))
    visible = sum(int(visible_blocks(ql, kl, block).sum()) for ql, kl in zip(q_lens, k_lens))
    assert r.stats.density == pytest.approx(kept / visible)
    assert 0.25 < r.stats.density < 0.45


@pytest.mark.parametrize("args,message", [
    (([4], [3], 16, 0.5), "0 <= query_len <= key_len"),
    (([4, 4], [8], 16, 0.5), "expected equal lengths"),
    (([4], [8], 0, 0.5), "expected block >= 1"),
    (([4], [8], 16, 0.0), "density in \\(0, 1\\]"),
])
def test_synthetic_mask_refuses_bad_geometry(args, message):
    with pytest.raises(ValueError, match=message):
        synthetic_mask(*args)


def test_flex_lists_hold_each_rows_blocks_ascending():
    g = np.random.default_rng(5)
    mask = g.random((2, 3, 5, 7)) < 0.4
    mask[0, 0, 0] = False  # an empty row
    mask[1, 2, 4] = True  # a full row
    counts, indices = flex_lists(mask)
    assert counts.dtype == np.int32 and indices.dtype == np.int32 and indices.flags.c_contiguous
    assert counts.shape == (2, 3, 5) and indices.shape == (2, 3, 5, 7)
    for row in np.ndindex(counts.shape):
        n = int(counts[row])
        assert n == int(mask[row].sum())
        assert indices[row][:n].tolist() == np.flatnonzero(mask[row]).tolist()
        assert not indices[row][n:].any()
    counts, indices = flex_lists(np.zeros((1, 1, 2, 3), dtype=bool))
    assert counts.tolist() == [[[0, 0]]] and indices.shape == (1, 1, 2, 1)


def test_flex_lists_run_as_the_block_map_does():
    """The synthetic mask in list form (as the backend hands it to the device) and as a block
    map give the same output and density on the library's CPU backend."""
    q_lens, k_lens, block = [96, 40], [96, 200], 16
    mask = synthetic_mask(q_lens, k_lens, block, 0.3)
    counts, indices = flex_lists(mask)
    g = np.random.default_rng(4)
    q = g.standard_normal((sum(q_lens), 4, 32)).astype(np.float32)
    k = g.standard_normal((sum(k_lens), 2, 32)).astype(np.float32)
    v = g.standard_normal((sum(k_lens), 2, 32)).astype(np.float32)
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32)
    runs = [sp.run(q, k, v, policy, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="cpu")
            for policy in (sp.BlockSparse(dense=mask, block_q=block, block_k=block),
                           sp.BlockSparse(kv_num_blocks=counts, kv_indices=indices, block_q=block, block_k=block))]
    assert np.array_equal(runs[0].out, runs[1].out)
    assert runs[0].stats.density == runs[1].stats.density < 0.5


def test_flex_lists_refuse_what_is_not_a_block_map():
    with pytest.raises(ValueError, match="bool block map"):
        flex_lists(np.ones((2, 3, 4), dtype=bool))
    with pytest.raises(ValueError, match="bool block map"):
        flex_lists(np.ones((1, 1, 2, 3), dtype=np.int32))
