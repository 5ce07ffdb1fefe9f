# SPDX-License-Identifier: Apache-2.0
"""Summarises an Nsight Compute report exported as CSV (scripts/profile/ncu_tiles.sh): per
profiled launch, the warp-stall reasons (sampled), the hottest SASS instructions, split at
`USETMAXREG.DEALLOC` for warp-specialised kernels (the producer's code follows it), and the
executed instructions and stall samples per opcode (what two kernels' instruction mixes differ
by).
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
    """Per launch: [(address, samples, executed, instruction)] from `ncu --page source --csv
    --print-source sass` (executed: warp-level instructions executed, 0 when not collected)."""
    with open(source_path) as f:
        text = f.read()
    blocks = []
    for part in text.split('\n"Address"')[1:]:
        rows = list(csv.reader(io.StringIO('"Address"' + part)))
        header = rows[0]
        a, src, smp = header.index("Address"), header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
        ex = header.index("Instructions Executed") if "Instructions Executed" in header else None
        insts = []
        for r in rows[1:]:
            if len(r) <= max(smp, ex or 0):
                continue
            try:
                executed = float(r[ex].replace(",", "") or 0) if ex is not None else 0.0
                insts.append((int(r[a], 16), float(r[smp].replace(",", "") or 0), executed, r[src].strip()))
            except ValueError:
                continue
        blocks.append(insts)
    return blocks


def opcode(instruction):
    """The mnemonic without predicate or modifiers: '@!P1 HMMA.16816.F32.BF16 R4, ...' -> 'HMMA'."""
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def opcode_table(insts, top):
    """Lines: the TOP opcodes by executed instructions, with their share of the stall samples."""
    executed, samples = {}, {}
    for _, s, e, ins in insts:
        op = opcode(ins)
        executed[op] = executed.get(op, 0.0) + e
        samples[op] = samples.get(op, 0.0) + s
    total_e, total_s = sum(executed.values()) or 1.0, sum(samples.values()) or 1.0
    lines = [f"  executed {total_e:.4g} warp instructions; per opcode (executed, share, stall samples):"]
    for op, e in sorted(executed.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"    {op:10s} {e:12.4g} {100 * e / total_e:5.1f}%  {100 * samples[op] / total_s:5.1f}%")
    return lines


def main(argv):
    top = int(argv[3]) if len(argv) > 3 else 20
    reasons = stall_reasons(argv[1])
    for n, insts in enumerate(source_blocks(argv[2])):
        kernel, counts = reasons[n] if n < len(reasons) else ("?", {})
        total = sum(s for _, s, _, _ in insts) or 1.0
        print(f"=== launch {n}: {kernel[:160]}")
        for reason, c in sorted(counts.items(), key=lambda kv: -kv[1])[:8]:
            print(f"  stall {reason:24s} {100 * c / max(sum(counts.values()), 1):5.1f}%")
        split = next((addr for addr, _, _, ins in insts if "USETMAXREG.DEALLOC" in ins), None)
        parts = [("all", insts)] if split is None else [("consumers", [x for x in insts if x[0] < split]),
                                                         ("producer", [x for x in insts if x[0] >= split])]
        for label, part in parts:
            share = sum(s for _, s, _, _ in part) / total
            print(f"  {label}: {100 * share:.1f}% of the samples; hottest instructions:")
            for addr, s, _, ins in sorted(part, key=lambda x: -x[1])[:top]:
                print(f"    {addr & 0xfffff:05x} {100 * s / total:5.2f}%  {ins}")
        if any(e for _, _, e, _ in insts):
            print("\n".join(opcode_table(insts, top)))


if __name__ == "__main__":
    main(sys.argv)
