#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Compares the kernels of two SASS dumps (cuobjdump --dump-sass, e.g. scripts/profile/sass_local.sh
with SP_SASS_OUT) instruction by instruction, so that "this change leaves kernel X's code as it
was" is checked here, without a GPU.

    python3 scripts/profile/sass_diff.py OLD.sass NEW.sass

Each kernel of OLD is paired with the NEW kernel of the same mangled name, or else with one
whose name differs only by one more template argument `false` (`Lb0E`: a kernel that gained a
compile-time flag, compared in its old form). Code addresses are masked (branch targets, return
addresses loaded by MOV; an instruction more or less elsewhere moves them) and the trailing NOP
padding dropped; everything else must match. Prints per pair: the instruction counts, the differing lines (unified diff, at most
--lines), and exits 1 when a kernel of OLD has no partner."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import Dict, List

INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
FUNCTION = re.compile(r"\s*Function : (\S+)")
# Operands that are code addresses: branch, call and sync targets, and a call's return address
# loaded by MOV before CALL.REL.NOINC.
TARGET = re.compile(r"^((?:@!?U?P\w+\s+)?(?:BRA|BRX|CALL|JMP|BSSY|SSY|PBK|BREAK|WARPSYNC|RET)\S*.*?)0x[0-9a-f]+")


def kernels(path: str) -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    name = None
    with open(path) as f:
        for line in f:
            m = FUNCTION.match(line)
            if m:
                name = m.group(1)
                out[name] = []
                continue
            m = INSTRUCTION.match(line)
            if m and name is not None:
                out[name].append(m.group(1))
    return out


def masked(code: List[str]) -> List[str]:
    """code with its addresses masked: branch targets, and a MOV's immediate that is an
    instruction address of this kernel (16-byte aligned, inside it: a return address), and
    without the trailing NOP padding."""
    size = 16 * len(code)
    lines = []
    for ins in code:
        ins = TARGET.sub(r"\1T", ins)
        m = re.match(r"(MOV R\d+, )0x([0-9a-f]+)$", ins)
        if m and int(m.group(2), 16) % 16 == 0 and int(m.group(2), 16) < size:
            ins = m.group(1) + "T"
        lines.append(ins)
    while lines and lines[-1] == "NOP":
        lines.pop()
    return lines


def partner(name: str, new: Dict[str, List[str]]):
    if name in new:
        return name
    for other in new:
        for m in re.finditer("Lb0E", other):
            if other[:m.start()] + other[m.end():] == name:
                return other
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--lines", type=int, default=20, help="differing lines shown per kernel")
    args = p.parse_args()
    old, new = kernels(args.old), kernels(args.new)
    missing = 0
    for name, code in old.items():
        other = partner(name, new)
        if other is None:
            print(f"{name}: no partner in {args.new}")
            missing += 1
            continue
        a, b = masked(code), masked(new[other])
        diff = [line for line in difflib.unified_diff(a, b, lineterm="", n=0)
                if line[:1] in "+-" and not line.startswith(("+++", "---"))]
        verdict = "identical" if not diff else f"{len(diff)} differing lines"
        print(f"{name}{'' if other == name else ' -> ' + other}: {len(code)} / {len(new[other])} instructions, "
              f"{verdict}")
        for line in diff[:args.lines]:
            print(f"    {line}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
