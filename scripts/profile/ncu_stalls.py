# SPDX-License-Identifier: Apache-2.0
"""Summarises an Nsight Compute report exported as CSV (scripts/profile/ncu_tiles.sh): per
profiled launch, the warp-stall reasons (sampled) and the hottest SASS instructions, split at
`USETMAXREG.DEALLOC` for warp-specialised kernels (the producer's code follows it).
Usage: python3 ncu_stalls.py RAW_CSV SOURCE_CSV [TOP]"""

import csv
import io
import sys


def stall_reasons(raw_path):
    """[(launch, {reason: samples})] from `ncu --page raw --csv`."""
    with open(raw_path) as f:
        rows = list(csv.reader(f))
    header, body = rows[0], rows[2:]  # row 1 holds the units
    cols = [(i, h[len("smsp__pcsamp_warps_issue_stalled_"):]) for i, h in enumerate(header)
            if h.startswith("smsp__pcsamp_warps_issue_stalled_") and "not_issued" not in h]
    name = header.index("Kernel Name") if "Kernel Name" in header else None
    out = []
    for r in body:
        counts = {reason: float(r[i].replace(",", "") or 0) for i, reason in cols}
        out.append((r[name] if name is not None else "?", counts))
    return out


def source_blocks(source_path):
    """Per launch: [(address, samples, instruction)] from `ncu --page source --csv --print-source sass`."""
    with open(source_path) as f:
        text = f.read()
    blocks = []
    for part in text.split('\n"Address"')[1:]:
        rows = list(csv.reader(io.StringIO('"Address"' + part)))
        header = rows[0]
        a, src, smp = header.index("Address"), header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
        insts = []
        for r in rows[1:]:
            if len(r) <= smp:
                continue
            try:
                insts.append((int(r[a], 16), float(r[smp].replace(",", "") or 0), r[src].strip()))
            except ValueError:
                continue
        blocks.append(insts)
    return blocks


def main(argv):
    top = int(argv[3]) if len(argv) > 3 else 20
    reasons = stall_reasons(argv[1])
    for n, insts in enumerate(source_blocks(argv[2])):
        kernel, counts = reasons[n] if n < len(reasons) else ("?", {})
        total = sum(s for _, s, _ in insts) or 1.0
        print(f"=== launch {n}: {kernel[:160]}")
        for reason, c in sorted(counts.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  stall {reason:24s} {100 * c / max(sum(counts.values()), 1):5.1f}%")
        split = next((addr for addr, _, ins in insts if "USETMAXREG.DEALLOC" in ins), None)
        parts = [("all", insts)] if split is None else [("consumers", [x for x in insts if x[0] < split]),
                                                         ("producer", [x for x in insts if x[0] >= split])]
        for label, part in parts:
            share = sum(s for _, s, _ in part) / total
            print(f"  {label}: {100 * share:.1f}% of the samples; hottest instructions:")
            for addr, s, ins in sorted(part, key=lambda x: -x[1])[:top]:
                print(f"    {addr & 0xfffff:05x} {100 * s / total:5.2f}%  {ins}")


if __name__ == "__main__":
    main(sys.argv)
