# SPDX-License-Identifier: Apache-2.0
"""python -m sparseprefill.quality.mc_analysis: estimate_select's mean correction taken apart on
real Q/K/V. The model runs once, dense, on a window of the held-out text (CPU is enough); for
the captured layers and each alpha, the selector's kept and corrected blocks come from the
library (select()), and the attention output is rebuilt in float64 from the kept blocks plus
the corrected blocks' contribution approximated five ways:

  none          the corrected blocks dropped (estimate_select without mean correction)
  zero_order    the library's definition: mass n·e^{s(k̄)}, value v̄ (docs/semantics.md)
  exact_mass    each block's true mass Σ_t e^{s_t}, value v̄
  exact_value   mass n·e^{s(k̄)}, each block's true softmax-weighted value
  exact         true mass and value: equals dense unless a visible block is neither kept
                nor corrected

each as ||O - O_dense||_F / ||O_dense||_F over the layer's heads, with the share of the
corrected blocks' true mass that n·e^{s(k̄)} recovers (Jensen: never more than all of it) and
the library's own mean-corrected output's error (fp32 CPU backend) beside zero_order's as a
check of this rebuild. Writes one JSON file that report.py turns into a section of
docs/quality.md."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional

import numpy as np

from . import data, metrics

__all__ = ["VARIANTS", "decompose", "main"]

VARIANTS = ("none", "zero_order", "exact_mass", "exact_value", "exact")


def decompose(q: np.ndarray, k: np.ndarray, v: np.ndarray, kept: List[np.ndarray],
              corrected: List[np.ndarray], block: int) -> List[Dict[str, float]]:
    """q [s, h_q, d], k, v [s, h_kv, d] (one causal self-attention sequence, s_q = s_k);
    kept[i], corrected[i] bool [h_q, num_q_blocks, num_k_blocks], one pair per selection. Per
    selection: each variant's relative error against dense, and mass_share = Σ n·e^{s(k̄)} /
    Σ_t e^{s_t} over every (row, corrected block)."""
    q, k, v = (np.asarray(t, dtype=np.float64) for t in (q, k, v))
    s, h_q, d = q.shape
    group = h_q // k.shape[1]
    scale = d ** -0.5
    err2 = [dict.fromkeys(VARIANTS, 0.0) for _ in kept]
    zero_mass = [0.0] * len(kept)
    true_mass = [0.0] * len(kept)
    ref2 = 0.0
    for h in range(h_q):
        qh, kh, vh = q[:, h], k[:, h // group], v[:, h // group]
        n_kb = (s + block - 1) // block
        lengths = np.minimum(block, s - block * np.arange(n_kb)).astype(np.float64)
        kbar = np.stack([kh[j * block:(j + 1) * block].mean(0) for j in range(n_kb)])
        vbar = np.stack([vh[j * block:(j + 1) * block].mean(0) for j in range(n_kb)])
        for qb in range((s + block - 1) // block):
            r0, r1 = qb * block, min(s, (qb + 1) * block)
            x = scale * qh[r0:r1] @ kh[:r1].T                        # [rows, keys <= r1)
            x[np.arange(r0, r1)[:, None] < np.arange(r1)[None, :]] = -np.inf
            m = x.max(1, keepdims=True)                             # a common reference max
            e = np.exp(x - m)
            dense = (e @ vh[:r1]) / e.sum(1, keepdims=True)
            ref2 += float((dense ** 2).sum())
            key_block = np.arange(r1) // block
            for i, (kp, cr) in enumerate(zip(kept, corrected)):
                keep_keys = kp[h, qb][key_block]
                num = e[:, keep_keys] @ vh[:r1][keep_keys]
                den = e[:, keep_keys].sum(1)
                cj = np.flatnonzero(cr[h, qb])
                # Per corrected block: true mass and softmax-weighted sum, zero-order mass.
                mass = np.stack([e[:, j * block:(j + 1) * block].sum(1) for j in cj], 1) if cj.size else \
                    np.zeros((r1 - r0, 0))
                wsum = np.stack([e[:, j * block:(j + 1) * block] @ vh[j * block:(j + 1) * block] for j in cj], 1) \
                    if cj.size else np.zeros((r1 - r0, 0, d))
                zero = lengths[cj] * np.exp(scale * qh[r0:r1] @ kbar[cj].T - m)
                zero_mass[i] += float(zero.sum())
                true_mass[i] += float(mass.sum())
                value = wsum / np.maximum(mass, np.finfo(np.float64).tiny)[..., None]
                outs = {
                    "none": num / den[:, None],
                    "zero_order": (num + zero @ vbar[cj]) / (den + zero.sum(1))[:, None],
                    "exact_mass": (num + mass @ vbar[cj]) / (den + mass.sum(1))[:, None],
                    "exact_value": (num + np.einsum("rj,rjc->rc", zero, value)) / (den + zero.sum(1))[:, None],
                    "exact": (num + wsum.sum(1)) / (den + mass.sum(1))[:, None],
                }
                for name, o in outs.items():
                    err2[i][name] += float(((o - dense) ** 2).sum())
    return [{**{name: (e2[name] / ref2) ** 0.5 for name in VARIANTS},
             "mass_share": zm / tm if tm > 0 else None}
            for e2, zm, tm in zip(err2, zero_mass, true_mass)]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.quality.mc_analysis", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data.add_model_args(p, "the long document (UTF-8); a window of its held-out part is used")
    p.add_argument("--length", type=int, default=4096, help="tokens of the window (default 4096)")
    p.add_argument("--layers", default="2,10,20,29", help="captured layers (default 2,10,20,29)")
    p.add_argument("--alphas", default="0.01,0.03,0.1,0.3,1",
                   help="estimate_select alphas (default 0.01,0.03,0.1,0.3,1: densities from near 1 to the floor "
                        "that sink, window and tail keep)")
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", required=True, help="the JSON file to write")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    import torch

    import sparseprefill as sp
    import sparseprefill.transformers as spt

    from . import capture  # torch and transformers: only for the model run

    t_start = time.time()
    layers = [int(x) for x in args.layers.split(",") if x]
    alphas = [float(x) for x in args.alphas.split(",") if x]
    spt.register(spt.BackendConfig(min_sparse_len=1))
    model, tok = data.load_model(args.model, args.device)
    model.set_attn_implementation(capture.register())
    split = data.read_split(args.text, args.split_fraction)
    tokens = tok(split.evaluation, add_special_tokens=False).input_ids
    if len(tokens) < args.length:
        raise SystemExit(f"mc_analysis: the held-out text has {len(tokens)} tokens, fewer than --length {args.length}")
    if any(l < 0 or l >= model.config.num_hidden_layers for l in layers):
        raise SystemExit(f"mc_analysis: --layers must lie in [0, {model.config.num_hidden_layers})")
    captured: Dict[int, Any] = {}
    print(f"mc_analysis: dense forward over {args.length} tokens", file=sys.stderr)
    with torch.no_grad(), capture.capturing(capture.numpy_sink(captured, layers)):
        model(torch.tensor([tokens[:args.length]], device=model.device), use_cache=False)
    points = []
    bar = data.progress(total=len(layers), desc="mc analysis")
    for layer in layers:
        q, k, v = captured[layer]  # [1, s, h, d] float32
        kept, corrected, lib = [], [], []
        dense = sp.run(q, k, v, sp.Dense(), causal=True, backend="cpu").out
        for a in alphas:
            policy = sp.EstimateSelect(block=args.block, alpha=a, mean_correction=True)
            sel = sp.select(q, k, v, policy, causal=True, backend="cpu")
            kept.append(sel.mask.to_dense()[0])
            corrected.append(sel.corrected.to_dense()[0])
            lib.append((sel.mask.density, metrics.relative_error(sp.run(q, k, v, policy, causal=True, backend="cpu").out,
                                                                 dense)))
        for a, (density, lib_err), r in zip(alphas, lib, decompose(q[0], k[0], v[0], kept, corrected, args.block)):
            points.append({"layer": layer, "alpha": a, "density": density, "library_mc": lib_err, **r})
        bar.update(1)
    bar.close()
    doc = {
        "kind": "mc_analysis",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model_name or os.path.basename(os.path.normpath(args.model)),
        "text": split.describe(),
        "length": args.length,
        "block": args.block,
        "command": "python -m sparseprefill.quality.mc_analysis " + " ".join(sys.argv[1:] if argv is None else argv),
        "host": platform.node(),
        "seconds": round(time.time() - t_start, 1),
        "variants": list(VARIANTS),
        "points": points,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print(f"mc_analysis: wrote {args.out} ({doc['seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
