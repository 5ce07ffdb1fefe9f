#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fails when an #include runs against the layers (docs/design.md, "Layers"): each folder may
include the project headers its row allows, and nothing else of the project. Standard and
CUDA headers (<...>) are not checked, except that no C++ file includes torch.
Usage: scripts/check_layers.py   (from anywhere; exits 1 and names each offending line)"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')

# (files, allowed project headers): a header is allowed when it matches one of the patterns
# (prefixes ending in "/" match a folder; others match exactly). The first row whose glob
# matches a file applies.
CORE = ("core/", "sparseprefill/")
KERNEL_SHARED = ("cuda/kernel/fwd_params.h", "cuda/kernel/launch_types.h", "cuda/kernel/rank_key.h")
RULES = [
    ("src/core/**/*", CORE),
    ("src/reference/*", CORE + ("reference/",)),
    ("src/cpu/*", CORE + ("cpu/",)),
    # Kernel headers: kernels and single launches, over shared plain headers only.
    ("src/cuda/kernel/**/*", ("cuda/kernel/", "core/geometry.h", "core/rules/")),
    # Instances bind one kernel instance to its registry signature.
    ("src/cuda/instances/*", ("cuda/kernel/", "cuda/registry.h")),
    # Developer timing of the kernel tiles (not part of the library).
    ("src/cuda/dev/*", CORE + ("cuda/",)),
    # The CUDA host side: never a kernel (.cuh) header.
    ("src/cuda/*", CORE + ("cuda/",) + KERNEL_SHARED),
    ("src/dispatch/*", CORE + ("dispatch/", "reference/backend.h", "cpu/backend.h", "cuda/backend.h")),
    ("src/calibration/*", CORE + ("dispatch/dispatch.h",)),
    ("src/api/*", ("sparseprefill/",)),
    ("tools/cli/*", ("sparseprefill/",)),
    ("python/sparseprefill/_ext.cpp", ("sparseprefill/c_api.h",)),
]
HOST_FOLDERS = ("src/", "tools/", "python/", "bench/", "tests/")


def rule_for(rel):
    for pattern, allowed in RULES:
        if pathlib.PurePosixPath(rel).match(pattern) or (pattern.endswith("**/*") and rel.startswith(pattern[:-4])):
            return allowed
    return None


def allowed_by(header, allowed):
    return any(header.startswith(a) if a.endswith("/") else header == a for a in allowed)


def main():
    problems = []
    for path in sorted(ROOT.rglob("*")):
        if path.suffix not in (".h", ".cpp", ".cu", ".cuh", ".inc") or not path.is_file():
            continue
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("build/", ".")) or not rel.startswith(HOST_FOLDERS):
            continue
        allowed = rule_for(rel)
        kernel_side = rel.startswith(("src/cuda/kernel/", "src/cuda/instances/", "src/cuda/dev/", "tests/cuda/"))
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, header = m.groups()
            if header.split("/")[0] in ("torch", "ATen", "c10"):
                problems.append(f"{rel}:{n}: includes {header}: no C++ file includes torch")
                continue
            if kind == "<":
                continue
            if header.endswith(".cuh") and not kernel_side:
                problems.append(f"{rel}:{n}: includes the kernel header \"{header}\": host code reaches kernels "
                                "through the registry (src/cuda/registry.h) only")
                continue
            if allowed is None or "/" not in header:  # tests, tools' sibling headers
                continue
            if not allowed_by(header, allowed):
                problems.append(f"{rel}:{n}: includes \"{header}\", which its layer may not (allowed: "
                                f"{', '.join(allowed)})")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check_layers: {len(problems)} include(s) against the layers (docs/design.md)", file=sys.stderr)
        return 1
    print("check_layers: every include follows the layers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
