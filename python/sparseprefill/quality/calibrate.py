# SPDX-License-Identifier: Apache-2.0
"""python -m sparseprefill.quality.calibrate: runs a model on the calibration part of a text
(or, with --whole-text, on all of a text other than every evaluation text), captures every
layer's Q (after RoPE) and K, and fits exact_gate threshold tables, softmax_skip factors and
estimate_select alphas with the library's calibrators. With the model on CUDA (or with
--direct) each layer's q/k go straight into sparseprefill.Calibrator, whose statistics are
computed on the model's device (seconds for a 128K-token window on the GPU); otherwise, on the
CPU, the windows are written as safetensors samples (q_<layer> [1, s, h_q, d], k_<layer>
[1, s, h_kv, d]) for `sparseprefill calibrate --input`.
Writes one calibration file whose metadata names the model, the text and its character range;
block sizes are in the file's reserved keys."""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from . import capture, data

__all__ = ["find_cli", "main"]


def find_cli(explicit: Optional[str] = None) -> str:
    """The `sparseprefill` CLI: --cli, $SP_CLI, PATH, or a build folder of the checkout in the
    current directory (or of the source tree this module runs from)."""
    candidates = [explicit, os.environ.get("SP_CLI"), shutil.which("sparseprefill")]
    for root in (os.getcwd(), os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))):
        for depth in ("*", os.path.join("*", "*")):
            candidates += sorted(glob.glob(os.path.join(root, "build", depth, "tools", "cli", "sparseprefill")))
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError("sparseprefill CLI not found: build the sparseprefill_cli target "
                            "(e.g. cmake --preset cpu && cmake --build --preset cpu) or pass --cli / set SP_CLI")


def _floats(s: str) -> List[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x]


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sparseprefill.quality.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    data.add_model_args(p, "the long document (UTF-8); its first part calibrates")
    p.add_argument("--samples", type=int, default=3, help="windows of the calibration text (one sample each)")
    p.add_argument("--length", type=int, default=4096, help="tokens per window")
    p.add_argument("--block", type=int, default=128,
                   help="block size of every policy (exact_gate / softmax_skip block_q = block_k; "
                        "estimate_select block); the CUDA kernels take 128")
    p.add_argument("--budgets", type=_ints, default=[2, 4, 8, 16], help="exact_gate budgets (full blocks kept)")
    p.add_argument("--skip-targets", type=_floats, default=[0.2, 0.4, 0.6, 0.8],
                   help="softmax_skip target skip fractions")
    p.add_argument("--density-targets", type=_floats, default=[0.3, 0.4, 0.5, 0.7],
                   help="estimate_select target densities")
    p.add_argument("--output", required=True, help="the calibration file to write")
    p.add_argument("--cli", help="path of the sparseprefill CLI (CPU route)")
    p.add_argument("--whole-text", action="store_true",
                   help="the whole text calibrates (a document other than every evaluation text), not its first part")
    p.add_argument("--direct", action="store_true",
                   help="on the CPU too, feed q/k straight to sparseprefill.Calibrator (no CLI, no sample files)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="model dtype: auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16")
    p.add_argument("--workdir", help="CPU route: folder for the Q/K sample files (default: a temporary folder, "
                                     "removed)")
    return p.parse_args(argv)


def capture_sample(model, ids, path: str) -> None:
    """Runs the model on one window and writes q_<layer>, k_<layer> to `path`."""
    import torch
    from safetensors.torch import save_file

    tensors: Dict[str, torch.Tensor] = {}

    def sink(layer, q, k, v):
        tensors[f"q_{layer}"] = q.detach().to("cpu").contiguous()
        tensors[f"k_{layer}"] = k.detach().to("cpu").contiguous()

    with torch.no_grad(), capture.capturing(sink):
        model.model(torch.tensor([ids], device=model.device), use_cache=False)
    save_file(tensors, path)


def calibrate_on_gpu(model, wins, args: argparse.Namespace, output: str, metadata: Dict[str, str]) -> None:
    """The CUDA route (and --direct's on the CPU): every window's q/k of every layer into one
    Calibrator (statistics on the model's device, reductions on the host), then the file with
    `metadata`."""
    import torch

    from ..calibration import Calibrator

    config = model.config
    cal = Calibrator(config.num_hidden_layers, config.num_attention_heads, budgets=args.budgets,
                     skip_targets=args.skip_targets, density_targets=args.density_targets,
                     block_q=args.block, block_k=args.block, select_block=args.block)

    def sink(layer, q, k, v):
        cal.add(layer, q.detach(), k.detach())

    with torch.no_grad(), capture.capturing(sink):
        for _, ids in data.progress(wins, desc="calibrate (library statistics)"):
            model.model(torch.tensor([ids], device=model.device), use_cache=False)
    cal.save(output, metadata)


def add_metadata(path: str, extra: Dict[str, str]) -> None:
    """Rewrites a calibration file with `extra` added to its free-form metadata."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    with safe_open(path, framework="numpy") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta.update(extra)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, path)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    on_gpu = args.device.startswith("cuda")
    direct = on_gpu or args.direct
    cli = None if direct else find_cli(args.cli)
    t0 = time.time()
    from .. import transformers as spt

    spt.register(spt.BackendConfig())
    model, tokenizer = data.load_model(args.model, args.device, args.dtype)
    model.set_attn_implementation(capture.register())
    split = data.read_split(args.text, args.split_fraction)
    part = split.calibration + split.evaluation if args.whole_text else split.calibration
    tokens = tokenizer(part, add_special_tokens=False).input_ids
    wins = data.windows(tokens, args.length, args.samples)
    model_name = args.model_name or os.path.basename(os.path.normpath(args.model))
    meta = {
        "model_sha256": data.file_sha256(args.model) if os.path.isfile(args.model) else "",
        "text": os.path.basename(args.text), "text_sha256": split.sha256,
        "text_chars": f"0:{split.length} (the whole document)" if args.whole_text else
                      f"0:{split.boundary} (calibration part of {split.length} characters)",
        "sample_tokens": f"{args.samples} windows x {args.length} tokens from token 0 of the "
                         + ("document" if args.whole_text else "calibration part"),
        "qk_dtype": str(next(iter(model.parameters())).dtype).replace("torch.", ""),
        "device": args.device,
        "statistics": "gpu" if on_gpu else ("cpu, sparseprefill.Calibrator" if direct else "cpu"),
        "date": data.record_date(),
        "command": " ".join(shlex.quote(a) for a in ["python", "-m", "sparseprefill.quality.calibrate"]
                            + (sys.argv[1:] if argv is None else argv)),
    }
    if direct:
        calibrate_on_gpu(model, wins, args, args.output, dict(meta, model=model_name,
                                                              source="python -m sparseprefill.quality.calibrate",
                                                              samples=str(args.samples)))
        t_capture = time.time() - t0
    else:
        work = args.workdir or tempfile.mkdtemp(prefix="sp-calibrate-")
        os.makedirs(work, exist_ok=True)
        paths = []
        try:
            for i, (_, ids) in enumerate(data.progress(wins, desc="capture Q/K")):
                paths.append(os.path.join(work, f"sample_{i}.safetensors"))
                capture_sample(model, ids, paths[-1])
            t_capture = time.time() - t0
            b = str(args.block)
            cmd = [cli, "calibrate", "--output", args.output, "--block-q", b, "--block-k", b, "--block", b,
                   "--model", model_name,
                   "--budgets", ",".join(map(str, args.budgets)),
                   "--skip-targets", ",".join(map(str, args.skip_targets)),
                   "--density-targets", ",".join(map(str, args.density_targets))]
            for path in paths:
                cmd += ["--input", path]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
        finally:
            if not args.workdir:
                shutil.rmtree(work, ignore_errors=True)
        add_metadata(args.output, meta)
    from ..calibration import load_calibration

    cal = load_calibration(args.output)
    print(f"wrote {args.output}: {cal.layers} layers, exact_gate budgets {cal.gate_budgets}, "
          f"softmax_skip targets {[round(t, 6) for t in cal.skip_targets]}, "
          f"estimate_select targets {[round(t, 6) for t in cal.density_targets]}; "
          f"{'capture + statistics' if direct else 'capture'} {t_capture:.0f} s, "
          f"total {time.time() - t0:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
