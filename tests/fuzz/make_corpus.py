#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
# Writes the seed corpus of tests/fuzz/corpus: valid and broken safetensors and calibration
# files, built byte by byte from docs/file-formats.md (an writer independent of the C++ one),
# plus one file written by Python's safetensors package. The outputs are committed; rerun
# this only to change them (needs `pip install safetensors numpy` for python_numpy.safetensors).
import json
import math
import os
import struct
import sys

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def safetensors_bytes(tensors, metadata=None, header_override=None, length_override=None):
    """tensors: list of (name, dtype tag, shape, raw bytes) in data order."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    text = header_override if header_override is not None else json.dumps(header, separators=(",", ":"))
    text = text.encode("utf-8")
    text += b" " * ((8 - len(text) % 8) % 8)
    length = len(text) if length_override is None else length_override
    return struct.pack("<Q", length) + text + b"".join(raw for _, _, _, raw in tensors)


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def i32(values):
    return struct.pack("<%di" % len(values), *values)


def bf16(values):
    # Truncation is exact for these values (all representable in bf16).
    return b"".join(struct.pack("<f", v)[2:] for v in values)


def calibration(layers=2, heads=2, positions=3, budgets=(1, 2), thresholds=None, skip=True,
                select=True, meta_changes=None, extra_tensors=()):
    nb = len(budgets)
    count = layers * nb * heads * positions
    if thresholds is None:
        thresholds = [(-math.inf if i % 7 == 0 else 0.125 * i - 3.0) for i in range(count)]
    meta = {
        "format": "sparseprefill.calibration",
        "format_version": "1",
        "layers": str(layers),
        "model": "corpus-model",
        "score_dtype": "fp64",
        "exact_gate.layers": str(layers),
        "exact_gate.heads": str(heads),
        "exact_gate.positions": str(positions),
        "exact_gate.block_q": "128",
        "exact_gate.block_k": "64",
    }
    tensors = [
        ("exact_gate.thresholds", "F32", [layers, nb, heads, positions], f32(thresholds)),
        ("exact_gate.budgets", "I32", [nb], i32(list(budgets))),
    ]
    if skip:
        meta.update({"softmax_skip.block_q": "128", "softmax_skip.block_k": "128"})
        tensors += [("softmax_skip.targets", "F32", [2], f32([0.5, 0.75])),
                    ("softmax_skip.a", "F32", [layers, 2], f32([4.0 + i for i in range(2 * layers)]))]
    if select:
        meta.update({"estimate_select.block": "128", "estimate_select.sink": "2",
                     "estimate_select.window": "4", "estimate_select.tail": "2",
                     "estimate_select.mean_correction": "false", "estimate_select.pack_gqa": "true"})
        tensors += [("estimate_select.targets", "F32", [3], f32([0.1, 0.2, 0.4])),
                    ("estimate_select.alpha", "F32", [layers, 3], f32([0.5 / (i + 1) for i in range(3 * layers)]))]
    tensors += list(extra_tensors)
    for k, v in (meta_changes or {}).items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    return safetensors_bytes(tensors, meta)


def main():
    os.makedirs(CORPUS, exist_ok=True)
    files = {}
    files["valid_bf16.safetensors"] = safetensors_bytes(
        [("w", "BF16", [2, 3], bf16([1.0, -2.0, 0.5, 3.0, -0.25, 8.0])), ("z", "I32", [0], b"")],
        {"note": "bf16 and an empty tensor"})
    files["valid_empty.safetensors"] = safetensors_bytes([], None, header_override="{}")
    files["calibration_full.safetensors"] = calibration()
    files["calibration_gate_only.safetensors"] = calibration(layers=1, heads=1, positions=2,
                                                             budgets=(3,), skip=False, select=False,
                                                             meta_changes={"layers": "0"})
    files["broken_st_truncated.safetensors"] = calibration()[:100]
    files["broken_st_lying_length.safetensors"] = safetensors_bytes(
        [("x", "F32", [1], f32([1.0]))], None, length_override=10 ** 12)
    files["broken_st_overlap.safetensors"] = safetensors_bytes(
        [], None, header_override='{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
                                  '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}') + bytes(12)
    files["broken_st_bad_json.safetensors"] = safetensors_bytes([], None, header_override='{"a": [1, 2}')
    files["broken_st_dtype.safetensors"] = safetensors_bytes([("x", "F64", [1], bytes(8))])
    files["broken_cal_nan_threshold.safetensors"] = calibration(
        thresholds=[math.nan if i == 5 else 1.0 for i in range(2 * 2 * 2 * 3)])
    files["broken_cal_version.safetensors"] = calibration(meta_changes={"format_version": "2"})
    files["broken_cal_shape.safetensors"] = calibration(meta_changes={"exact_gate.positions": "4"})
    files["broken_cal_budgets_order.safetensors"] = calibration(budgets=(4, 2))
    files["broken_cal_extra_tensor.safetensors"] = calibration(
        extra_tensors=[("exact_gate.extra", "F32", [1], f32([1.0]))])
    for name, data in files.items():
        with open(os.path.join(CORPUS, name), "wb") as f:
            f.write(data)

    try:
        import numpy as np
        from safetensors.numpy import save_file
    except ImportError:
        print("make_corpus: safetensors/numpy not installed; python_numpy.safetensors kept as is",
              file=sys.stderr)
        return
    save_file({
        "a_f32": (0.5 * np.arange(6, dtype=np.float32) - 1.0).reshape(2, 3),
        "b_f16": (0.25 * np.arange(1, 6)).astype(np.float16),
        "c_i32": ((np.arange(4, dtype=np.int32) - 2) * 1000).reshape(2, 2),
        "d_empty": np.zeros((0, 4), dtype=np.float32),
    }, os.path.join(CORPUS, "python_numpy.safetensors"), metadata={"source": "safetensors.numpy"})


if __name__ == "__main__":
    main()
