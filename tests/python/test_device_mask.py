# SPDX-License-Identifier: Apache-2.0
"""Block masks read in place on the GPU, through the Python API: BlockSparse over CUDA
FlexAttention tensors (and torch's BlockMask object) runs as the same mask read on the host,
bit for bit; select(device=True) leaves estimate_select's selection on the device in Flex's
form, equal to select()'s and running as the policy does; sparseprefill.check() reports a bad
entry once; a captured CUDA graph reads the mask's current contents. CUDA only."""

import pytest

torch = pytest.importorskip("torch")

import sparseprefill as sp  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

H_Q, H_KV, D, S = 4, 2, 128, 700


def inputs(seed, s=S):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, s, H_Q, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, s, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, s, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, k, v


def random_flex(seed, s=S, heads=H_Q):
    """A random causal mask as FlexAttention's four int32 CUDA tensors (blocks of 128)."""
    nb = (s + 127) // 128
    gen = torch.Generator(device="cuda").manual_seed(seed)
    idx = torch.arange(nb, device="cuda")
    keep = (torch.rand(heads, nb, nb, device="cuda", generator=gen) < 0.5) & (idx[None, :] < idx[:, None])[None]
    full_counts = keep.sum(-1).to(torch.int32)[None].contiguous()
    full_idx = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None].contiguous()
    counts = torch.ones(1, heads, nb, dtype=torch.int32, device="cuda")
    partial = torch.zeros(1, heads, nb, nb, dtype=torch.int32, device="cuda")
    partial[..., 0] = idx.to(torch.int32)
    return counts, partial, full_counts, full_idx


def flex_policy(tensors, device=None):
    t = tensors if device is None else tuple(x.to(device) for x in tensors)
    return sp.BlockSparse(kv_num_blocks=t[0], kv_indices=t[1], full_kv_num_blocks=t[2], full_kv_indices=t[3])


def test_cuda_flex_tensors_run_as_the_host_mask():
    q, k, v = inputs(1)
    flex = random_flex(2)
    in_place = sp.run(q, k, v, flex_policy(flex), stats=False).out
    on_host = sp.run(q, k, v, flex_policy(flex, "cpu"), stats=False).out
    assert torch.equal(in_place, on_host)
    sp.check()


def test_torch_block_mask_object_runs_in_place():
    flex_attention = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = inputs(3)
    flex = random_flex(4)
    block_mask = flex_attention.BlockMask.from_kv_blocks(*flex, BLOCK_SIZE=(128, 128))
    got = sp.run(q, k, v, sp.BlockSparse.from_block_mask(block_mask), stats=False).out
    want = sp.run(q, k, v, flex_policy(flex, "cpu"), stats=False).out
    assert torch.equal(got, want)


@pytest.mark.parametrize("pack", [False, True])
def test_select_on_the_device_equals_select_and_runs_as_the_policy(pack):
    q, k, v = inputs(5)
    policy = sp.EstimateSelect(alpha=0.3, sink=1, window=1, tail=1, pack_gqa=pack)
    on_device = sp.select(q, k, v, policy, device=True)
    assert isinstance(on_device, sp.DeviceSelection)
    assert on_device.kv_num_blocks.is_cuda and on_device.kv_num_blocks.dtype == torch.int32
    assert (on_device.to_host().to_dense() == sp.select(q, k, v, policy).mask.to_dense()).all()
    as_policy = sp.run(q, k, v, on_device.to_policy(), stats=False).out
    assert torch.equal(as_policy, sp.run(q, k, v, policy, stats=False).out)


def test_a_bad_entry_is_reported_once_by_check():
    q, k, v = inputs(6)
    counts, partial, full_counts, full_idx = random_flex(7)
    full_counts[0, 1, 3] = 3
    full_idx[0, 1, 3, :3] = torch.tensor([0, 1, 40], dtype=torch.int32)  # 40: past query block 3's causal limit
    sp.run(q, k, v, flex_policy((counts, partial, full_counts, full_idx)), stats=False)
    with pytest.raises(sp.InvalidArgumentError, match=r"full_kv_indices: row \(b 0, h 1, q block 3\) entry 2"):
        sp.check()
    sp.check()  # reported once


def test_a_captured_graph_reads_the_masks_current_contents():
    q, k, v = inputs(8)
    first, second = random_flex(9), random_flex(10)
    live = tuple(x.clone() for x in first)
    policy = flex_policy(live)
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sp.run(q, k, v, policy, out=out, stats=False)  # warm-up: metadata and plans outside capture
        sp.run(q, k, v, policy, out=out, stats=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        sp.run(q, k, v, policy, out=out, stats=False)
    for dst, src in zip(live, second):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, sp.run(q, k, v, flex_policy(second, "cpu"), stats=False).out)
