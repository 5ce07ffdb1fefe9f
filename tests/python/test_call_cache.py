# SPDX-License-Identifier: Apache-2.0
"""The eager fast path and its cache of prepared calls (docs/python.md, "Prepared calls"):
a key is planned on its second validation and hit from then on, with the results of a call
made with the cache off; every component of the key misses when it changes; the LRU evicts;
a replaced threshold table invalidates; a hit raises what a miss raises; autograd, dispatch
modes and statistics collection still see what they saw; run(plan, ...)'s lean path; threads."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparseprefill as sp  # noqa: E402
from sparseprefill import _call_cache, _ext  # noqa: E402
from sparseprefill.flash_attn_interface import (  # noqa: E402
    flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
from _torch_refs import CUDA, DEVICES  # noqa: E402


@pytest.fixture(autouse=True)
def fresh_cache():
    capacity = sp.call_cache_info().capacity
    sp.clear_call_cache()
    yield
    sp.set_call_cache_size(capacity)
    sp.clear_call_cache()


def dtype_of(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


def qkv(seed, b=1, s_q=24, s_k=24, h_q=4, h_kv=2, d=64, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen).to(dtype).to(device)
                 for shape in ((b, s_q, h_q, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d)))


def counts():
    info = sp.call_cache_info()
    return info.hits, info.misses, info.plans


def uncached(fn):
    """fn() validated and run in full, the cache untouched: collecting statistics bypasses it."""
    with sp.collect_stats():
        return fn()


def same(a, b):
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_planned_on_the_second_call_then_hit(device):
    q, k, v = qkv(1, dtype=dtype_of(device), device=device)
    want = uncached(lambda: flash_attn_func(q, k, v, causal=True, return_softmax_lse=True))
    got = [flash_attn_func(q, k, v, causal=True, return_softmax_lse=True) for _ in range(5)]
    assert counts() == (3, 2, 1)
    assert all(same(g, want) for g in got)
    # New tensors of the same layout (a model's next layer) hit the same entry.
    q2, k2, v2 = qkv(2, dtype=dtype_of(device), device=device)
    assert same(flash_attn_func(q2, k2, v2, causal=True), uncached(lambda: flash_attn_func(q2, k2, v2, causal=True)))
    assert counts() == (4, 2, 1) and sp.call_cache_info().size == 1


def variants(device):
    """(name, base call, changed call): the changed call differs in one key component."""
    dt = dtype_of(device)
    q, k, v = qkv(3, dtype=dt, device=device)
    wide = torch.randn(1, 24, 4, 64, dtype=torch.float32).to(dt).to(device)
    k_strided, v_strided = wide[:, :, :2], wide[:, :, 2:]  # k's layout, other strides
    # Block sizes the device's kernels take (CUDA: 128, so the 24 tokens are one block).
    bl = 16 if device == "cpu" else 128
    gate = lambda t: sp.ExactGate(block_q=bl, block_k=bl, thresholds=torch.full((4, 2), t, device=device))  # noqa: E731
    nb = -(-24 // bl)
    mask_a = np.tril(np.ones((nb, nb), dtype=bool))[None, None]
    mask_b = mask_a.copy()
    mask_b[..., nb - 1, 0] = False
    out_t = torch.empty(1, 4, 24, 64, dtype=dt, device=device).transpose(1, 2)
    lens = [10, 14]
    qp, kp, vp = (x[0, :24] for x in qkv(4, dtype=dt, device=device))
    cu = lambda ls: torch.tensor([0] + list(np.cumsum(ls)), dtype=torch.int32, device=device)  # noqa: E731
    fa = flash_attn_func
    varlen = flash_attn_varlen_func
    q8, k8, v8 = ((2 * x.float()).to(torch.float8_e4m3fn) for x in (q, k, v))
    descale = torch.full((1, 2), 0.5, device=device)
    sinks = torch.linspace(-1.0, 1.0, 4, device=device)
    # Policies keyed by identity: one object per call site, as a model keeps them.
    gate_a, gate_b = gate(-1e9), gate(1e9)
    sparse_a, sparse_b = (sp.BlockSparse(dense=m, block_q=bl, block_k=bl) for m in (mask_a, mask_b))
    return [
        ("policy settings", lambda: fa(q, k, v, causal=True, policy=sp.SoftmaxSkip(block_q=bl, block_k=bl, a=10.0)),
         lambda: fa(q, k, v, causal=True, policy=sp.SoftmaxSkip(block_q=bl, block_k=bl, a=1e6))),
        ("policy kind", lambda: fa(q, k, v, causal=True),
         lambda: fa(q, k, v, causal=True, policy=sp.PermuteStop(segment=16, block_q=bl, block_k=bl))),
        ("exact_gate object", lambda: fa(q, k, v, causal=True, policy=gate_a),
         lambda: fa(q, k, v, causal=True, policy=gate_b)),
        ("block mask object", lambda: fa(q, k, v, causal=True, policy=sparse_a),
         lambda: fa(q, k, v, causal=True, policy=sparse_b)),
        ("shape", lambda: fa(q, k, v, causal=True), lambda: fa(q[:, :20], k, v, causal=True)),
        ("strides", lambda: fa(q, k, v, causal=True), lambda: fa(q, k_strided, v_strided, causal=True)),
        ("causal", lambda: fa(q, k, v, causal=True), lambda: fa(q, k, v, causal=False)),
        ("scale", lambda: fa(q, k, v, causal=True), lambda: fa(q, k, v, causal=True, softmax_scale=0.5)),
        ("out given", lambda: fa(q, k, v, causal=True), lambda: fa(q, k, v, causal=True, out=torch.empty_like(q))),
        ("out strides", lambda: fa(q, k, v, causal=True, out=torch.empty_like(q)),
         lambda: fa(q, k, v, causal=True, out=out_t)),
        ("cu_seqlens contents", lambda: varlen(qp, kp, vp, cu(lens), cu(lens), 14, 14, causal=True),
         lambda: varlen(qp, kp, vp, cu([14, 10]), cu([14, 10]), 14, 14, causal=True)),
        ("seqused_k contents",
         lambda: varlen(qp, kp, vp, cu(lens), cu(lens), 14, 14, causal=True,
                        seqused_k=torch.tensor([10, 14], dtype=torch.int32, device=device)),
         lambda: varlen(qp, kp, vp, cu(lens), cu(lens), 14, 14, causal=True,
                        seqused_k=torch.tensor([10, 9], dtype=torch.int32, device=device))),
    ] + ([("dtype", lambda: fa(q, k, v, causal=True),
           lambda: fa(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)),
          # FP8 inputs run on the CPU backend (test_fp8.py).
          ("descales", lambda: fa(q8, k8, v8, causal=True), lambda: fa(q8, k8, v8, causal=True, q_descale=descale)),
          # The model-family features run on the CPU backend (test_torch.py).
          ("window", lambda: fa(q, k, v, causal=True, window_size=(7, 0)),
           lambda: fa(q, k, v, causal=True, window_size=(6, 0))),
          ("softcap", lambda: fa(q, k, v, causal=True, softcap=2.0), lambda: fa(q, k, v, causal=True, softcap=3.0)),
          ("sinks given", lambda: fa(q, k, v, causal=True), lambda: fa(q, k, v, causal=True, sinks=sinks)),
          ("v head dim", lambda: fa(q, k, v, causal=True), lambda: fa(q, k, v[..., :32], causal=True))]
         if device == "cpu" else [])


VARIANT_NAMES = [name for name, _, _ in variants("cpu")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", VARIANT_NAMES)
def test_every_key_component_misses(device, name):
    cases = {c[0]: c for c in variants(device)}
    if name not in cases:
        pytest.skip(f"{name}: not a {device} call (FP8 and fp32 inputs run on the CPU backend)")
    _, base, changed = cases[name]
    for _ in range(3):
        base()
    hits, misses, plans = counts()
    assert (hits, plans) == (1, 1)
    got = changed()
    assert counts() == (hits, misses + 1, plans), name
    assert same(got, uncached(changed)), name
    # Each key has its own entry once planned.
    for _ in range(2):
        changed()
    assert same(changed(), uncached(changed)) and same(base(), uncached(base))
    assert sp.call_cache_info().size == 2


def test_paged_block_table_contents_are_part_of_the_key():
    q, _, _ = qkv(5, s_q=8)
    k_cache, v_cache = (torch.randn(4, 8, 2, 64) for _ in range(2))
    lens = torch.tensor([16], dtype=torch.int32)
    call = lambda table: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True,  # noqa: E731
                                                 page_table=torch.tensor([table], dtype=torch.int32))
    for _ in range(3):
        a = call([0, 1])
    b = call([2, 3])  # the same shapes, other pages
    assert not torch.equal(a, b)
    assert torch.equal(b, uncached(lambda: call([2, 3]))) and torch.equal(call([0, 1]), uncached(lambda: call([0, 1])))


def test_calls_made_once_are_not_planned():
    for s in (8, 9, 10):
        flash_attn_func(*qkv(6, s_q=s, s_k=s), causal=True)
    q, k, v = qkv(6)
    mask = np.ones((1, 1, 2, 2), dtype=bool)
    for _ in range(3):  # a new policy object each call: a new key each call
        flash_attn_func(q, k, v, causal=True, policy=sp.BlockSparse(dense=np.tril(mask), block_q=16, block_k=16))
    assert counts() == (0, 6, 0)


def test_lru_eviction():
    sp.set_call_cache_size(2)
    calls = {s: (lambda s=s: flash_attn_func(*qkv(6, s_q=s, s_k=s), causal=True)) for s in (8, 16, 24)}
    for s in (8, 16):
        calls[s]()
        calls[s]()
    calls[8]()  # a hit: 8 is now the most recently used
    calls[24]()
    calls[24]()  # planned: evicts 16, the least recently used
    info = sp.call_cache_info()
    assert (info.size, info.evictions, info.plans) == (2, 1, 3)
    hits = info.hits
    calls[8]()
    assert sp.call_cache_info().hits == hits + 1
    calls[16]()
    assert sp.call_cache_info().hits == hits + 1


def test_clear_and_size():
    q, k, v = qkv(7)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    assert sp.call_cache_info().size == 1
    sp.clear_call_cache()
    assert sp.call_cache_info().size == 0
    flash_attn_func(q, k, v, causal=True)
    assert sp.call_cache_info().size == 0  # validated once more: planned on the next call
    sp.set_call_cache_size(0)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    assert sp.call_cache_info().size == 0
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(sp.InvalidArgumentError, match="entries"):
            sp.set_call_cache_size(bad)


def test_capacity_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPARSEPREFILL_CALL_CACHE", raising=False)
    assert _call_cache._capacity_from_environment() == _call_cache.DEFAULT_CAPACITY
    monkeypatch.setenv("SPARSEPREFILL_CALL_CACHE", "0")
    assert _call_cache._capacity_from_environment() == 0
    for bad in ("-1", "many"):
        monkeypatch.setenv("SPARSEPREFILL_CALL_CACHE", bad)
        with pytest.raises(sp.InvalidArgumentError, match="SPARSEPREFILL_CALL_CACHE"):
            _call_cache._capacity_from_environment()


def test_threshold_table_changed_in_place():
    q, k, v = qkv(8, s_q=32, s_k=32)
    table = torch.full((4, 2), -1e9)
    gate = sp.ExactGate(block_q=16, block_k=16, thresholds=table)
    call = lambda: flash_attn_func(q, k, v, causal=True, policy=gate)  # noqa: E731
    for _ in range(3):
        call()
    hits = sp.call_cache_info().hits
    # New values at the same address: the plan reads them, a hit.
    table.fill_(1e9)
    assert torch.equal(call(), uncached(call)) and sp.call_cache_info().hits == hits + 1
    # Other storage (and shape): the entry no longer describes the call and is dropped.
    table.set_(torch.full((4, 3), -1e9))
    size = sp.call_cache_info().size
    assert torch.equal(call(), uncached(call))
    assert sp.call_cache_info().size == size - 1
    table.set_(torch.full((5, 3), 0.0))  # h_q 5 for a call with 4 heads
    with pytest.raises(sp.InvalidArgumentError, match="thresholds"):
        call()


def test_pinned_entries_outlive_eviction_and_invalidation():
    # What a capture does to the entries it uses (test_a_captured_prepared_call_is_pinned on a
    # GPU), done by hand: a graph may replay their plans until clear_call_cache().
    q, k, v = qkv(19, s_q=32, s_k=32)
    table = torch.full((4, 2), -1e9)
    gate = sp.ExactGate(block_q=16, block_k=16, thresholds=table)
    for _ in range(2):
        flash_attn_func(q, k, v, causal=True, policy=gate)
    (entry,) = _call_cache.CACHE._entries.values()
    _call_cache.CACHE.pin(entry)
    sp.set_call_cache_size(0)
    assert (sp.call_cache_info().size, sp.call_cache_info().pinned) == (1, 1)
    sp.set_call_cache_size(4)
    table.set_(torch.full((4, 3), -1e9))  # the entry no longer describes the call: retired, kept
    for _ in range(2):
        flash_attn_func(q, k, v, causal=True, policy=gate)
    info = sp.call_cache_info()
    assert (info.size, info.pinned, info.plans) == (1, 1, 2)
    assert entry in _call_cache.CACHE._retired
    sp.clear_call_cache()
    assert (sp.call_cache_info().size, sp.call_cache_info().pinned) == (0, 0)


def test_a_hit_raises_what_a_miss_raises():
    q, k, v = qkv(9)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    bad = [lambda: flash_attn_func(q, k, v, causal=True, layer="first"),
           lambda: flash_attn_func(q, k, v, causal=True, layer=object()),
           lambda: flash_attn_func(q, k, v, causal=True, softmax_scale=-1.0),
           lambda: flash_attn_func(q, k, v, causal=True, out=torch.empty(1, 24, 4, 64, dtype=torch.float16)),
           lambda: flash_attn_func(q, k, v.double(), causal=True),
           lambda: flash_attn_func(q, k, v, causal=True, policy="dense"),
           lambda: flash_attn_func(q, k, v, causal=True, policy=sp.PermuteStop(tau=-1.0)),
           lambda: flash_attn_func(q, k[:, :20], v, causal=True)]
    for call in bad:
        with pytest.raises(Exception) as cold:
            uncached(call)
        with pytest.raises(type(cold.value)) as warm:
            call()
        assert str(warm.value) == str(cold.value)
    # max_seqlen_q sizes a block mask over varlen queries: another value is another key.
    qp, kp, vp = (x[0] for x in (q, k, v))
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    sparse = sp.BlockSparse(dense=np.ones((1, 1, 1, 1), dtype=bool), block_q=16, block_k=16)
    for _ in range(3):
        flash_attn_varlen_func(qp, kp, vp, cu, cu, 14, 14, causal=True, policy=sparse)
    with pytest.raises(sp.InvalidArgumentError, match="num_q_blocks"):
        flash_attn_varlen_func(qp, kp, vp, cu, cu, 20, 20, causal=True, policy=sparse)
    # A valid layer on a hit is accepted, as on a miss.
    assert torch.equal(flash_attn_func(q, k, v, causal=True, layer=np.int64(3)), flash_attn_func(q, k, v, causal=True))


def test_autograd_and_dispatch_modes_still_see_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    q, k, v = qkv(10)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    q_grad = q.clone().requires_grad_()
    out = flash_attn_func(q_grad, k, v, causal=True)
    assert out.grad_fn is not None  # the op's backward, which raises: forward only
    with pytest.raises(RuntimeError, match="no autograd formula"):
        out.sum().backward()
    with torch.no_grad():
        assert flash_attn_func(q_grad, k, v, causal=True).grad_fn is None

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log() as log:
        flash_attn_func(q, k, v, causal=True)
    assert "sparseprefill.attention.default" in log.ops
    with pytest.raises(RuntimeError, match="Batching rule not implemented"):
        torch.vmap(lambda x: flash_attn_func(x, k, v, causal=True))(torch.stack([q, q]))


def test_out_is_marked_written():
    q, k, v = qkv(11)
    out = torch.empty_like(q)
    for i in range(4):  # misses, the planning call, a hit: each bumps out's version, as the op does
        flash_attn_func(q, k, v, causal=True, out=out)
        assert out._version == i + 1


def test_statistics_collection_sees_every_call():
    q, k, v = qkv(12)
    for _ in range(3):
        flash_attn_func(q, k, v, causal=True)
    with sp.collect_stats() as log:
        for layer in range(3):
            flash_attn_func(q, k, v, causal=True, layer=layer)
    assert [c.layer for c in log.calls] == [0, 1, 2]


def test_sinks_are_read_as_the_call_runs():
    # A hit patches the sinks' address and reads their values when it runs: sinks changed in
    # place, and other sinks of the same layout, give what a full call gives.
    q, k, v = qkv(21)
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")])
    call = lambda s: flash_attn_func(q, k, v, causal=True, window_size=(9, 0), sinks=s,  # noqa: E731
                                     return_softmax_lse=True)
    for _ in range(3):
        call(sinks)
    assert counts() == (1, 2, 1)
    sinks.sub_(1.5)
    assert same(call(sinks), uncached(lambda: call(sinks)))
    others = torch.tensor([3.0, 0.0, -3.0, 1.0])
    assert same(call(others), uncached(lambda: call(others)))
    assert counts() == (3, 2, 1)
    assert not same(call(others), call(sinks))


@pytest.mark.parametrize("device", DEVICES)
def test_the_ops_implementation_uses_the_cache(device):
    q, k, v = qkv(13, dtype=dtype_of(device), device=device)
    args = (q, k, v, None, None, None, None, None, None, None, True, 0.0, -1, -1, 0, 0.0, None, "dense", "", None,
            None, None, 0, 0, False, -1, None, None, None, None)
    want = uncached(lambda: torch.ops.sparseprefill.attention(*args))
    for _ in range(3):
        got = torch.ops.sparseprefill.attention(*args)
        assert same(got, want)
    out, lse = torch.empty_like(q), torch.empty(1, 4, 24, dtype=torch.float32, device=device)
    for _ in range(3):
        torch.ops.sparseprefill.attention_out(*args, out, lse)
        assert same((out, lse), want)
    assert counts() == (2, 4, 2)


class RunPtrsSpy:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = _ext.PlanCall.run_ptrs

        def spy(call, *args):
            self.calls += 1
            return original(call, *args)

        monkeypatch.setattr(_ext.PlanCall, "run_ptrs", spy)


@pytest.mark.parametrize("device", DEVICES)
def test_run_plan_lean_path(device, monkeypatch):
    q, k, v = qkv(14, dtype=dtype_of(device), device=device)
    plan = sp.plan(q, k, v, sp.Dense(), causal=True)
    want = sp.run(q, k, v, sp.Dense(), causal=True)
    spy = RunPtrsSpy(monkeypatch)
    out = torch.empty_like(q)
    results = [sp.run(plan, q, k, v, out=out, stats=False) for _ in range(3)]
    assert spy.calls == 2  # the first call is checked in full and binds the plan
    for r in results:
        assert r.stats is None and r.decisions is None
        assert torch.equal(r.out, want.out) and torch.equal(r.lse, want.lse)
    # Another key (a fresh out, other strides, statistics wanted) is checked in full.
    r = sp.run(plan, q, k, v, stats=False)
    assert spy.calls == 2 and torch.equal(r.out, want.out)
    r = sp.run(plan, q, k, v, out=out)
    assert spy.calls == 2 and r.stats is not None
    assert torch.equal(sp.run(plan, q, k, v, stats=False).out, want.out) and spy.calls == 3
    with pytest.raises(sp.InvalidArgumentError, match="does not match the plan"):
        sp.run(plan, q[:, :-1], k, v, stats=False)
    with pytest.raises(sp.InvalidArgumentError, match="out: expected q's shape"):
        sp.run(plan, q, k, v, out=out[:, :-1], stats=False)


def test_a_bound_call_refuses_tensors_it_does_not_have():
    q, k, v = qkv(15)
    plan = sp.plan(q, k, v)
    sp.run(plan, q, k, v, stats=False)
    _, entry = plan._prepared
    out, lse = torch.empty_like(q), torch.empty(1, 4, 24)
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lse.data_ptr(), 0)
    with pytest.raises(sp.InvalidArgumentError, match="q_descale: the bound call has none"):
        entry.call.run_ptrs(*ptrs, q.data_ptr())


def test_threads_share_the_cache():
    sp.set_call_cache_size(2)  # three keys in turn: planning and eviction race with hits
    shapes = (8, 16, 24)
    inputs = {s: qkv(16 + s, s_q=s, s_k=s) for s in shapes}
    want = {s: uncached(lambda s=s: flash_attn_func(*inputs[s], causal=True)) for s in shapes}
    errors = []

    def worker(offset):
        try:
            for i in range(30):
                s = shapes[(i + offset) % len(shapes)]
                assert torch.equal(flash_attn_func(*inputs[s], causal=True), want[s])
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    info = sp.call_cache_info()
    assert info.size <= 2 and info.hits > 0 and info.evictions > 0


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_a_captured_prepared_call_is_pinned():
    q, k, v = (x.contiguous() for x in qkv(17, s_q=256, s_k=256, dtype=torch.bfloat16, device="cuda"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # planned, then a hit outside capture
            flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = flash_attn_func(q, k, v, causal=True)
    assert sp.call_cache_info().pinned == 1
    sp.set_call_cache_size(0)  # a pinned entry is not evicted: the graph reads its plan
    assert sp.call_cache_info().size == 1
    q2, k2, v2 = qkv(18, s_q=256, s_k=256, dtype=torch.bfloat16, device="cuda")
    for dst, src in zip((q, k, v), (q2, k2, v2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, flash_attn_func(q2, k2, v2, causal=True))
