# SPDX-License-Identifier: Apache-2.0
"""sparseprefill against torch SDPA (flash, cuDNN) and FlexAttention, in one process, on one GPU.

Cases: the Llama-3.1-8B attention shape (h_q 32, h_kv 8, d 128) at 4K..128K and SmolLM2-135M's
(h_q 9, h_kv 3, d 64) at 8K, on random inputs; and the Llama shape at --structured-lengths on
the library's structured generator (StructuredCase: the selectors' figures of issue 5); issue
33's model-family head dims (FamilyCase: MODELS' Phi-3, Gemma 3 and MLA shapes) and sliding
window (WindowCase: the Llama shape with window_size (W, 0)) and chunked local attention
(ChunkCase: attention_chunk C, Llama 4's local layers), where asked; bf16, causal, batch 1.

Implementations:
  peers  SDPA flash backend (FlashAttention-2 in torch), SDPA cuDNN backend (K/V repeated to
         h_q heads beforehand, as ../shared/baselines/measure_baselines.py does), FlexAttention
         dense (every causally visible block, diagonal partial, the rest full) and
         FlexAttention given each random block mask (BlockMask.from_kv_blocks with the
         full/partial split and a causal mask_mod).
  ours   through the C ABI (libsparseprefill_c, ctypes): dense; block_sparse on the SAME masks
         Flex gets, each run through a plan (sp_plan_create once per mask, outside the timed
         region; the timed calls are sp_plan_run: no mask validation, compaction or upload, as
         Flex's BlockMask is also built outside its timed calls); exact_gate with thresholds
         picked from sampled block maxima for ~20% and ~50% density; softmax_skip and
         estimate_select with their default parameters; permute_stop with segment 2048 and
         tau 0.005 (S2O's setting).
         Serving layouts (issue 8): dense and exact_gate ~20% on paged K/V (pages of
         --page-sizes keys in a shuffled order, the same values) at --paged-lengths; and
         chunked prefill at --chunked-lengths: the prompt in chunks of --chunk queries, each
         a call over the prefix so far plus itself (bottom-right causal), every policy, the
         time of all chunks together against the one-shot rows (structured inputs too, at
         --chunked-lengths that are also --structured-lengths: estimate_select+mc told the
         prompt's length, and permute_stop).
         Batched chunks at --batch-lengths: --batch sequences of --batch-chunk queries each at
         the end of the case's length of keys (a batch of chunked-prefill or verify steps;
         bottom-right causal): dense with the GQA packing the plan chooses and with it off
         (SPARSEPREFILL_PACK_GQA=never); peers SDPA flash and cuDNN with the lower-right
         causal bias.

Method:
  - The same inputs for every implementation: q, k, v drawn from randn (never zeros) in bf16,
    once per case. The torch peers read them as [b, h, s, d] (their native layout); ours reads
    contiguous [b, s, h, d] copies of the same values.
  - Inputs rotate over several independent sets whose total exceeds 4x the L2 cache (60 MB on
    the H200), so no call finds its inputs in L2; from 32K up one set is already larger.
  - Masks: per (query head, query block) of 128x128 blocks, each causally visible block kept
    with probability ρ, plus the diagonal and key block 0 (sink); built from block indices,
    never as an N x N element mask. Density = kept / causally visible blocks, measured.
  - Timing: CUDA events on the current stream around each call. One warm-up call (compile,
    autotune, handle creation; for ours also the statistics and the error check), one
    synchronised call that sizes the repetitions (about --budget-ms of device time per
    implementation, at least --min-reps), then the repetitions enqueued back to back, each
    between its own event pair, one synchronisation at the end; the median is reported. The
    host time of each call (no synchronisation) is reported too: when it exceeds the device
    time the GPU waits for the host, and the event time shows that.
  - Work: TFLOP/s = 2·(d + d_v)·pairs / time over the (query, key) pairs actually computed (our
    run statistics; the causal count, or the window's, for dense peers; the mask's count for
    Flex with a mask).
  - Error: relative L2 ‖out − ref‖/‖ref‖ in fp32 against our dense and against SDPA flash (SDPA
    cuDNN where flash lacks the shape), and for block_sparse and the window against Flex on the
    same mask. Outputs of ours are filled with NaN
    before the checked call; a non-finite output is reported as an error.
  - Ratios (bench_report.py): peer time / our time, from this one run.

Writes OUT/bench.json and OUT/bench.md after every case (a run cut short keeps what it had).
"""
import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_report  # noqa: E402
import sp_ctypes  # noqa: E402

BLOCK = 128
DEV = "cuda"

# (h_q, h_kv, d[, d_v]). Beside the Llama and SmolLM2 shapes, issue 33's model families
# (--family-lengths): Phi-3-mini (MHA, d 96), Gemma-3-12B (d 256) and DeepSeek-V2-Lite's MLA
# prefill (MHA, q/k 192, v 128).
MODELS = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64), "phi-3-mini": (32, 32, 96),
          "gemma-3-12b": (16, 8, 256), "deepseek-v2-lite": (16, 16, 192, 128)}
FAMILIES = ("phi-3-mini", "gemma-3-12b", "deepseek-v2-lite")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for bench.json and bench.md")
    ap.add_argument("--lib", help="path to libsparseprefill_c.so")
    ap.add_argument("--peers-only", action="store_true", help="measure the peers alone")
    ap.add_argument("--lengths", default="4096,8192,16384,32768,65536,131072",
                    help="sequence lengths of the Llama-3.1-8B shape")
    ap.add_argument("--small-lengths", default="8192", help="lengths of the SmolLM2 shape")
    ap.add_argument("--densities", default="0.05,0.2,0.5", help="random block-mask densities")
    ap.add_argument("--mask-heads", choices=("q", "kv"), default="q",
                    help="draw each random block mask per query head (q) or per KV head, the "
                         "group's query heads then sharing it (kv: a probe of K/V sharing "
                         "through L2, left out of the issue targets)")
    ap.add_argument("--gate-densities", default="0.2,0.5", help="exact_gate target densities")
    ap.add_argument("--paged-lengths", default="32768,131072",
                    help="Llama-3.1-8B lengths with paged K/V rows (subset of --lengths)")
    ap.add_argument("--page-sizes", default="16,64", help="page sizes of the paged rows")
    ap.add_argument("--chunked-lengths", default="131072",
                    help="Llama-3.1-8B lengths with chunked-prefill rows (subset of --lengths)")
    ap.add_argument("--chunk", type=int, default=8192, help="queries per chunk of the chunked rows")
    ap.add_argument("--batch-lengths", default="",
                    help="Llama-3.1-8B key lengths of the batched-chunks case (none by default)")
    ap.add_argument("--batch", type=int, default=64, help="sequences of the batched-chunks case")
    ap.add_argument("--batch-chunk", type=int, default=32, help="queries per sequence of the batched-chunks case")
    ap.add_argument("--structured-lengths", default="16384,32768,131072",
                    help="Llama-shape lengths of the structured-input cases (issue 5; empty: none)")
    ap.add_argument("--peakedness", type=float, default=1.0, help="structured generator peakedness")
    ap.add_argument("--structured-density", type=float, default=0.05,
                    help="estimate_select density the structured cases tune alpha to")
    ap.add_argument("--family-lengths", default="",
                    help="lengths of issue 33's head-dim cases (dense against SDPA; default none)")
    ap.add_argument("--families", default=",".join(FAMILIES),
                    help=f"model shapes of --family-lengths (some of {', '.join(FAMILIES)})")
    ap.add_argument("--window-lengths", default="",
                    help="lengths of issue 33's sliding-window case (Llama shape; default none)")
    ap.add_argument("--window", type=int, default=4096, help="the window's left size (keys before each query)")
    ap.add_argument("--attention-chunk-lengths", default="",
                    help="lengths of the chunked local attention case (Llama shape; default none)")
    ap.add_argument("--attention-chunk", type=int, default=8192,
                    help="the chunk of that case (positions; a multiple of 128)")
    ap.add_argument("--budget-ms", type=float, default=400.0,
                    help="device time per implementation and case for the repetitions")
    ap.add_argument("--min-reps", type=int, default=3)
    ap.add_argument("--max-reps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel-profile", action="store_true",
                    help="also profile one call of each row of ours (torch.profiler) and record "
                         "the device time of every kernel it launched (key `kernels`)")
    ap.add_argument("--impls", default="",
                    help="comma-separated rows to run (impl names, e.g. sdpa_flash,ours_dense,"
                         "ours_permute_stop); default every row")
    return ap.parse_args()


def ints(s):
    return [int(x) for x in s.split(",") if x]


def floats(s):
    return [float(x) for x in s.split(",") if x]


def commit():
    """SP_COMMIT, else HEAD of this checkout's own repository; "unknown" when the checkout has
    none (the GPU machine's copy: a repository above it would give a stale, foreign hash)."""
    if os.environ.get("SP_COMMIT"):
        return os.environ["SP_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        top, head = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True,
                                   text=True, check=True, cwd=root).stdout.split()
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"
    return head if os.path.realpath(top) == os.path.realpath(root) else "unknown"


def environment(lib):
    props = torch.cuda.get_device_properties(0)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": torch.cuda.get_device_name(), "sm_count": props.multi_processor_count,
            "l2_mb": round(getattr(props, "L2_cache_size", 60 << 20) / (1 << 20)),
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "triton": triton_version,
            "ours": lib.build_info() if lib else None}


# ---------------------------------------------------------------- inputs and masks

class InputSet:
    """One draw of q, k, v in both layouts (same values); paged copies of k, v on demand."""

    def __init__(self, q_bshd, k_bshd, v_bshd):
        self.q_bshd, self.k_bshd, self.v_bshd = q_bshd, k_bshd, v_bshd
        self.q = self.q_bshd.transpose(1, 2).contiguous()
        self.k = self.k_bshd.transpose(1, 2).contiguous()
        self.v = self.v_bshd.transpose(1, 2).contiguous()
        group = self.q.shape[1] // self.k.shape[1]
        self.k_rep = self.k.repeat_interleave(group, 1)
        self.v_rep = self.v.repeat_interleave(group, 1)
        self.paged = {}
        self.e4m3 = None

    def fp8(self):
        """(q, k, v in float8_e4m3fn, their descales [1, h_kv] float32): each (kv head)'s
        values scaled so that its largest magnitude maps to 448, E4M3's largest, as an FP8
        serving stack quantizes per head (q per the kv head of its group)."""
        if self.e4m3 is None:
            h_kv = self.k_bshd.shape[2]
            out = []
            for x in (self.q_bshd, self.k_bshd, self.v_bshd):
                g = x.shape[2] // h_kv
                amax = x.float().abs().view(1, x.shape[1], h_kv, g, -1).amax(dim=(1, 3, 4))  # [1, h_kv]
                descale = (amax / 448.0).clamp_min(1e-12)
                scaled = x.float() / descale.repeat_interleave(g, 1)[:, None, :, None]
                out.append((scaled.to(torch.float8_e4m3fn), descale.contiguous()))
            self.e4m3 = out
        return self.e4m3

    @classmethod
    def random(cls, h_q, h_kv, d, n, gen, d_v=None):
        return cls(*(torch.randn(1, n, h, w, device=DEV, dtype=torch.bfloat16, generator=gen)
                     for h, w in ((h_q, d), (h_kv, d), (h_kv, d_v or d))))

    @classmethod
    def structured(cls, lib, h_q, h_kv, d, n, seed, peakedness):
        """The library's structured generator (sinks, local windows, stripes, slash diagonals:
        docs/generator.md), made on the host and copied to the GPU."""
        host = [torch.empty(1, n, h, d, dtype=torch.bfloat16) for h in (h_q, h_kv, h_kv)]
        lib.generate(sp_ctypes.GeneratorConfig(1, n, n, h_q, h_kv, d, seed, peakedness),
                     *[sp_ctypes.tensor_from_torch(t) for t in host])
        return cls(*(t.to(DEV) for t in host))

    def pages(self, page, gen):
        """(k_pages, v_pages [n / page, page, h_kv, d], block_table [1, n / page] int32 on
        the host, seqused_k [1]): key t in row t % page of page table[t // page], the pages
        in a shuffled order."""
        if page not in self.paged:
            _, n, h_kv, d = self.k_bshd.shape
            count = -(-n // page)
            order = torch.randperm(count, device=DEV, generator=gen)
            k_pages = torch.empty(count, page, h_kv, d, device=DEV, dtype=self.k_bshd.dtype)
            v_pages = torch.empty_like(k_pages)
            pad = count * page - n
            k_pages[order] = F.pad(self.k_bshd[0], (0, 0, 0, 0, 0, pad)).view(count, page, h_kv, d)
            v_pages[order] = F.pad(self.v_bshd[0], (0, 0, 0, 0, 0, pad)).view(count, page, h_kv, d)
            table = order.to(torch.int32).view(1, count).cpu()
            self.paged[page] = (k_pages, v_pages, table, torch.tensor([n], dtype=torch.int32))
        return self.paged[page]


def random_block_map(h, nb, density, gen):
    """keep [1, h, nb, nb] bool: causal blocks kept with probability `density`, plus the
    diagonal and key block 0 (density >= 1: every causally visible block)."""
    qb = torch.arange(nb, device=DEV)
    causal = qb[:, None] >= qb[None, :]
    if density >= 1.0:
        return causal.expand(1, h, nb, nb).clone()
    keep = torch.rand(1, h, nb, nb, device=DEV, generator=gen) < density
    keep[..., 0] = True
    keep |= torch.eye(nb, dtype=torch.bool, device=DEV)
    return keep & causal


class Mask:
    """One block map in the forms each implementation takes; s_q = s_k = nb·BLOCK, so the
    diagonal block is the only partial one of each row."""

    def __init__(self, keep, label, target):
        _, h, nb, _ = keep.shape
        self.label, self.target = label, target
        qb = torch.arange(nb, device=DEV)
        full = keep & (qb[:, None] > qb[None, :])
        full_cnt = full.sum(-1).to(torch.int32)
        full_idx = torch.argsort(full.to(torch.int8), dim=-1, descending=True,
                                 stable=True).to(torch.int32)
        part_cnt = torch.ones(1, h, nb, dtype=torch.int32, device=DEV)
        part_idx = qb.view(1, 1, nb, 1).expand(1, h, nb, nb).contiguous().to(torch.int32)
        self.flex = BlockMask.from_kv_blocks(part_cnt, part_idx, full_cnt, full_idx,
                                             BLOCK_SIZE=BLOCK, mask_mod=causal_mod)
        kept = int(keep.sum())
        visible = h * nb * (nb + 1) // 2
        self.density = kept / visible
        n_full = int(full_cnt.sum())
        self.pairs = n_full * BLOCK * BLOCK + h * nb * BLOCK * (BLOCK + 1) // 2
        # CSR over rows (b=0, h, qb): nonzero() lists (h, qb, kb) in row-major order, so each
        # row's key blocks come out ascending.
        counts = keep[0].sum(-1).reshape(-1).to(torch.int64)
        self.indptr = torch.zeros(counts.numel() + 1, dtype=torch.int32)
        self.indptr[1:] = torch.cumsum(counts, 0).to(torch.int32).cpu()
        self.indices = keep[0].nonzero()[:, 2].to(torch.int32).cpu().contiguous()
        self.num_rows = counts.numel()


def causal_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window_block_mask(n, w, device=DEV):
    """FlexAttention's BlockMask of window_size (w, 0) with causal at s_q = s_k = n, built from
    block indices (never as an n x n mask), [1, 1, nb, ...] for every head: per query block qb,
    the key blocks all of whose keys every row sees (full: first_full .. qb - 1) and the partial
    ones (those the window's left edge cuts, first .. first_full - 1, and the causal diagonal)."""
    nb = n // BLOCK
    qb = torch.arange(nb, device=device)
    j = torch.arange(nb, device=device)
    # Row r sees keys r - w .. r: the block's first row sees from qb·B − w, its last from qb·B + B − 1 − w.
    first = torch.clamp(torch.div(qb * BLOCK - w, BLOCK, rounding_mode="floor"), min=0)
    first_full = torch.minimum(torch.clamp(-torch.div(w - qb * BLOCK - (BLOCK - 1), BLOCK, rounding_mode="floor"),
                                           min=0), qb)
    left = first_full - first
    part_idx = torch.where(j[None, :] < left[:, None], first[:, None] + j[None, :], qb[:, None])
    full_cnt = qb - first_full
    full_idx = torch.where(j[None, :] < full_cnt[:, None], first_full[:, None] + j[None, :], 0)

    def window_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= w)

    def as4(t):
        return t.view(1, 1, *t.shape).to(torch.int32).contiguous()

    return BlockMask.from_kv_blocks(as4(left + 1), as4(part_idx), as4(full_cnt), as4(full_idx),
                                   BLOCK_SIZE=BLOCK, mask_mod=window_mod)


def sample_gate_thresholds(s, h_q, h_kv, d, n, targets, gen):
    """Thresholds T with P(block max ≥ T) ≈ target over full blocks, from the exact block
    maxima of scale·QKᵀ of sampled (head, query block) pairs. The inputs are iid, so one
    value per target serves every head and position."""
    nb = n // BLOCK
    group = h_q // h_kv
    scale = 1.0 / math.sqrt(d)
    maxima = []
    samples = 48
    heads = torch.randint(0, h_q, (samples,), generator=gen, device=DEV).tolist()
    qbs = torch.randint(1, max(2, nb), (samples,), generator=gen, device=DEV).tolist()
    for h, qb in zip(heads, qbs):
        qb = min(qb, nb - 1)
        if qb < 1:
            continue
        qblk = s.q[0, h, qb * BLOCK:(qb + 1) * BLOCK].float()
        keys = s.k[0, h // group, :qb * BLOCK].float()
        scores = (qblk @ keys.T) * scale
        maxima.append(scores.view(BLOCK, qb, BLOCK).amax(dim=(0, 2)))
    allm = torch.sort(torch.cat(maxima)).values
    out = {}
    for t in targets:
        i = min(allm.numel() - 1, max(0, int(round((1.0 - t) * allm.numel()))))
        out[t] = float(allm[i])
    return out


# ---------------------------------------------------------------- timing

def time_calls(fn, n_sets, args):
    """fn(i) runs one call on input set i. Returns (median device ms, median host ms, reps).
    The caller has made the warm-up call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn(1 % n_sets)
    torch.cuda.synchronize()
    estimate_ms = (time.perf_counter() - t0) * 1e3
    reps = int(min(args.max_reps, max(args.min_reps, args.budget_ms // max(estimate_ms, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    host = []
    for r in range(reps):
        starts[r].record()
        h0 = time.perf_counter()
        fn(r % n_sets)
        host.append((time.perf_counter() - h0) * 1e3)
        ends[r].record()
    torch.cuda.synchronize()
    device = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return statistics.median(device), statistics.median(host), reps


def kernel_name(name):
    """A kernel's function name without namespaces, template arguments or parameters:
    'void ns::sm80::permute_kernel<Cfg<...>>(P)' -> 'permute_kernel'; copies and sets keep their
    kind ('Memcpy HtoD')."""
    if name.startswith(("Memcpy", "Memset")):
        return name.split("(")[0].strip()
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    words = "".join(out).split()
    return words[-1].split("::")[-1] if words else name


def kernel_times(fn):
    """Runs fn() once under torch.profiler: [[kernel, launches, device ms], ...], longest first
    (launches of one function summed)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            name = kernel_name(e.name)
            n, us = totals.get(name, (0, 0.0))
            totals[name] = (n + 1, us + e.device_time_total)
    return sorted(([k, n, us / 1e3] for k, (n, us) in totals.items()), key=lambda r: -r[2])


def rel_l2(out, ref):
    if out is None or ref is None:
        return None
    o, r = out.float(), ref.float()
    if not torch.isfinite(o).all():
        return float("nan")
    return float((o - r).norm() / r.norm())


# ---------------------------------------------------------------- one case

class Case:
    def __init__(self, model, n, args, lib):
        self.model, self.n, self.args, self.lib = model, n, args, lib
        self.h_q, self.h_kv, self.d, *d_v = MODELS[model]
        self.d_v = d_v[0] if d_v else self.d
        set_bytes = 2 * n * (self.d * (self.h_q + self.h_kv) + self.d_v * self.h_kv)
        l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 60 << 20)
        self.n_sets = max(1, min(16, math.ceil(4 * l2 / set_bytes)))
        gen = torch.Generator(device=DEV)
        gen.manual_seed(args.seed * 1000003 + n * 31 + self.h_q)
        self.gen = gen
        self.sets = self.make_sets()
        self.n_sets = len(self.sets)
        self.record = {"model": model, "n": n, "h_q": self.h_q, "h_kv": self.h_kv, "d": self.d, "d_v": self.d_v,
                       "inputs": self.INPUTS, "n_sets": self.n_sets, "set_mb": set_bytes / 1e6, "rows": []}
        self.dense_pairs = self.h_q * n * (n + 1) // 2
        self.ref_sdpa = None
        self.ref_ours = None
        self.window = None
        self.attention_chunk = 0
        self.flex_out = {}

    INPUTS = "random"

    def make_sets(self):
        return [InputSet.random(self.h_q, self.h_kv, self.d, self.n, self.gen, self.d_v) for _ in range(self.n_sets)]

    def add(self, row):
        row.setdefault("status", "ok")
        if row.get("ms") and row.get("pairs"):
            row["tflops"] = 2 * (self.d + self.d_v) * row["pairs"] / row["ms"] / 1e9
        self.record["rows"].append(row)
        shown = f"{row['ms']:.3f} ms" if row.get("ms") else row["status"]
        print(f"  {row['label']:<28} {shown:>14}  density {row.get('density')}  "
              f"err_sdpa {row.get('err_vs_sdpa')}  {row.get('note', '')}", flush=True)

    def wanted(self, impl):
        return not self.args.impls or impl in self.args.impls.split(",")

    def peer(self, impl, label, fn, backend=None, pairs=None, density=1.0, target=None):
        if not self.wanted(impl):
            return None
        row = {"impl": impl, "label": label, "family": "peer", "target": target,
               "density": density, "pairs": pairs or self.dense_pairs}
        try:
            ctx = sdpa_kernel(backend) if backend is not None else _Null()
            with ctx:
                out = fn(0)  # warm-up and the checked output
                torch.cuda.synchronize()
                row["ms"], row["host_ms"], row["reps"] = time_calls(fn, self.n_sets, self.args)
        except Exception as e:  # a peer that cannot run this case is reported, not fatal
            row.update(status="error", note=f"{type(e).__name__}: {str(e)[:300]}")
            self.add(row)
            return None
        out_bshd = out.transpose(1, 2)
        if impl == "sdpa_flash" or (impl == "sdpa_cudnn" and self.ref_sdpa is None):
            self.ref_sdpa = out_bshd
        row["err_vs_sdpa"] = rel_l2(out_bshd, self.ref_sdpa)
        self.add(row)
        return out_bshd

    def run_peers(self, masks):
        s = self.sets
        self.peer("sdpa_flash", "SDPA flash",
                  lambda i: F.scaled_dot_product_attention(s[i].q, s[i].k, s[i].v,
                                                           is_causal=True, enable_gqa=True),
                  backend=SDPBackend.FLASH_ATTENTION)
        self.peer("sdpa_cudnn", "SDPA cuDNN",
                  lambda i: F.scaled_dot_product_attention(s[i].q, s[i].k_rep, s[i].v_rep,
                                                           is_causal=True),
                  backend=SDPBackend.CUDNN_ATTENTION)
        for m in masks:
            impl = "flex_dense" if m.target is None else "flex_mask"
            label = "Flex dense" if m.target is None else f"Flex mask {m.label}"
            out = self.peer(impl, label,
                            lambda i, bm=m.flex: FLEX(s[i].q, s[i].k, s[i].v, block_mask=bm,
                                                      enable_gqa=True),
                            pairs=m.pairs, density=m.density, target=m.target)
            if m.target is not None:
                self.flex_out[m.target] = out

    # ---- ours

    def problem(self, s, page=None, rows=None, fp8=False):
        """The problem of input set s: contiguous K/V, or paged with `page` keys per page;
        rows = (c0, c1): the chunk of queries c0..c1-1 over keys 0..c1-1 (views, no copy);
        fp8: the set quantized to E4M3 with per-(kv head) descales (contiguous, whole)."""
        c0, c1 = rows if rows is not None else (0, self.n)
        p = sp_ctypes.Problem()
        p.q = sp_ctypes.tensor_from_torch(s.q_bshd[:, c0:c1])
        if fp8:
            (q8, qd), (k8, kd), (v8, vd) = s.fp8()
            p.q, p.k, p.v = (sp_ctypes.tensor_from_torch(t) for t in (q8, k8, v8))
            p.q_descale, p.k_descale, p.v_descale = (sp_ctypes.tensor_from_torch(t) for t in (qd, kd, vd))
        elif page is None:
            p.k = sp_ctypes.tensor_from_torch(s.k_bshd[:, :c1])
            p.v = sp_ctypes.tensor_from_torch(s.v_bshd[:, :c1])
        else:
            k_pages, v_pages, table, used = s.pages(page, self.gen)
            p.k = sp_ctypes.tensor_from_torch(k_pages)
            p.v = sp_ctypes.tensor_from_torch(v_pages)
            p.block_table = sp_ctypes.tensor_from_torch(table)
            p.seqused_k = sp_ctypes.tensor_from_torch(used)
        p.causal = 1
        p.scale = 0.0
        if self.window is not None:
            p.local, p.window_left, p.window_right = 1, self.window, 0
        p.attention_chunk = self.attention_chunk
        return p

    def ours(self, impl, label, policy, target=None, mask_pairs=None, mask_density=None,
             extra=None, page=None, chunk=None, planned=False, fp8=False, twin=None):
        """One row of ours: a call per input set, or with `chunk` the calls of a chunked
        prefill (every chunk of the prompt, each writing its rows of one output). planned: the
        calls run sp_plans made once per call shape, outside the timed region (block_sparse:
        the mask is validated, compacted and uploaded there, as a server would do once per
        mask), instead of sp_run with the policy. twin: the output of the same policy on the
        bf16 inputs (an fp8 row's err_vs_bf16: FP8's operator error under the policy)."""
        if not self.wanted(impl):
            return None
        lib = self.lib
        row = {"impl": impl, "label": label, "family": "ours", "target": target,
               "params": policy.describe(), "planned": planned, **(extra or {})}
        if page is not None:
            row["page_size"] = page
        if chunk is not None:
            row["chunk"] = chunk
        spans = [(c0, min(self.n, c0 + chunk)) for c0 in range(0, self.n, chunk)] if chunk else [None]
        q0 = self.sets[0].q_bshd
        o = q0.new_empty(*q0.shape[:-1], self.d_v)
        outs = []
        for span in spans:
            out = sp_ctypes.Output()
            out.o = sp_ctypes.tensor_from_torch(o if span is None else o[:, span[0]:span[1]])
            outs.append(out)
        # Per input set, the (problem, output) of each call it takes.
        calls = [[(self.problem(s, page, span, fp8), out) for span, out in zip(spans, outs)] for s in self.sets]
        opts = sp_ctypes.Options(sp_ctypes.BACKEND_CUDA, 0,
                                 torch.cuda.current_stream().cuda_stream)
        code = lib.can_run(calls[0][-1][0], policy, sp_ctypes.BACKEND_CUDA)
        if code != sp_ctypes.OK:
            row.update(status=lib.status_name(code), note=lib.last_error())
            self.add(row)
            return None
        if planned:
            try:
                plans = [lib.plan(problem, policy, opts) for problem, _ in calls[0]]
            except sp_ctypes.SparsePrefillError as e:
                row.update(status=lib.status_name(e.code), note=str(e))
                self.add(row)
                return None

            def run_one(j, problem, out, stats):
                return lib.plan_run(plans[j], problem, out, opts, stats)
        else:
            def run_one(j, problem, out, stats):
                return lib.run(problem, policy, out, opts, stats)
        # Warm-up and checked call(s), with statistics (they synchronise).
        o.fill_(float("nan"))
        notes = []
        totals = {"kept": 0, "visible": 0, "pairs": 0, "corrected": 0}
        for j, (problem, out) in enumerate(calls[0]):
            stats = sp_ctypes.Stats()
            code = run_one(j, problem, out, stats)
            if code != sp_ctypes.OK:
                break
            totals["kept"] += stats.total.kept_blocks
            totals["visible"] += stats.total.visible_blocks
            totals["pairs"] += stats.total.computed_pairs
            totals["corrected"] += stats.total.corrected_blocks
        if code != sp_ctypes.OK:
            notes.append(f"statistics unavailable ({lib.status_name(code)}: {lib.last_error()})")
            o.fill_(float("nan"))
            for j, (problem, out) in enumerate(calls[0]):
                code = run_one(j, problem, out, None)
                if code != sp_ctypes.OK:
                    row.update(status=lib.status_name(code), note=lib.last_error())
                    self.add(row)
                    return None
            row["density"] = mask_density if mask_density is not None else None
            row["pairs"] = mask_pairs if mask_pairs is not None else self.dense_pairs
        else:
            row["density"] = totals["kept"] / totals["visible"] if totals["visible"] else 1.0
            row["pairs"] = totals["pairs"]
            row["corrected_blocks"] = totals["corrected"]
            if mask_pairs is not None and totals["pairs"] != mask_pairs:
                notes.append(f"computed pairs {totals['pairs']} != mask pairs {mask_pairs}")
        torch.cuda.synchronize()
        result = o.clone()

        codes = []

        def call(i):
            for j, (problem, out) in enumerate(calls[i]):
                codes.append(run_one(j, problem, out, None))

        row["ms"], row["host_ms"], row["reps"] = time_calls(call, self.n_sets, self.args)
        if self.args.kernel_profile:
            row["kernels"] = kernel_times(lambda: call(0))
        failed = [c for c in codes if c != sp_ctypes.OK]
        if failed:
            row.update(status=lib.status_name(failed[0]),
                       note=f"{len(failed)} timed call(s) failed: {lib.last_error()}")
            self.add(row)
            return None
        if impl == "ours_dense":
            self.ref_ours = result
        row["err_vs_ours_dense"] = rel_l2(result, self.ref_ours)
        row["err_vs_sdpa"] = rel_l2(result, self.ref_sdpa)
        if twin is not None:
            row["err_vs_bf16"] = rel_l2(result, twin)
        if impl in ("ours_block_sparse", "ours_dense_window", "ours_dense_chunk"):
            row["err_vs_flex_mask"] = rel_l2(result, self.flex_out.get(target))
        if notes:
            row["note"] = "; ".join(notes)
        self.add(row)
        return result

    def run_ours(self, masks):
        lib = self.lib
        self.ours("ours_dense", "ours dense", lib.policy("dense"))
        # Its error against ours dense is FP8's against the bf16 result (issue #4).
        self.ours("ours_dense_fp8", "ours dense fp8 (e4m3)", lib.policy("dense"), fp8=True)
        first = self.problem(self.sets[0])
        for m in masks:
            if m.target is None or not self.wanted("ours_block_sparse"):
                continue
            pol = lib.policy("block_sparse")
            pol.set_block_mask(first, BLOCK, BLOCK, m.indptr.data_ptr(), m.num_rows,
                               m.indices.data_ptr(), m.indices.numel())
            self.ours("ours_block_sparse", f"ours block_sparse {m.label}", pol, target=m.target,
                      mask_pairs=m.pairs, mask_density=m.density, planned=True)
        gate_targets = floats(self.args.gate_densities) if self.wanted("ours_exact_gate") else []
        thresholds = sample_gate_thresholds(self.sets[0], self.h_q, self.h_kv, self.d, self.n,
                                            gate_targets, self.gen) if gate_targets else {}
        for t in gate_targets:
            pol = lib.policy("exact_gate", {"block_q": BLOCK, "block_k": BLOCK})
            table = torch.full((self.h_q, 1), thresholds[t], dtype=torch.float32, device=DEV)
            pol.set_thresholds(sp_ctypes.tensor_from_torch(table), owner=table)
            self.ours("ours_exact_gate", f"ours exact_gate ~{t:.0%}", pol, target=t,
                      extra={"threshold": thresholds[t]})
        self.ours("ours_softmax_skip", "ours softmax_skip (a=10)", lib.policy("softmax_skip"))
        self.ours("ours_estimate_select", "ours estimate_select (α=0.1)",
                  lib.policy("estimate_select"))
        self.ours("ours_permute_stop", "ours permute_stop (τ=0.005)",
                  lib.policy("permute_stop", {"segment": 2048, "tau": 0.005}))
        gate20 = None
        if 0.2 in thresholds:
            gate20 = lib.policy("exact_gate", {"block_q": BLOCK, "block_k": BLOCK})
            table20 = torch.full((self.h_q, 1), thresholds[0.2], dtype=torch.float32, device=DEV)
            gate20.set_thresholds(sp_ctypes.tensor_from_torch(table20), owner=table20)
        if self.n in ints(self.args.paged_lengths):
            for page in ints(self.args.page_sizes):
                self.ours(f"ours_dense_paged{page}", f"ours dense paged {page}", lib.policy("dense"), page=page)
                if gate20 is not None:
                    self.ours(f"ours_exact_gate_paged{page}", f"ours exact_gate ~20% paged {page}", gate20,
                              target=0.2, page=page, extra={"threshold": thresholds[0.2]})
            for s in self.sets:
                s.paged.clear()
        if self.n in ints(self.args.chunked_lengths):
            k = self.args.chunk
            self.ours("ours_dense_chunked", f"ours dense chunks of {k}", lib.policy("dense"), chunk=k)
            if gate20 is not None:
                self.ours("ours_exact_gate_chunked", f"ours exact_gate ~20% chunks of {k}", gate20,
                          target=0.2, chunk=k, extra={"threshold": thresholds[0.2]})
            self.ours("ours_softmax_skip_chunked", f"ours softmax_skip (a=10) chunks of {k}",
                      lib.policy("softmax_skip"), chunk=k)
            self.ours("ours_estimate_select_chunked", f"ours estimate_select (α=0.1) chunks of {k}",
                      lib.policy("estimate_select"), chunk=k)
            self.ours("ours_permute_stop_chunked", f"ours permute_stop (τ=0.005) chunks of {k}",
                      lib.policy("permute_stop", {"segment": 2048, "tau": 0.005}), chunk=k)

    def run(self):
        nb = self.n // BLOCK
        masks = [Mask(random_block_map(self.h_q, nb, 1.0, self.gen), "dense", None)]
        group = self.h_q // self.h_kv if self.args.mask_heads == "kv" else 1
        if group > 1:
            self.record["mask_heads"] = "kv"
        for dens in floats(self.args.densities):
            keep = random_block_map(self.h_q // group, nb, dens, self.gen).repeat_interleave(group, dim=1)
            masks.append(Mask(keep, f"{dens:.0%}", dens))
            del keep
        self.run_peers(masks)
        if self.lib is not None:
            self.run_ours(masks)
        return self.record


class StructuredCase(Case):
    """Issue 5's figures need inputs a selector can be sparse on: one set from the structured
    generator (--peakedness), alpha tuned on it to --structured-density, then: estimate_select
    without and with mean correction (and with pack_gqa, alpha tuned again); block_sparse planned on the selector's own mask (the
    attention alone, so that selection time = estimate_select − it); the selection alone through
    sp_select (synchronising: its time includes copying the mask to the host and building it
    there, an upper bound); permute_stop at S2O's setting, and estimate_select+mc again at the
    density permute_stop reached (their errors side by side). Peers: SDPA flash and cuDNN."""

    INPUTS = "structured"

    def make_sets(self):
        # One set: the generator runs on the host (about 8 s at 128K), and one 16K set already
        # exceeds 3x the L2 cache.
        return [InputSet.structured(self.lib, self.h_q, self.h_kv, self.d, self.n,
                                    self.args.seed, self.args.peakedness)]

    def options(self):
        return sp_ctypes.Options(sp_ctypes.BACKEND_CUDA, 0, torch.cuda.current_stream().cuda_stream)

    def select_density(self, policy):
        stats = sp_ctypes.Stats()
        decisions = self.lib.select(self.problem(self.sets[0]), policy, self.options(), stats)
        return stats.total.kept_blocks / stats.total.visible_blocks, decisions

    def estimate_policy(self, alpha, mc=False, packed=False):
        return self.lib.policy("estimate_select", {"alpha": repr(alpha), "mean_correction": int(mc),
                                                   "pack_gqa": int(packed)})

    def alpha_for(self, target, packed=False):
        """Bisection on log alpha (density falls as alpha grows) to the density nearest target."""
        lo, hi = 1e-9, 1.0
        best = None
        for _ in range(16):
            mid = math.sqrt(lo * hi)
            dens, _ = self.select_density(self.estimate_policy(mid, packed=packed))
            if best is None or abs(dens - target) < abs(best[1] - target):
                best = (mid, dens)
            if dens > target:
                lo = mid
            else:
                hi = mid
        return best

    def time_selection(self, policy, target):
        row = {"impl": "ours_select", "label": f"ours estimate_select ~{target:.0%}: selection alone",
               "family": "ours", "target": target, "params": policy.describe(),
               "note": "sp_select: synchronises, copies the mask to the host and builds it there"}
        problem, opts = self.problem(self.sets[0]), self.options()
        try:
            self.lib.select(problem, policy, opts)
            row["ms"], row["host_ms"], row["reps"] = time_calls(
                lambda i: self.lib.select(problem, policy, opts), 1, self.args)
        except sp_ctypes.SparsePrefillError as e:
            row.update(status=self.lib.status_name(e.code), note=str(e))
        self.add(row)

    def run(self):
        self.run_peers([])
        if self.lib is None:
            return self.record
        lib, target = self.lib, self.args.structured_density
        self.ours("ours_dense", "ours dense", lib.policy("dense"))
        alpha, dens = self.alpha_for(target)
        self.record.update(alpha=alpha, alpha_density=dens)
        print(f"  alpha {alpha:.4g} gives density {dens:.4f}", flush=True)
        bf16 = self.ours("ours_estimate_select", f"ours estimate_select ~{target:.0%}",
                         self.estimate_policy(alpha), target=target, extra={"alpha": alpha})
        # The same alpha on the E4M3 quantization of the set (per-KV-head descales): issue 33's
        # FP8 figure, its speed against the row above and its error against that row's output.
        self.ours("ours_estimate_select_fp8", f"ours estimate_select fp8 (e4m3) ~{target:.0%}",
                  self.estimate_policy(alpha), target=target, extra={"alpha": alpha}, fp8=True, twin=bf16)
        bf16_mc = self.ours("ours_estimate_select_mc", f"ours estimate_select+mc ~{target:.0%}",
                            self.estimate_policy(alpha, mc=True), target=target, extra={"alpha": alpha})
        # With mean correction on the E4M3 set: the fp8 forward's mean tiles (issue 33's FP8 figure).
        self.ours("ours_estimate_select_mc_fp8", f"ours estimate_select+mc fp8 (e4m3) ~{target:.0%}",
                  self.estimate_policy(alpha, mc=True), target=target, extra={"alpha": alpha}, fp8=True,
                  twin=bf16_mc)
        if self.wanted("ours_estimate_select_mc_packed"):
            # pack_gqa: one selection per KV group (FlashPrefill V2's own configuration); the
            # heads of a group then read the same key blocks, adjacent in the grid (L2 reuse).
            alpha_p, dens_p = self.alpha_for(target, packed=True)
            print(f"  pack_gqa: alpha {alpha_p:.4g} gives density {dens_p:.4f}", flush=True)
            self.ours("ours_estimate_select_mc_packed", f"ours estimate_select+mc pack_gqa ~{target:.0%}",
                      self.estimate_policy(alpha_p, mc=True, packed=True), target=target,
                      extra={"alpha": alpha_p})
        _, decisions = self.select_density(self.estimate_policy(alpha))
        view = decisions.mask(sp_ctypes.MASK_KEPT)
        mask = lib.policy("block_sparse")
        mask.set_block_mask(self.problem(self.sets[0]), view.block_q, view.block_k,
                            ctypes.cast(view.indptr, ctypes.c_void_p).value, view.num_rows,
                            ctypes.cast(view.indices, ctypes.c_void_p).value, view.num_indices,
                            per_kv_head=bool(view.per_kv_head))
        del decisions
        self.ours("ours_block_sparse", f"ours block_sparse, its selection ~{target:.0%}", mask,
                  target=target, planned=True)
        self.time_selection(self.estimate_policy(alpha), target)
        self.ours("ours_permute_stop", "ours permute_stop (τ=0.005)",
                  lib.policy("permute_stop", {"segment": 2048, "tau": 0.005}))
        if self.n in ints(self.args.chunked_lengths):
            # Issue 8 on inputs the selectors are sparse on: the prompt in chunks, each over the
            # keys so far; estimate_select told the prompt's length, so that its tail is the
            # prompt's (the one-shot call's decisions, docs/semantics.md §1).
            k = self.args.chunk
            self.ours("ours_dense_chunked", f"ours dense chunks of {k}", lib.policy("dense"), chunk=k)
            chunked = self.estimate_policy(self.record["alpha"], mc=True)
            prompt_len = torch.tensor([self.n], dtype=torch.int32)
            chunked.set_prompt_len(sp_ctypes.tensor_from_torch(prompt_len), owner=prompt_len)
            self.ours("ours_estimate_select_mc_chunked", f"ours estimate_select+mc ~{target:.0%} chunks of {k}",
                      chunked, target=target, chunk=k, extra={"alpha": self.record["alpha"]})
            self.ours("ours_permute_stop_chunked", f"ours permute_stop (τ=0.005) chunks of {k}",
                      lib.policy("permute_stop", {"segment": 2048, "tau": 0.005}), chunk=k)
        # Issue 5 reports permute_stop's error against dense beside estimate_select's at the
        # same density: alpha tuned again, to the density permute_stop reached.
        permute = next((r for r in self.record["rows"]
                        if r["impl"] == "ours_permute_stop" and r.get("density")), None)
        if permute is not None and self.wanted("ours_estimate_select_mc_matched"):
            alpha, dens = self.alpha_for(permute["density"])
            print(f"  alpha {alpha:.4g} gives density {dens:.4f} (permute_stop's {permute['density']:.4f})",
                  flush=True)
            self.ours("ours_estimate_select_mc_matched", "ours estimate_select+mc at permute_stop's density",
                      self.estimate_policy(alpha, mc=True), extra={"alpha": alpha})
        return self.record


class FamilyCase(Case):
    """Issue 33's model-family head dims (--family-lengths, --families): ours dense against SDPA
    flash and cuDNN on random inputs (a peer that lacks the shape is reported as such; the error
    column is against cuDNN where SDPA flash cannot run), and at d 256 ours dense on the inputs
    quantized to E4M3 (the fp8 instance's head dims: 128, 256)."""

    def run(self):
        self.run_peers([])
        if self.lib is not None:
            self.ours("ours_dense", "ours dense", self.lib.policy("dense"))
            if self.d == self.d_v == 256:
                self.ours("ours_dense_fp8", "ours dense fp8 (e4m3)", self.lib.policy("dense"), fp8=True)
        return self.record


class WindowCase(Case):
    """Issue 33's local attention (--window-lengths, --window W): FlashAttention's
    window_size=(W, 0) with causal, each query seeing itself and the W keys before it. Ours dense
    with that window against FlexAttention given the same window (window_block_mask: from block
    indices, built outside the timed calls, as the block masks are); work counts the window's
    pairs."""

    def __init__(self, model, n, args, lib):
        super().__init__(model, n, args, lib)
        w = self.window = args.window
        self.record["window"] = w
        self.dense_pairs = self.h_q * (min(n, w + 1) * (min(n, w + 1) + 1) // 2 + max(0, n - w - 1) * (w + 1))

    def run(self):
        s = self.sets
        mask = window_block_mask(self.n, self.window)
        self.flex_out["window"] = self.peer(
            "flex_mask", f"Flex window {self.window}",
            lambda i: FLEX(s[i].q, s[i].k, s[i].v, block_mask=mask, enable_gqa=True), target="window")
        if self.lib is not None:
            self.ours("ours_dense_window", f"ours dense window {self.window}", self.lib.policy("dense"),
                      target="window")
        return self.record


def chunk_block_mask(n, c, device=DEV):
    """FlexAttention's BlockMask of attention_chunk c (a multiple of BLOCK) with causal at
    s_q = s_k = n, from block indices: query block qb's chunk starts at key block
    first = (qb·B // c)·(c / B); its full blocks are first .. qb - 1, its partial one the diagonal
    (no key block straddles a chunk boundary)."""
    nb, per = n // BLOCK, c // BLOCK
    qb = torch.arange(nb, device=device)
    j = torch.arange(nb, device=device)
    first = torch.div(qb, per, rounding_mode="floor") * per
    full_cnt = qb - first
    full_idx = torch.where(j[None, :] < full_cnt[:, None], first[:, None] + j[None, :], 0)

    def chunk_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx // c == kv_idx // c)

    def as4(t):
        return t.view(1, 1, *t.shape).to(torch.int32).contiguous()

    return BlockMask.from_kv_blocks(as4(torch.ones_like(qb)), as4(qb[:, None].expand(nb, nb)), as4(full_cnt),
                                   as4(full_idx), BLOCK_SIZE=BLOCK, mask_mod=chunk_mod)


class ChunkCase(Case):
    """Chunked local attention (--attention-chunk-lengths, --attention-chunk C): FlashAttention's
    attention_chunk with causal, each query seeing the keys of its own chunk of C positions up to
    itself (Llama 4's local layers, C = 8192). Ours dense with the chunks against FlexAttention
    given the same chunks (chunk_block_mask, built outside the timed calls); work counts the
    chunks' pairs."""

    def __init__(self, model, n, args, lib):
        super().__init__(model, n, args, lib)
        c = self.attention_chunk = args.attention_chunk
        self.record["attention_chunk"] = c
        full, rest = divmod(n, c)
        self.dense_pairs = self.h_q * (full * c * (c + 1) // 2 + rest * (rest + 1) // 2)

    def run(self):
        s = self.sets
        mask = chunk_block_mask(self.n, self.attention_chunk)
        self.flex_out["chunk"] = self.peer(
            "flex_mask", f"Flex chunks of {self.attention_chunk}",
            lambda i: FLEX(s[i].q, s[i].k, s[i].v, block_mask=mask, enable_gqa=True), target="chunk")
        if self.lib is not None:
            self.ours("ours_dense_chunk", f"ours dense chunks of {self.attention_chunk}", self.lib.policy("dense"),
                      target="chunk")
        return self.record


class BatchCase(Case):
    """--batch sequences, each --batch-chunk queries over the case's n keys, the queries being
    the last positions (bottom-right causal, as a chunk over its cache): where a 128-row tile
    per query head is mostly empty and GQA packing fills it with the group's heads."""

    INPUTS = "batched chunks"

    def __init__(self, model, n, args, lib):
        self.batch, self.chunk = args.batch, args.batch_chunk
        super().__init__(model, n, args, lib)
        self.record.update(batch=self.batch, chunk=self.chunk,
                           set_mb=self.batch * 2 * self.d * (self.chunk * self.h_q + 2 * n * self.h_kv) / 1e6)
        per_seq = self.chunk * (n - self.chunk) + self.chunk * (self.chunk + 1) // 2
        self.dense_pairs = self.batch * self.h_q * per_seq

    def make_sets(self):
        # One set: at 64 sequences of 4K keys it is about 1.1 GB, far past the L2 cache.
        shapes = [(self.batch, self.chunk, self.h_q), (self.batch, self.n, self.h_kv), (self.batch, self.n, self.h_kv)]
        return [InputSet(*(torch.randn(b, s, h, self.d, device=DEV, dtype=torch.bfloat16, generator=self.gen)
                           for b, s, h in shapes))]

    def run(self):
        from torch.nn.attention.bias import causal_lower_right
        s, bias = self.sets, causal_lower_right(self.chunk, self.n)
        self.peer("sdpa_flash", "SDPA flash",
                  lambda i: F.scaled_dot_product_attention(s[i].q, s[i].k_rep, s[i].v_rep, attn_mask=bias),
                  backend=SDPBackend.FLASH_ATTENTION)
        self.peer("sdpa_cudnn", "SDPA cuDNN",
                  lambda i: F.scaled_dot_product_attention(s[i].q, s[i].k_rep, s[i].v_rep, attn_mask=bias),
                  backend=SDPBackend.CUDNN_ATTENTION)
        if self.lib is not None:
            self.ours("ours_dense", "ours dense", self.lib.policy("dense"))
            with env_set("SPARSEPREFILL_PACK_GQA", "never"):
                self.ours("ours_dense_unpacked", "ours dense, GQA packing off", self.lib.policy("dense"))
            if self.wanted("ours_exact_gate") or self.wanted("ours_exact_gate_one_pass"):
                # exact_gate ~20% in two passes (the default: a decision CTA per query block and
                # 4 heads, which scores 128 rows of which `chunk` are valid, and sums the gated
                # blocks of its own sequence only) and forced into one pass.
                t = self.gate_threshold(0.2)
                gate = self.lib.policy("exact_gate", {"block_q": BLOCK, "block_k": BLOCK})
                table = torch.full((self.h_q, 1), t, dtype=torch.float32, device=DEV)
                gate.set_thresholds(sp_ctypes.tensor_from_torch(table), owner=table)
                self.ours("ours_exact_gate", "ours exact_gate ~20%", gate, target=0.2, extra={"threshold": t})
                with env_set("SPARSEPREFILL_EXACT_GATE_PASSES", "1"):
                    self.ours("ours_exact_gate_one_pass", "ours exact_gate ~20%, one pass", gate, target=0.2,
                              extra={"threshold": t})
        return self.record

    def gate_threshold(self, target):
        """T with P(block max ≥ T) ≈ target over the full key blocks of a sequence's chunk
        (its `chunk` query rows), from the exact block maxima of scale·QKᵀ of 8 sequences and
        4 heads (iid inputs: one value serves every head and position)."""
        s, full = self.sets[0], (self.n - self.chunk) // BLOCK
        group = self.h_q // self.h_kv
        maxima = []
        for b in range(min(8, self.batch)):
            for h in range(0, self.h_q, max(1, self.h_q // 4)):
                scores = (s.q[b, h].float() @ s.k[b, h // group, :full * BLOCK].float().T) / math.sqrt(self.d)
                maxima.append(scores.view(self.chunk, full, BLOCK).amax(dim=(0, 2)))
        allm = torch.sort(torch.cat(maxima)).values
        return float(allm[min(allm.numel() - 1, max(0, int(round((1.0 - target) * allm.numel()))))])


@contextlib.contextmanager
def env_set(name, value):
    """The environment variable `name` set to `value` inside the block; the run's own setting
    (recorded in the result's env) restored after it."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# Compiled once; recompiles per shape (dynamic=False, like the baselines).
FLEX = torch.compile(flex_attention, dynamic=False)


def write(out_dir, result):
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(bench_report.render(result) + "\n")


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)
    lib = None
    if not args.peers_only:
        if not args.lib:
            sys.exit("bench_attention: --lib PATH to libsparseprefill_c.so (or --peers-only)")
        lib = sp_ctypes.Library(args.lib)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        sys.exit(f"bench_attention: --families: unknown {unknown}; expected some of {list(FAMILIES)}")
    for length in (ints(args.lengths) + ints(args.small_lengths) + ints(args.structured_lengths)
                   + ints(args.family_lengths) + ints(args.window_lengths) + ints(args.attention_chunk_lengths)):
        if length % BLOCK:
            sys.exit(f"bench_attention: lengths must be multiples of {BLOCK}, got {length}")
    if ints(args.attention_chunk_lengths) and (args.attention_chunk <= 0 or args.attention_chunk % BLOCK):
        sys.exit(f"bench_attention: --attention-chunk must be a positive multiple of {BLOCK}, got {args.attention_chunk}")
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "commit": commit(),
              "command": os.environ.get("SP_BENCH_COMMAND", " ".join(sys.argv)),
              "peers_only": args.peers_only, "env": environment(lib),
              # The kernels ours ran on: the plan's choice, or the portable ones when
              # SPARSEPREFILL_CUDA_PATH=portable forces them (docs/cuda.md).
              "cuda_path": os.environ.get("SPARSEPREFILL_CUDA_PATH") or "auto",
              # GQA packing on the Hopper kernel: the plan's choice, or forced (docs/cuda.md).
              "pack_gqa": os.environ.get("SPARSEPREFILL_PACK_GQA") or "auto",
              "method": __doc__.split("Method:")[1].split("Writes")[0].strip(), "cases": []}
    print(json.dumps(result["env"]), flush=True)
    t_start = time.perf_counter()
    todo = [(Case, "llama-3.1-8b", n) for n in ints(args.lengths)] + \
           [(Case, "smollm2-135m", n) for n in ints(args.small_lengths)] + \
           [(StructuredCase, "llama-3.1-8b", n) for n in (ints(args.structured_lengths) if lib else [])] + \
           [(BatchCase, "llama-3.1-8b", n) for n in ints(args.batch_lengths)] + \
           [(FamilyCase, f, n) for f in families for n in ints(args.family_lengths)] + \
           [(WindowCase, "llama-3.1-8b", n) for n in ints(args.window_lengths)] + \
           [(ChunkCase, "llama-3.1-8b", n) for n in ints(args.attention_chunk_lengths)]
    for kind, model, n in todo:
        print(f"{model} s={n} ({kind.INPUTS} inputs)", flush=True)
        t0 = time.perf_counter()
        case = kind(model, n, args, lib)
        result["cases"].append(case.run())
        del case
        torch.cuda.empty_cache()
        write(args.out, result)
        print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    result["wall_s"] = time.perf_counter() - t_start
    write(args.out, result)
    print()
    print(bench_report.summary_table(result["cases"]))
    print()
    print(bench_report.targets_table(result["cases"]))


if __name__ == "__main__":
    main()
