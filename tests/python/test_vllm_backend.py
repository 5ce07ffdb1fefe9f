# SPDX-License-Identifier: Apache-2.0
"""The vLLM backend against vLLM 0.26 on the GPU (skipped without vLLM, CUDA or our CUDA
build), in the pattern of vLLM's own backend tests (tests/v1/attention): real Attention layers,
a real paged KV cache in vLLM's layout, CommonAttentionMetadata for mixed batches (decodes,
short prefills, prefix-cache hits, prefill chunks, fresh prompts), the builder and the impl's
forward.

* dense: every row meets FlashAttention's rule against an fp64 reference, as FLASH_ATTN's
  forward on the same batch does (decodes and short prefills are FLASH_ATTN's own rows, on a
  sub-batch; long prefills our dense kernel);
* policies: the long prefills equal our own library call on each request's keys gathered
  contiguous (no paging, no vLLM), with the same density; the other rows are FLASH_ATTN's
  (within FlashAttention's rule against fp64: FA3's schedule depends on the batch);
* a layer we cannot run (sliding window) equals FLASH_ATTN and says why in one log line;
* pure-decode steps are FLASH_ATTN's metadata alone (its CUDA graphs untouched)."""

import logging
import math

import pytest

torch = pytest.importorskip("torch")
vllm = pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("the vLLM backend tests need a CUDA device", allow_module_level=True)

import sparseprefill as sp  # noqa: E402

if "backend cuda: not compiled" in sp.build_info():
    pytest.skip("sparseprefill was built without CUDA", allow_module_level=True)

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.layers.attention import Attention  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

import sparseprefill.vllm as spv  # noqa: E402
from _torch_refs import assert_calibrated  # noqa: E402
from _torch_refs import attention as ref_attention  # noqa: E402
from sparseprefill.flash_attn_interface import flash_attn_varlen_func  # noqa: E402
from sparseprefill.vllm.backend import SparsePrefillBackend, SparsePrefillMetadataBuilder  # noqa: E402

H, HKV, D, PAGE = 8, 2, 128, 16
DEV = torch.device("cuda")
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H * D, "intermediate_size": 2048,
         "num_hidden_layers": 4, "num_attention_heads": H, "num_key_value_heads": HKV, "head_dim": D,
         "vocab_size": 1024, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False}
# (query_len, seq_len) in MRV2's order: decodes (long contexts), a short prefill, a prefix-cache
# hit (context 1100), a prefill chunk (context 1792), fresh prompts.
MIXED = [(1, 700), (1, 3000), (1, 40), (200, 200), (300, 1400), (768, 2560), (1024, 1024), (1500, 1500)]
# The V1 runner's order without reordering: the kinds interleave.
UNSORTED = [(1500, 1500), (1, 700), (300, 1400), (200, 200), (1, 3000), (1024, 1024)]
MIN_SPARSE_LEN = 1024
STRUCTURE = 3.0  # the weight of the keys' per-block component


@pytest.fixture(scope="module", autouse=True)
def distributed(tmp_path_factory):
    path = tmp_path_factory.mktemp("dist") / "init"
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{path}", local_rank=0,
                                 backend="nccl")
    with set_current_vllm_config(VllmConfig()):  # the groups read the current configuration
        ensure_model_parallel_initialized(1, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("tiny-llama")
    (path / "config.json").write_text(json.dumps(MODEL))
    return str(path)


def engine_config(model_dir, sparseprefill):
    args = EngineArgs(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                      max_model_len=8192, block_size=PAGE, enforce_eager=True, attention_backend="CUSTOM",
                      additional_config={"sparseprefill": sparseprefill})
    return args.create_engine_config()


class Setup:
    """Layers (ours and FLASH_ATTN's, same shapes), a random paged cache in vLLM's layout, and the
    metadata of a batch whose requests own random distinct pages."""

    def __init__(self, model_dir, requests, sparseprefill, sliding_window=None, seed=0):
        self.config = engine_config(model_dir, sparseprefill)
        self.requests = requests
        g = torch.Generator(device="cpu").manual_seed(seed)
        scale = 1.0 / math.sqrt(D)
        with set_current_vllm_config(self.config):
            self.ours = Attention(H, D, scale, HKV, cache_config=self.config.cache_config,
                                  prefix="model.layers.1.self_attn.attn", attn_backend=SparsePrefillBackend,
                                  per_layer_sliding_window=sliding_window)
            self.fa = Attention(H, D, scale, HKV, cache_config=self.config.cache_config,
                                prefix="reference.layers.1.self_attn.attn", attn_backend=FlashAttentionBackend,
                                per_layer_sliding_window=sliding_window)
            spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, dtype=torch.bfloat16,
                                     sliding_window=sliding_window)
            self.builder = SparsePrefillMetadataBuilder(spec, [self.ours.layer_name], self.config, DEV)
            self.fa_builder = FlashAttentionBackend.get_builder_cls()(spec, [self.fa.layer_name], self.config, DEV)
        q_lens = [q for q, _ in requests]
        lens = [s for _, s in requests]
        pages = [math.ceil(s / PAGE) for s in lens]
        num_blocks = sum(pages) + 7
        shape = SparsePrefillBackend.get_kv_cache_shape(num_blocks, PAGE, HKV, D)
        order = SparsePrefillBackend.get_kv_cache_stride_order()
        raw = torch.randn([shape[i] for i in order], generator=g).to(DEV, torch.bfloat16)
        self.kv_cache = raw.permute(*[order.index(i) for i in range(len(order))])
        perm = torch.randperm(num_blocks, generator=g)
        table = torch.zeros(len(requests), max(pages) + 3, dtype=torch.int32)
        used = 0
        k_view, _ = self.kv_cache.transpose(1, 2).split(D, -1)
        for r, n in enumerate(pages):
            table[r, :n] = perm[used:used + n]
            used += n
            # Keys with a shared component per 128 positions, so that key blocks differ in
            # weight and the policies have something to prune (random keys make blocks alike).
            shared = torch.randn(math.ceil(n * PAGE / 128), HKV, D, generator=g).repeat_interleave(128, 0)
            keys = torch.randn(n * PAGE, HKV, D, generator=g) + STRUCTURE * shared[:n * PAGE]
            k_view[table[r, :n].long().to(DEV)] = keys.reshape(n, PAGE, HKV, D).to(DEV, torch.bfloat16)
        self.table = table
        qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.qsl = qsl
        tokens = int(qsl[-1])
        self.cm = CommonAttentionMetadata(
            query_start_loc=qsl.to(DEV), query_start_loc_cpu=qsl, seq_lens=torch.tensor(lens, dtype=torch.int32,
                                                                                         device=DEV),
            num_reqs=len(requests), num_actual_tokens=tokens, max_query_len=max(q_lens), max_seq_len=max(lens),
            block_table_tensor=table.to(DEV), slot_mapping=torch.zeros(tokens, dtype=torch.int64, device=DEV),
            seq_lens_cpu_upper_bound=torch.tensor(lens, dtype=torch.int32))
        # Queries with a shared component per 128 rows of each request too: a query tile then
        # prefers the same key blocks, as in real prompts.
        q = torch.randn(tokens, H, D, generator=g)
        for r, q_len in enumerate(q_lens):
            shared = torch.randn(math.ceil(q_len / 128), H, D, generator=g).repeat_interleave(128, 0)
            q[int(qsl[r]):int(qsl[r + 1])] += STRUCTURE * shared[:q_len]
        self.q = q.to(DEV, torch.bfloat16)
        self.k = torch.randn(tokens, HKV, D, generator=g).to(DEV, torch.bfloat16)
        self.v = torch.randn(tokens, HKV, D, generator=g).to(DEV, torch.bfloat16)

    def run_ours(self):
        meta = self.builder.build(0, self.cm)
        out = torch.full_like(self.q, float("nan"))
        with set_current_vllm_config(self.config):
            self.ours.impl.forward(self.ours, self.q, self.k, self.v, self.kv_cache, meta, out)
        return meta, out

    def run_fa(self):
        meta = self.fa_builder.build(0, self.cm)
        out = torch.full_like(self.q, float("nan"))
        with set_current_vllm_config(self.config):
            self.fa.impl.forward(self.fa, self.q, self.k, self.v, self.kv_cache, meta, out)
        return out

    def rows(self, r):
        return slice(int(self.qsl[r]), int(self.qsl[r + 1]))

    def contiguous_kv(self, r):
        """Request r's keys and values [s_k, h_kv, d], gathered from its pages."""
        k_view, v_view = self.kv_cache.transpose(1, 2).split(D, -1)
        n = self.requests[r][1]
        pages = self.table[r, :math.ceil(n / PAGE)].long().to(DEV)
        return (k_view[pages].reshape(-1, HKV, D)[:n], v_view[pages].reshape(-1, HKV, D)[:n])

    def reference(self, r):
        """Request r's fp64 reference and FlashAttention's low-precision one, [q_len, h_q, d]."""
        k, v = self.contiguous_kv(r)
        q = self.q[self.rows(r)][None]
        return (ref_attention(q, k[None], v[None], causal=True)[0][0],
                ref_attention(q, k[None], v[None], causal=True, low_precision=True)[0][0])

    def sparse_requests(self):
        return [r for r, (q, s) in enumerate(self.requests) if q > 1 and s >= MIN_SPARSE_LEN]


def assert_flash_attn_rows(s, ours, fa, r):
    """Request r is not sparse: its rows in ours are FLASH_ATTN's own, run on a sub-batch of the
    step. FA3 picks its split-KV schedule from the batch, so they may differ from FLASH_ATTN's
    forward on the whole batch by accumulation order (one seed: 2 of 204 800 values 1.4e-3
    apart); both must meet FlashAttention's rule against the fp64 reference."""
    ref, low = s.reference(r)
    assert_calibrated(ours[s.rows(r)], ref, low, what=f"request {r} (FLASH_ATTN on a sub-batch)")
    assert_calibrated(fa[s.rows(r)], ref, low, what=f"request {r} (FLASH_ATTN on the batch)")


def dense_config(**extra):
    return {"policy": "dense", "min_sparse_len": MIN_SPARSE_LEN, **extra}


@pytest.mark.parametrize("requests", [MIXED, UNSORTED], ids=["mixed", "unsorted"])
def test_dense_equals_flash_attn_on_a_mixed_batch(model_dir, requests):
    s = Setup(model_dir, requests, dense_config())
    meta, ours = s.run_ours()
    fa = s.run_fa()
    sparse = s.sparse_requests()
    assert sorted(int(r) for call in meta.sparse for r in call.run.rows) == sparse and sparse
    assert torch.isfinite(ours).all(), "a row of the step was left unwritten"
    for r in range(len(requests)):
        if r not in sparse:
            assert_flash_attn_rows(s, ours, fa, r)
            continue
        ref, low = s.reference(r)
        assert_calibrated(ours[s.rows(r)], ref, low, what=f"request {r} (ours)")
        assert_calibrated(fa[s.rows(r)], ref, low, what=f"request {r} (FLASH_ATTN)")


POLICIES = {
    "estimate_select": {"policy": "estimate_select", "alpha": 0.5},
    "softmax_skip": {"policy": "softmax_skip", "a": 200.0},
    "permute_stop": {"policy": "permute_stop", "tau": 0.3},
    "synthetic": {"policy": "synthetic", "density": 0.2},
    "exact_gate": {"policy": "exact_gate", "budget": 4},  # + the calibration file below
}


@pytest.fixture(scope="module")
def gate_calibration(model_dir, tmp_path_factory):
    """exact_gate thresholds for layer 1, calibrated by the library on the fresh 1024-token
    prompt of the policies' batch (seed 1), at a budget of 4 key blocks."""
    s = Setup(model_dir, MIXED, dense_config(), seed=1)
    r = MIXED.index((1024, 1024))
    k, _ = s.contiguous_kv(r)
    cal = sp.Calibrator(MODEL["num_hidden_layers"], H, budgets=[4], block_q=128, block_k=128)
    cal.add(1, s.q[s.rows(r)][None].contiguous(), k[None].contiguous())
    path = tmp_path_factory.mktemp("gate") / "gate.safetensors"
    cal.save(path)
    return str(path)


@pytest.mark.parametrize("name", list(POLICIES))
def test_policies_equal_our_own_call_on_contiguous_keys(model_dir, gate_calibration, name):
    body = {**POLICIES[name], "min_sparse_len": MIN_SPARSE_LEN}
    if name == "exact_gate":
        body["calibration"] = gate_calibration
    s = Setup(model_dir, MIXED, body, seed=1)
    with sp.collect_stats() as log:
        meta, ours = s.run_ours()
    fa = s.run_fa()
    plan = s.ours.impl.plan(s.ours.layer_name, torch.bfloat16, DEV, PAGE)
    assert plan.decision.sparse
    sparse = s.sparse_requests()
    (call,) = meta.sparse
    # The reference: one varlen call of the library on the sparse requests' keys made
    # contiguous (cu_seqlens_k), under the policy the layer runs (the synthetic mask: made for
    # the same requests by the pure functions, in the form the layer passes, FlexAttention's
    # lists on the device, so that the two calls' statistics name the same policy).
    kv = [s.contiguous_kv(r) for r in sparse]
    q_lens = [s.requests[r][0] for r in sparse]
    k_lens = [s.requests[r][1] for r in sparse]
    policy = plan.policy
    if isinstance(policy, spv.SyntheticDensity):
        counts, indices = spv.flex_lists(spv.synthetic_mask(q_lens, k_lens, policy.block, policy.density))
        policy = sp.BlockSparse(kv_num_blocks=torch.from_numpy(counts).to(DEV),
                                kv_indices=torch.from_numpy(indices).to(DEV), block_q=policy.block,
                                block_k=policy.block)
    cu_q = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + k_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.cat([s.q[s.rows(r)] for r in sparse])
    with sp.collect_stats() as ref_log:
        ref = flash_attn_varlen_func(q, torch.cat([k for k, _ in kv]), torch.cat([v for _, v in kv]), cu_q, cu_k,
                                     max(q_lens), max(k_lens), softmax_scale=1.0 / math.sqrt(D), causal=True,
                                     policy=policy)
    got = torch.cat([ours[s.rows(r)] for r in sparse])
    torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
    (ours_call,) = [c for c in log.calls if c.policy == ref_log.calls[0].policy]
    assert ours_call.density == pytest.approx(ref_log.calls[0].density)
    assert ours_call.density < 1.0  # the policy pruned: the comparison covers its decisions
    if name == "synthetic":
        assert ours_call.density < 0.35  # the mask's 20% (more in short query blocks)
    for r in range(len(MIXED)):
        if r not in sparse:
            assert_flash_attn_rows(s, ours, fa, r)
    assert call.run.context_lens.tolist() == [s.requests[r][1] - s.requests[r][0] for r in sparse]


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_layer_we_cannot_run_is_flash_attn_with_one_log_line(model_dir):
    handler = Lines()
    logger = logging.getLogger("vllm.sparseprefill")
    logger.addHandler(handler)
    try:
        s = Setup(model_dir, MIXED, {"policy": "estimate_select", "min_sparse_len": MIN_SPARSE_LEN},
                  sliding_window=256, seed=2)
        meta, ours = s.run_ours()
        s.run_ours()  # a second step logs nothing more: the layer decides once
    finally:
        logger.removeHandler(handler)
    mine = [line for line in handler.lines if line.startswith("sparseprefill: layer 1:")]
    assert mine == ["sparseprefill: layer 1: FLASH_ATTN for every row: sliding window 256 (not supported)"]
    assert meta.fa_full is not None  # the group has a FLASH_ATTN layer: its whole-batch metadata is built
    torch.testing.assert_close(ours, s.run_fa(), atol=0, rtol=0)  # FLASH_ATTN itself, on the same batch


def test_pure_decode_steps_are_flash_attn_alone(model_dir):
    s = Setup(model_dir, [(1, 5000), (1, 12), (1, 900)], dense_config(), seed=3)
    meta, ours = s.run_ours()
    assert meta.sparse == () and meta.dense == () and meta.fa_full is not None
    torch.testing.assert_close(ours, s.run_fa(), atol=0, rtol=0)
    capture = s.builder.build_for_cudagraph_capture(s.cm)
    assert capture.sparse == () and capture.fa_full is not None
    assert SparsePrefillMetadataBuilder.get_cudagraph_support(s.config, None) == \
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_register_fills_the_custom_slot():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spv.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is SparsePrefillBackend
    assert AttentionBackendEnum[SparsePrefillBackend.get_name()] is AttentionBackendEnum.CUSTOM


def test_a_bad_configuration_fails_the_engine_config_with_its_path(model_dir):
    with pytest.raises(ValueError, match=r"sparseprefill.layers.2.alpha: expected a finite number >= 0"):
        Setup(model_dir, MIXED, {"policy": "estimate_select", "layers": {"2": {"alpha": -1}}})
