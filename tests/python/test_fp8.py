# SPDX-License-Identifier: Apache-2.0
"""FP8 (torch.float8_e4m3fn) inputs with FlashAttention-3's q_descale, k_descale, v_descale
through the FlashAttention functions, the torch ops and the native calls, on the CPU backend
(docs/semantics.md §1): bit for bit the CPU backend's run on the dequantized values with O
rounded to bfloat16, within one bfloat16 unit of float64 attention, each descale element applied
to its own (batch, kv head), every policy deciding as on the dequantized values, and every bad
argument named."""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparseprefill as sp  # noqa: E402
from sparseprefill.flash_attn_interface import (  # noqa: E402
    flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
from _torch_refs import attention  # noqa: E402

FP8 = torch.float8_e4m3fn


def fp8_inputs(seed, b, s_q, s_k, h_q, h_kv, d):
    """q, k, v in FP8 (2·N(0, 1) rounded to E4M3, magnitudes up to ~10 of the format's 448) and
    float32 descales [b, h_kv] uniform in [0.3, 1.7): not powers of two, so each multiplies
    into the values' low bits."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = ((2 * torch.randn(shape, generator=gen)).to(FP8)
               for shape in ((b, s_q, h_q, d), (b, s_k, h_kv, d), (b, s_k, h_kv, d)))
    descales = tuple(0.3 + 1.4 * torch.rand((b, h_kv), generator=gen) for _ in range(3))
    return q, k, v, descales


def dequantized(x, descale):
    """x · descale[b, h / group] in float32 for [b, s, h, d] x. These are the library's values
    bit for bit: an E4M3 value has 4 significant bits, so the exact product has at most 28 and
    float32 multiplication rounds it once, as the library rounds its fp64 product."""
    group = x.shape[2] // descale.shape[1]
    return x.float() * descale.repeat_interleave(group, 1)[:, None, :, None]


def descale_args(descales):
    return dict(zip(("q_descale", "k_descale", "v_descale"), descales))


def assert_within_one_bf16_unit(out, ref):
    """O is fp32 attention rounded to bfloat16: half a bfloat16 unit (2^-9 relative) of
    rounding plus an fp32 compute error some 100x smaller; one unit of max|O| (2^-8 · max|O|)
    bounds both, the eps of docs/numerics.md's tolerance."""
    err = (out.double() - ref.double()).abs().max().item()
    bound = 2.0 ** -8 * ref.double().abs().max().item()
    assert err <= bound, f"max error {err:.3e} > one bf16 unit {bound:.3e}"


@pytest.mark.parametrize("policy_name,causal", [("dense", False), ("dense", True), ("block_sparse", True)])
def test_fp8_equals_its_run_on_dequantized_values(policy_name, causal):
    b, s_q, s_k, h_q, h_kv, d = 2, 37, 53, 6, 2, 64
    q, k, v, descales = fp8_inputs(61, b, s_q, s_k, h_q, h_kv, d)
    qd, kd, vd = (dequantized(x, s) for x, s in zip((q, k, v), descales))
    policy = sp.Dense()
    if policy_name == "block_sparse":
        # A realistic mask for this geometry: what estimate_select keeps on the same values.
        mask = sp.select(qd, kd, vd, sp.EstimateSelect(block=16, alpha=0.5, sink=1, window=1, tail=1)).mask
        assert 0 < mask.density < 1
        policy = mask.to_policy()
    out, lse = flash_attn_func(q, k, v, causal=causal, policy=policy, return_softmax_lse=True,
                               **descale_args(descales))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.dtype == torch.float32
    twin, twin_lse = flash_attn_func(qd, kd, vd, causal=causal, policy=policy, return_softmax_lse=True)
    assert torch.equal(out, twin.to(torch.bfloat16)) and torch.equal(lse, twin_lse)
    if policy_name == "dense":
        ref = attention(qd, kd, vd, causal)[0]
    else:
        ref = sp.run(qd, kd, vd, policy, causal=causal, backend="reference").out  # fp64 oracle, stored fp32
    assert_within_one_bf16_unit(out, ref)
    # The native call and the op agree.
    assert torch.equal(sp.run(q, k, v, policy, causal=causal, **descale_args(descales)).out, out)


def every_policy(h_q):
    return [sp.ExactGate(block_q=16, block_k=16, thresholds=torch.full((h_q, 1), 0.5)),
            sp.SoftmaxSkip(block_q=16, block_k=16, a=90.0),
            sp.EstimateSelect(block=16, alpha=0.2, sink=1, window=1, tail=1),
            sp.EstimateSelect(block=16, alpha=0.2, sink=1, window=1, tail=1, mean_correction=True),
            sp.PermuteStop(segment=64, tau=0.05, block_q=16, block_k=16)]


@pytest.mark.parametrize("index", range(5), ids=["exact_gate", "softmax_skip", "estimate_select",
                                                 "estimate_select_mc", "permute_stop"])
def test_fp8_every_policy_equals_its_run_on_the_bf16_twin(index):
    """Every policy decides on the dequantized values (docs/semantics.md §1). With power-of-two
    descales those are exact in bfloat16 (E4M3 holds 4 significant bits), and estimate_select's
    block means are bfloat16 for FP8 inputs, so the FP8 run is the bfloat16 twin's bit for bit:
    decisions, O and LSE; and each policy prunes some of the work."""
    b, s, h_q, h_kv, d = 2, 256, 6, 2, 32
    q, k, v, _ = fp8_inputs(62, b, s, s, h_q, h_kv, d)
    descales = tuple(torch.tensor([[0.5, 2.0], [1.0, 0.25]]) * f for f in (1.0, 0.5, 2.0))
    twin = [dequantized(x, c).to(torch.bfloat16) for x, c in zip((q, k, v), descales)]
    assert all(torch.equal(t.float(), dequantized(x, c)) for t, x, c in zip(twin, (q, k, v), descales))
    policy = every_policy(h_q)[index]
    got = sp.run(q, k, v, policy, causal=True, decisions=True, **descale_args(descales))
    want = sp.run(*twin, policy, causal=True, decisions=True)
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    a, w = got.decisions, want.decisions
    assert a.policy == w.policy and np.array_equal(a.tiles, w.tiles) and np.array_equal(a.query_order, w.query_order)
    for mine, theirs in ((a.kept, w.kept), (a.corrected, w.corrected)):
        assert (mine is None) == (theirs is None)
        assert mine is None or np.array_equal(mine.to_dense(), theirs.to_dense())
    assert 0 < got.stats.pair_density < 1


def test_fp8_descales_reach_their_batch_and_kv_head():
    b, s, h_q, h_kv, d = 2, 40, 6, 2, 32
    group = h_q // h_kv
    q, k, v, descales = fp8_inputs(62, b, s, s, h_q, h_kv, d)
    out = flash_attn_func(q, k, v, causal=True, **descale_args(descales))
    # Swapping the two kv heads' k or v descales changes every query head's output.
    for which in (1, 2):
        swapped = list(descales)
        swapped[which] = descales[which][:, [1, 0]]
        changed = flash_attn_func(q, k, v, causal=True, **descale_args(swapped))
        for h in range(h_q):
            assert not torch.equal(changed[:, :, h], out[:, :, h]), f"descale {which}, head {h}"
    # Permuting batches and kv heads (with their query head groups) in the inputs and the
    # descales alike permutes the output alike, bit for bit: descale[b, g] scales kv head g of
    # batch b and query heads g·group .. (g+1)·group - 1.
    kv_perm = [1, 0]
    q_perm = [g * group + i for g in kv_perm for i in range(group)]
    batch_perm = [1, 0]
    permuted = flash_attn_func(q[batch_perm][:, :, q_perm], k[batch_perm][:, :, kv_perm], v[batch_perm][:, :, kv_perm],
                               causal=True, **descale_args(x[batch_perm][:, kv_perm] for x in descales))
    assert torch.equal(permuted, out[batch_perm][:, :, q_perm])


def pack(x, lengths):
    return torch.cat([x[i, :n] for i, n in enumerate(lengths)])


def cu(lengths):
    return torch.tensor([0] + list(np.cumsum(lengths)), dtype=torch.int32)


def test_fp8_varlen_and_kvcache_equal_per_sequence_calls():
    b, h_q, h_kv, d = 2, 4, 2, 32
    lens_q, lens_k = [37, 9], [53, 30]
    q, k, v, descales = fp8_inputs(63, b, max(lens_q), max(lens_k), h_q, h_kv, d)

    def alone(i, n_q, n_k):
        return flash_attn_func(q[i:i + 1, :n_q], k[i:i + 1, :n_k], v[i:i + 1, :n_k], causal=True,
                               **descale_args(x[i:i + 1] for x in descales))

    out = flash_attn_varlen_func(pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q), cu(lens_k),
                                 max(lens_q), max(lens_k), causal=True, **descale_args(descales))
    assert out.dtype == torch.bfloat16
    # seqused_q takes the packing path (the unused rows are zero).
    used = flash_attn_varlen_func(pack(q, lens_q), pack(k, lens_k), pack(v, lens_k), cu(lens_q), cu(lens_k),
                                  max(lens_q), max(lens_k), causal=True,
                                  seqused_q=torch.tensor([20, 9], dtype=torch.int32), **descale_args(descales))
    start = 0
    for i, (n_q, n_k) in enumerate(zip(lens_q, lens_k)):
        assert torch.equal(out[start:start + n_q], alone(i, n_q, n_k)[0]), f"varlen sequence {i}"
        n_used = 20 if i == 0 else n_q
        assert torch.equal(used[start:start + n_used], alone(i, n_used, n_k)[0]), f"seqused_q sequence {i}"
        assert (used[start + n_used:start + n_q] == 0).all()
        start += n_q

    # A cache with new keys appended in place (FP8 caches, as FA3 takes them), then paged.
    s_new = 5
    cached = [n - s_new for n in lens_k]
    k_cache, v_cache = torch.zeros((b, 64, h_kv, d), dtype=FP8), torch.zeros((b, 64, h_kv, d), dtype=FP8)
    for i, n in enumerate(cached):
        k_cache[i, :n], v_cache[i, :n] = k[i, :n], v[i, :n]
    new_k = torch.stack([k[i, n:n + s_new] for i, n in enumerate(cached)])
    new_v = torch.stack([v[i, n:n + s_new] for i, n in enumerate(cached)])
    q_new = torch.stack([q[i, :s_new] for i in range(b)])
    got = flash_attn_with_kvcache(q_new, k_cache, v_cache, new_k, new_v,
                                  cache_seqlens=torch.tensor(cached, dtype=torch.int32), causal=True,
                                  **descale_args(descales))
    # The same cache in 16-key pages stored in reverse order.
    k_pages, v_pages = (x.reshape(b * 4, 16, h_kv, d).flip(0) for x in (k_cache, v_cache))
    table = (b * 4 - 1 - torch.arange(b * 4, dtype=torch.int32)).reshape(b, 4)
    paged = flash_attn_with_kvcache(q_new, k_pages, v_pages, page_table=table,
                                    cache_seqlens=torch.tensor(lens_k, dtype=torch.int32), causal=True,
                                    **descale_args(descales))
    for i in range(b):
        want = flash_attn_func(q_new[i:i + 1], k[i:i + 1, :lens_k[i]], v[i:i + 1, :lens_k[i]], causal=True,
                               **descale_args(x[i:i + 1] for x in descales))
        assert torch.equal(got[i:i + 1], want), f"kvcache sequence {i}"
        assert torch.equal(paged[i:i + 1], want), f"paged sequence {i}"


def test_fp8_out_buffer_compile_and_opcheck():
    q, k, v, descales = fp8_inputs(64, 2, 33, 47, 4, 2, 64)
    out = flash_attn_func(q, k, v, causal=True, **descale_args(descales))
    buf = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)
    same, lse = flash_attn_func(q, k, v, causal=True, out=buf, return_softmax_lse=True, **descale_args(descales))
    assert same is buf and torch.equal(buf, out)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v, a, b, c: flash_attn_func(q, k, v, causal=True, q_descale=a, k_descale=b,
                                                                      v_descale=c), fullgraph=True)
    assert torch.equal(compiled(q, k, v, *descales), out)
    args = (q, k, v, None, None, None, None, *descales, True, 0.0, -1, -1, 0, 0.0, None, "dense", "", None, None, None,
            0, 0, False, -1, None, None, None, None)
    # The fake implementations give what the ops give (bfloat16 out). test_schema is left out:
    # its checker multiplies the inputs, which torch does not implement for float8 on the CPU.
    torch.library.opcheck(torch.ops.sparseprefill.attention.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(torch.ops.sparseprefill.attention_out.default, args + (buf, lse),
                          test_utils=("test_faketensor",))


def bad_cases():
    q, k, v, descales = fp8_inputs(65, 2, 16, 16, 4, 2, 32)

    def call(**kwargs):
        args = dict(q=q, k=k, v=v, causal=True, **descale_args(descales))
        args.update(kwargs)
        return lambda: flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)

    nonfinite = descales[2].clone()
    nonfinite[1, 0] = float("inf")
    bf16 = [x.to(torch.bfloat16) for x in (q, k, v)]
    cu2 = torch.tensor([0, 16, 32], dtype=torch.int32)
    return [
        ("descales without fp8", call(q=bf16[0], k=bf16[1], v=bf16[2]), sp.InvalidArgumentError,
         "q_descale: only with float8_e4m3fn inputs, got bfloat16 inputs"),
        ("shape", call(k_descale=torch.ones(2, 4)), sp.InvalidArgumentError,
         "k_descale: expected float32 [batch, h_kv] = [2, 2], got float32 [2, 4]"),
        ("varlen batch", lambda: flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu2, cu2,
                                                        16, 16, causal=True, q_descale=torch.ones(3, 2)),
         sp.InvalidArgumentError, "q_descale: expected float32 [batch, h_kv] = [2, 2], got float32 [3, 2]"),
        ("dtype", call(v_descale=torch.ones(2, 2, dtype=torch.float16)), sp.InvalidArgumentError,
         "v_descale: expected float32 [batch, h_kv] = [2, 2], got float16 [2, 2]"),
        ("device", call(q_descale=torch.ones(2, 2, device="meta")), sp.InvalidArgumentError,
         "q_descale: expected q's device cpu, got meta"),
        ("type", call(k_descale=[[1.0, 1.0], [1.0, 1.0]]), sp.InvalidArgumentError,
         "k_descale: expected a torch.Tensor, got list"),
        ("finite", call(v_descale=nonfinite), sp.InvalidArgumentError, "v_descale[1, 0]: expected a finite number"),
        ("out dtype", call(out=torch.empty(q.shape, dtype=FP8)), sp.InvalidArgumentError,
         "out: expected dtype bfloat16 (float8_e4m3fn inputs give a bfloat16 output), got float8_e4m3fn"),
        ("mixed dtypes", call(k=bf16[1]), sp.InvalidArgumentError, "k, v: expected q's dtype float8_e4m3fn"),
    ]


@pytest.mark.parametrize("case,call,error,message", bad_cases(), ids=[c[0] for c in bad_cases()])
def test_fp8_bad_arguments_name_themselves(case, call, error, message):
    with pytest.raises(error, match=re.escape(message)) as raised:
        call()
    # InvalidArgumentError is a ValueError, UnsupportedError a NotImplementedError.
    assert isinstance(raised.value, ValueError if error is sp.InvalidArgumentError else NotImplementedError)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [128, 256])
def test_fp8_on_cuda(causal, d):
    """On a compute capability 9.0 device FP8 inputs run on the Hopper kernel's fp8 instances
    (head_dim 128 and 256): a bfloat16 O close to float64 attention on the dequantized values. Its
    P is rounded to E4M3 before P·V (3 mantissa bits: up to 2^-4 relative per probability), so the
    bound here is the loose one such rounding allows; tests/cuda's oracle test holds it to the
    calibrated tolerance. Other devices refuse, saying why."""
    b, s_q, s_k, h_q, h_kv = 2, 300, 300, 4, 2
    q, k, v, descales = fp8_inputs(71, b, s_q, s_k, h_q, h_kv, d)
    args = [t.cuda() for t in (q, k, v)]
    dev_descales = [t.cuda() for t in descales]
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(sp.UnsupportedError, match="fp8_e4m3 inputs run on the Hopper kernel only"):
            flash_attn_func(*args, causal=causal, **descale_args(dev_descales))
        return
    out = flash_attn_func(*args, causal=causal, **descale_args(dev_descales))
    assert out.dtype == torch.bfloat16 and out.is_cuda and out.shape == q.shape
    qd, kd, vd = (dequantized(x, s).double() for x, s in zip((q, k, v), descales))
    ref = attention(qd, kd, vd, causal)[0]
    rel = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert rel < 0.05, f"relative L2 error {rel:.3e}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("pack_gqa", [False, True])
@pytest.mark.parametrize("d", [128, 256])
def test_fp8_estimate_select_on_cuda_selects_as_its_bf16_twin(pack_gqa, d):
    """estimate_select over FP8 inputs on the Hopper kernels (head_dim 128 and 256, block 128): with
    power-of-two descales the dequantized values are exact in bfloat16, the fp8 selector's
    widened queries and bf16 means are the twin's, and q's descale scales every score exactly,
    so the CUDA run keeps the blocks the bfloat16 twin's CUDA run keeps, bit for bit. O differs
    by the fp8 forward's rounding of P to E4M3 (test_fp8_on_cuda's bound). With mean
    correction the corrected blocks match too, and the correction the fp8 kernel's mean tiles add
    (over the means requantized to E4M3) is the twin's; other devices refuse FP8, saying why."""
    b, s, h_q, h_kv = 2, 1024, 4, 2
    # Key blocks 2 and 5 share a direction u that every query leans towards, so that their
    # energies stand out and alpha prunes the flat rest (random keys alone leave every block
    # within alpha of the peak).
    gen = torch.Generator().manual_seed(73)
    u = torch.randn(d, generator=gen)
    q = (2 * torch.randn((b, s, h_q, d), generator=gen) + 0.5 * u).to(FP8)
    k = 2 * torch.randn((b, s, h_kv, d), generator=gen)
    for blk in (2, 5):
        k[:, 128 * blk:128 * (blk + 1)] += 2 * u
    k = k.to(FP8)
    v = (2 * torch.randn((b, s, h_kv, d), generator=gen)).to(FP8)
    descales = tuple(torch.tensor([[0.5, 2.0], [1.0, 0.25]]) * f for f in (1.0, 0.5, 2.0))
    twin = [dequantized(x, c).to(torch.bfloat16).cuda() for x, c in zip((q, k, v), descales)]
    args = [t.cuda() for t in (q, k, v)]
    dev_descales = descale_args([t.cuda() for t in descales])
    policy = sp.EstimateSelect(block=128, alpha=0.3, sink=1, window=1, tail=1, pack_gqa=pack_gqa)
    if torch.cuda.get_device_capability() != (9, 0):
        with pytest.raises(sp.UnsupportedError, match="fp8_e4m3 inputs run on the Hopper kernel only"):
            sp.run(*args, policy, causal=True, **dev_descales)
        return
    got = sp.run(*args, policy, causal=True, decisions=True, **dev_descales)
    want = sp.run(*twin, policy, causal=True, decisions=True)
    assert got.out.dtype == torch.bfloat16 and got.out.is_cuda
    assert np.array_equal(got.decisions.kept.to_dense(), want.decisions.kept.to_dense())
    assert 0 < got.stats.pair_density < 1
    rel = ((got.out.double() - want.out.double()).norm() / want.out.double().norm()).item()
    assert rel < 0.05, f"relative L2 error against the bf16 twin {rel:.3e}"
    corrected = sp.EstimateSelect(block=128, alpha=0.3, sink=1, window=1, tail=1, pack_gqa=pack_gqa,
                                  mean_correction=True)
    got_c = sp.run(*args, corrected, causal=True, decisions=True, **dev_descales)
    want_c = sp.run(*twin, corrected, causal=True, decisions=True)
    assert np.array_equal(got_c.decisions.kept.to_dense(), want_c.decisions.kept.to_dense())
    assert np.array_equal(got_c.decisions.corrected.to_dense(), want_c.decisions.corrected.to_dense())
    assert got_c.decisions.corrected.to_dense().any()
    rel_c = ((got_c.out.double() - want_c.out.double()).norm() / want_c.out.double().norm()).item()
    assert rel_c < 0.05, f"relative L2 error against the bf16 twin, mean correction {rel_c:.3e}"
    # The correction itself (corrected minus uncorrected), fp8's against the twin's.
    shift = got_c.out.double() - got.out.double()
    want_shift = want_c.out.double() - want.out.double()
    rel_shift = ((shift - want_shift).norm() / want_shift.norm()).item()
    assert rel_shift < 0.25, f"the mean correction's shift of O against the bf16 twin's {rel_shift:.3e}"
