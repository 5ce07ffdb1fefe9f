# SPDX-License-Identifier: Apache-2.0
"""Checks the ctypes mirror (sp_ctypes.py) against libsparseprefill_c on the CPU, without a GPU
or torch: a struct laid out differently from c_api.h gives wrong numbers or errors here.
Usage: python3 bench/check_sp_ctypes.py build/<dir>/src/api/libsparseprefill_c.so"""
import ctypes
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sp_ctypes  # noqa: E402


def view(a, dtype=sp_ctypes.DTYPE_FP32):
    return sp_ctypes.tensor(a.ctypes.data, dtype, sp_ctypes.DEVICE_CPU, 0, list(a.shape),
                            [s // a.itemsize for s in a.strides])


def attention(q, k, v, keep=None, block=8):
    """fp64 causal GQA attention on [1, s, h, d] (s_q = s_k); keep [h_q, nb, nb] limits the
    key blocks each query block sees."""
    _, s, h_q, d = q.shape
    group = h_q // k.shape[2]
    o = np.zeros((s, h_q, d))
    for h in range(h_q):
        scores = q[0, :, h].astype(np.float64) @ k[0, :, h // group].T.astype(np.float64)
        scores /= np.sqrt(d)
        allowed = np.tril(np.ones((s, s), dtype=bool))
        if keep is not None:
            allowed &= np.kron(keep[h], np.ones((block, block), dtype=bool))[:s, :s]
        scores[~allowed] = -np.inf
        p = np.exp(scores - scores.max(1, keepdims=True))
        o[:, h] = (p / p.sum(1, keepdims=True)) @ v[0, :, h // group].astype(np.float64)
    return o


def e4m3_values():
    """float64 [256]: the value of every FP8 E4M3 code (bias 7, subnormals, S.1111.111 NaN)."""
    codes = np.arange(256)
    e, m = (codes >> 3) & 15, codes & 7
    mag = np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))
    mag[(e == 15) & (m == 7)] = np.nan
    return np.where(codes & 0x80, -mag, mag)


def bf16_to_float(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


def check_fp8(lib, rng, opts, s, h_q, h_kv, d):
    """FP8 inputs with descales (the fields after block_table): O (bf16) against fp64 attention
    on the dequantized values, each descale element reaching its own heads, and descales
    refused with fp32 inputs."""
    table = e4m3_values()
    finite = np.flatnonzero(np.isfinite(table))

    def fp8(shape):  # the code nearest to each of a normal sample
        x = rng.standard_normal(shape)
        return finite[np.abs(table[finite][None, :] - x.reshape(-1, 1)).argmin(1)].astype(np.uint8).reshape(shape)
    q, k, v = fp8((1, s, h_q, d)), fp8((1, s, h_kv, d)), fp8((1, s, h_kv, d))
    descales = [np.array([[0.7, 1.3]], dtype=np.float32), np.array([[1.1, 0.6]], dtype=np.float32),
                np.array([[0.9, 2.0]], dtype=np.float32)]
    problem = sp_ctypes.Problem()
    problem.q, problem.k, problem.v = (view(x, sp_ctypes.DTYPE_FP8_E4M3) for x in (q, k, v))
    problem.q_descale, problem.k_descale, problem.v_descale = (view(x) for x in descales)
    problem.causal, problem.scale = 1, 0.0
    o = np.full((1, s, h_q, d), 0x7FC1, dtype=np.uint16)  # bf16 NaN
    out = sp_ctypes.Output(view(o, sp_ctypes.DTYPE_BF16), sp_ctypes.Tensor())
    dense = lib.policy("dense")

    def run():
        o.fill(0x7FC1)
        lib.check(lib.run(problem, dense, out, opts))
        return bf16_to_float(o)[0].astype(np.float64)
    group = h_q // h_kv
    ref = attention(table[q] * np.repeat(descales[0], group, 1)[:, None, :, None],
                    table[k] * descales[1][:, None, :, None], table[v] * descales[2][:, None, :, None])
    got = run()
    err = np.abs(got - ref).max()
    # fp32 compute, then O rounded to bf16 (half a unit, 2^-9 relative): one bf16 unit of max|O|.
    assert err <= 2.0 ** -8 * np.abs(ref).max(), f"fp8: max error {err}"
    descales[2][0, 1] *= 2  # v_descale[0, 1]: exactly doubles the heads of kv head 1 only
    doubled = run()
    assert np.array_equal(doubled[:, :group], got[:, :group]), "v_descale[0, 1] changed kv head 0's heads"
    assert np.array_equal(doubled[:, group:], 2 * got[:, group:]), "v_descale[0, 1] did not double kv head 1's heads"

    plain = sp_ctypes.Problem()
    plain.q, plain.k, plain.v = (view(x.astype(np.float32)) for x in (table[q], table[k], table[v]))
    plain.k_descale = view(descales[1])
    o32 = np.empty((1, s, h_q, d), dtype=np.float32)
    code = lib.run(plain, dense, sp_ctypes.Output(view(o32), sp_ctypes.Tensor()), opts)
    assert code == sp_ctypes.ERR_INVALID_ARGUMENT and "k_descale: only with fp8_e4m3 inputs" in lib.last_error(), \
        (code, lib.last_error())


def check_features(lib, rng, opts, s, h_q, h_kv, d):
    """The fields after scale: a causal window (local, window_left), softcap and sinks, with v of
    another head dim, against fp64 attention (each row's softmax over keys a - left .. a, scores
    capped, the sink a column the values never see); window fields without local refused."""
    left, softcap, d_v = 5, 1.5, 8
    q = rng.standard_normal((1, s, h_q, d)).astype(np.float32)
    k = rng.standard_normal((1, s, h_kv, d)).astype(np.float32)
    v = rng.standard_normal((1, s, h_kv, d_v)).astype(np.float32)
    sinks = np.linspace(-1.0, 2.0, h_q).astype(np.float32)
    problem = sp_ctypes.Problem()
    problem.q, problem.k, problem.v, problem.sinks = view(q), view(k), view(v), view(sinks)
    problem.causal, problem.local, problem.window_left, problem.window_right = 1, 1, left, -1
    problem.softcap = softcap
    o = np.full((1, s, h_q, d_v), np.nan, dtype=np.float32)
    lib.check(lib.run(problem, lib.policy("dense"), sp_ctypes.Output(view(o), sp_ctypes.Tensor()), opts))
    group = h_q // h_kv
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    allowed = (j <= i) & (j >= i - left)
    for h in range(h_q):
        scores = q[0, :, h].astype(np.float64) @ k[0, :, h // group].T.astype(np.float64) / np.sqrt(d)
        scores = np.where(allowed, softcap * np.tanh(scores / softcap), -np.inf)
        m = np.maximum(scores.max(1, keepdims=True), sinks[h])
        p = np.exp(scores - m)
        ref = p @ v[0, :, h // group].astype(np.float64) / (p.sum(1, keepdims=True) + np.exp(sinks[h] - m))
        err = np.abs(o[0, :, h] - ref).max()
        assert err < 1e-4, f"features: head {h} max error {err}"
    problem.local = 0
    code = lib.run(problem, lib.policy("dense"), sp_ctypes.Output(view(o), sp_ctypes.Tensor()), opts)
    assert code == sp_ctypes.ERR_INVALID_ARGUMENT and "set while local = 0" in lib.last_error(), lib.last_error()


def main():
    lib = sp_ctypes.Library(sys.argv[1])
    rng = np.random.default_rng(7)
    s, h_q, h_kv, d, block = 40, 4, 2, 16, 8
    q = rng.standard_normal((1, s, h_q, d)).astype(np.float32)
    k = rng.standard_normal((1, s, h_kv, d)).astype(np.float32)
    v = rng.standard_normal((1, s, h_kv, d)).astype(np.float32)
    problem = sp_ctypes.Problem()
    problem.q, problem.k, problem.v = view(q), view(k), view(v)
    problem.causal, problem.scale = 1, 0.0
    o = np.full((1, s, h_q, d), np.nan, dtype=np.float32)
    lse = np.full((1, h_q, s), np.nan, dtype=np.float32)
    out = sp_ctypes.Output(view(o), view(lse))
    opts = sp_ctypes.Options(sp_ctypes.BACKEND_CPU, 1, None)

    heads = (sp_ctypes.HeadStats * (h_q))()
    stats = sp_ctypes.Stats()
    stats.heads = ctypes.cast(heads, ctypes.POINTER(sp_ctypes.HeadStats))
    stats.heads_capacity = h_q
    lib.check(lib.run(problem, lib.policy("dense"), out, opts, stats))
    err = np.abs(o[0] - attention(q, k, v)).max()
    assert err < 1e-4, f"dense: max error {err}"
    assert stats.path == b"cpu" and stats.passes == 1 and stats.q_pack == 1, (stats.path, stats.passes, stats.q_pack)
    bad = sp_ctypes.Options(sp_ctypes.BACKEND_CPU, 1, None, 0, 3, 0, 0)  # pack_gqa 3: no such choice
    assert lib.run(problem, lib.policy("dense"), out, bad) == sp_ctypes.ERR_INVALID_ARGUMENT
    assert "options.pack_gqa" in lib.last_error(), lib.last_error()
    assert np.isfinite(lse).all(), "dense: LSE not written"
    visible = s * (s + 1) // 2
    assert stats.total.computed_pairs == h_q * visible, stats.total.computed_pairs
    assert stats.num_heads == h_q and heads[h_q - 1].computed_pairs == visible
    assert stats.density == 1.0

    nb = s // block
    keep = np.tril(rng.random((h_q, nb, nb)) < 0.5) | np.eye(nb, dtype=bool)
    rows, cols = np.nonzero(keep.reshape(h_q * nb, nb))
    indptr = np.zeros(h_q * nb + 1, dtype=np.int32)
    np.add.at(indptr, rows + 1, 1)
    indptr = np.cumsum(indptr).astype(np.int32)
    indices = cols.astype(np.int32)
    pol = lib.policy("block_sparse")
    pol.set_block_mask(problem, block, block, indptr.ctypes.data, h_q * nb, indices.ctypes.data,
                       indices.size)
    o.fill(np.nan)
    lib.check(lib.run(problem, pol, out, opts, stats))
    err = np.abs(o[0] - attention(q, k, v, keep, block)).max()
    assert err < 1e-4, f"block_sparse: max error {err}"
    assert stats.total.kept_blocks == keep.sum(), (stats.total.kept_blocks, keep.sum())

    # The same mask through a plan: identical bits, decisions with the mask's CSR.
    plan = lib.plan(problem, pol, opts)
    assert plan.describe() == pol.describe()
    expected = o.copy()
    o.fill(np.nan)
    decisions = sp_ctypes.Decisions(lib)
    lib.check(lib.plan_run(plan, problem, out, opts, stats, decisions))
    assert np.array_equal(o, expected), "plan: output differs from run"
    kept_view = decisions.mask(sp_ctypes.MASK_KEPT)
    assert (kept_view.batch, kept_view.heads, kept_view.num_q_blocks, kept_view.num_k_blocks,
            kept_view.block_q) == (1, h_q, nb, nb, block)
    assert kept_view.num_rows == h_q * nb and kept_view.num_indices == indices.size
    assert [kept_view.indptr[i] for i in range(kept_view.num_rows + 1)] == indptr.tolist()
    assert [kept_view.indices[i] for i in range(kept_view.num_indices)] == indices.tolist()
    assert decisions.mask(sp_ctypes.MASK_CORRECTED).num_rows == 0 and decisions.policy() == "block_sparse"
    bad_shape = sp_ctypes.Problem.from_buffer_copy(problem)
    bad_shape.k.shape[1] = bad_shape.v.shape[1] = s - 1
    code = lib.plan_run(plan, bad_shape, out, opts)
    assert code == sp_ctypes.ERR_INVALID_ARGUMENT and "does not match the plan" in lib.last_error(), lib.last_error()

    # estimate_select's selection alone, with mean correction; permute_stop's tiles from a run.
    est = lib.policy("estimate_select", {"block": block, "alpha": 0.9, "sink": 1, "window": 1, "tail": 1,
                                         "mean_correction": "true"})
    sel = lib.select(problem, est, opts, stats)
    kept, corrected = sel.mask(sp_ctypes.MASK_KEPT), sel.mask(sp_ctypes.MASK_CORRECTED)
    assert sel.policy() == "estimate_select" and kept.per_kv_head == 0 and corrected.num_rows == h_q * nb
    assert kept.num_indices == stats.total.kept_blocks and 0 < stats.density < 1, (kept.num_indices, stats.density)
    stop = lib.policy("permute_stop", {"segment": 16, "block_q": block, "block_k": block, "tau": 0.05})
    lib.check(lib.dll.sp_run_decisions(ctypes.byref(problem), stop.handle, ctypes.byref(out), ctypes.byref(opts),
                                       None, sel.handle))
    tiles = sel.tiles()
    assert tiles and all(0 <= t.chunks_visited <= t.chunks_total for t in tiles) and sel.mask().num_rows == 0

    table = np.full((h_q, 1), np.inf, dtype=np.float32)  # keeps partial blocks only
    gate = lib.policy("exact_gate", {"block_q": block, "block_k": block})
    gate.set_thresholds(view(table), owner=table)
    lib.check(lib.run(problem, gate, out, opts, stats))
    assert stats.total.kept_blocks == h_q * nb, stats.total.kept_blocks
    assert "exact_gate" in gate.describe()

    check_fp8(lib, rng, opts, s, h_q, h_kv, d)
    check_features(lib, rng, opts, s, h_q, h_kv, d)

    bad = sp_ctypes.Problem.from_buffer_copy(problem)
    bad.k.shape[3] = 8
    code = lib.run(bad, lib.policy("dense"), out, opts)
    assert code == sp_ctypes.ERR_INVALID_ARGUMENT and lib.last_error(), (code, lib.last_error())
    try:
        lib.policy("no_such_policy")
        raise AssertionError("an unknown policy was accepted")
    except sp_ctypes.SparsePrefillError as e:
        assert e.code == sp_ctypes.ERR_INVALID_ARGUMENT
    # The generator config: a chunk's queries are the tail of the full prompt's (seq_q, seq_k),
    # and seed and peakedness reach the generator.
    def generate(seq_q, seq_k, seed=5, peakedness=1.0):
        arrays = [np.empty((1, n, h, 64), dtype=np.float32) for n, h in ((seq_q, 4), (seq_k, 2), (seq_k, 2))]
        lib.generate(sp_ctypes.GeneratorConfig(1, seq_q, seq_k, 4, 2, 64, seed, peakedness),
                     *[view(a) for a in arrays])
        return arrays
    full, tail = generate(96, 96), generate(40, 96)
    assert np.array_equal(full[0][:, 56:], tail[0]) and np.array_equal(full[1], tail[1]), "seq_q/seq_k"
    assert not np.array_equal(generate(40, 96, seed=6)[0], tail[0]), "seed"
    assert not np.array_equal(generate(40, 96, peakedness=2.0)[0], tail[0]), "peakedness"
    print("check_sp_ctypes: ok")


if __name__ == "__main__":
    main()
