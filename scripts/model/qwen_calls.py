#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prints issue 32's device calls in order, to be made back to back on one warm machine (it goes
back after 30 s idle): for each call the paths to carry, the command, its timeout and the seconds
it is expected to take; then the plan's sizing. Run scripts/model/fetch_qwen.sh and
scripts/model/pack_qwen.sh first. --json prints one JSON object per call instead. A call whose
working tree and carry paths (as packed here) exceed the 64 MiB one call carries is named on
stderr, and the exit status is 1.

If the machine is lost between calls: copy the last call's qwen-long.json and cal.safetensors
into .carry/qwen-results/ (as results.json and cal.safetensors; from a record,
`zcat RECORD.json.gz > .carry/qwen-results/results.json`), then make the calls of
`--resume` from the first (the first evaluation call carries .carry/qwen-results): the run goes on
where it stopped (a new calibration would not match the results' fingerprint). `--patch FILE`
also runs a branch's GPU suite beside the uploads."""

import argparse
import json
import os
import pathlib
import shlex
import subprocess
import sys

PARTS = 22

# Seconds, as measured on the H200 on 2026-12-01 (record
# bench/records/quality/2026-12-01-h200-qwen25-coder-1.5b-long: its three calls).
EXPECT = {
    "start": 60,          # a fresh machine
    "part": 6,            # one 50 MiB part up, copied and checked (a call's round trip included)
    "final": 95,          # join + check the GGUF, gguf wheel, dequantise to bf16, reload check (93 with part 22)
    "calibrate": 25,      # load, 3 x 32K windows of the Debian Reference, statistics on the GPU (17)
    "load": 15,           # the bf16 folder onto the GPU, tokenizing the texts
    "ppl": 50,            # 45 settings x (one 16K + one 32K window, KL over both)
    "timing": 70,         # every setting x 3 runs x (16K + 32K), SDPA and cuDNN baselines (ppl + timing: 117)
}
# Prefill + greedy decode per prompt in batches of --batch-tokens, the mean over the settings of
# record bench/records/quality/2026-12-02-h200-qwen25-coder-1.5b-long-resumed-2 (32K: dense 159 s
# for its 320 prompts, the sparse settings 111-299 s: their prefills are read back for the
# density, collect_stats' decisions of every layer).
PER_PROMPT = {32768: 0.63, 16384: 0.27, 8192: 0.11, 4096: 0.06}
PROMPTS = 8 * 40  # tasks x samples per (setting, length)
CHOSEN = 6        # FlashPrefill V2's alpha 0.1 with and without mean correction, one per other policy


CARRY_LIMIT = 64 << 20  # bytes one device call carries: the working tree's copy and its carry paths


def path_bytes(path: pathlib.Path) -> int:
    """Bytes of a file, or of every file under a folder; 0 when it does not exist."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def tree_bytes(root: pathlib.Path) -> int:
    """Bytes of the working tree the device tool copies: tracked files and untracked ones git does
    not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, cwd=root,
                           check=True).stdout.split(b"\0")
    return sum((root / os.fsdecode(n)).stat().st_size for n in names if n and (root / os.fsdecode(n)).is_file())


def oversized(calls_: list, tree: int, size_of) -> list:
    """(call number, bytes) of each call whose tree plus carry paths exceed CARRY_LIMIT;
    size_of(path) gives a carry path's bytes."""
    out = []
    for i, c in enumerate(calls_, 1):
        total = tree + sum(size_of(path) for path in c["carry"])
        if total > CARRY_LIMIT:
            out.append((i, total))
    return out


def check_sizes(calls_: list, root: pathlib.Path) -> bool:
    """Says which calls would not fit one device call (the packed parts as they are here); False then."""
    big = oversized(calls_, tree_bytes(root), lambda path: path_bytes(root / path))
    for i, total in big:
        print(f"call {i}: the tree and its carry paths hold {total / (1 << 20):.1f} MiB, over the "
              f"{CARRY_LIMIT >> 20} MiB a call carries", file=sys.stderr)
    return not big


def part_calls(then: str, timeout_s: int, expect_s: int, note: str, prefix: str = "") -> list:
    """The 22 part calls (shared with scripts/vllm/calls.py): one part each, the first also
    starting the package build; the last copies its part, then runs `then` (its command is
    prefix + the copy + " && " + then)."""
    out = []
    for i in range(1, PARTS + 1):
        n = f"{i:02d}"
        cmd = f"scripts/model/assemble_qwen.sh part {n}"
        carry = [f".carry/qwen/{n}"]
        if i == 1:
            out.append({"carry": carry, "command": cmd + " && scripts/model/assemble_qwen.sh install",
                        "timeout_s": 120, "expect_s": EXPECT["part"], "note": "plus the machine's start "
                        f"(~{EXPECT['start']} s); the package builds in the background meanwhile"})
        elif i < PARTS:
            out.append({"carry": carry, "command": cmd, "timeout_s": 60, "expect_s": EXPECT["part"]})
        else:
            out.append({"carry": carry, "command": prefix + cmd + " && " + then, "timeout_s": timeout_s,
                        "expect_s": expect_s, "note": note})
    return out


# A branch's GPU suite beside the uploads (--patch, shared with scripts/vllm/calls.py): its tree
# copy needs GoogleTest (.carry/gtest, 1.5 MB beside a part); it ran 231 s beside this plan's
# parts and first RULER items (record 2026-12-01-h200-gpu-suite-redesign, row eb58e94), which
# time nothing.
PATCH_OUT = "/root/patch-check"


def start_patch(call: dict, patch: str) -> None:
    """Makes `call` also start `patch`'s GPU suite in the background (scripts/gpu_check_patch.sh)."""
    call["carry"] = call["carry"] + [".carry/gtest"]
    call["command"] += f" && scripts/gpu_check_patch.sh start {patch} {PATCH_OUT}"


def collect_patch(seconds: int) -> str:
    """A command copying the patch suite's summaries into $OUT/patch-check (waiting up to `seconds`)."""
    return f"scripts/gpu_check_patch.sh collect {PATCH_OUT} $OUT/patch-check {seconds}"


# A benchmark beside the uploads (--bench): one part call, once the package has built, runs
# bench/run_benchmarks.sh on the installed library; the part calls leave the GPU idle.
BENCH_CALL = 12
EXPECT_BENCH = 150  # issue 33's head-dim and window cases at 16K-128K (bench/bench_attention.py)


def start_bench(call: dict, bench: str, commit: str) -> None:
    """Makes `call` also run the benchmark with arguments `bench` into $OUT/bench."""
    call["command"] += (" && scripts/python_install_background.sh wait /root/qwen/install 240 && "
                        f"SP_LIB=installed SP_COMMIT={commit} bench/run_benchmarks.sh $OUT/bench {bench}")
    call["timeout_s"] = 600
    call["expect_s"] = EXPECT_BENCH
    call["note"] = ("waits for the package, then the benchmark (its record: python3 bench/record.py "
                    "OUT/bench/bench.json)")


def calls(first_eval: int, second_eval: int, resume: bool = False, patch: str = "", bench: str = "",
          commit: str = "unknown"):
    """resume: the first evaluation call carries .carry/qwen-results (an earlier session's results, which
    the run goes on from); patch: the second call starts a branch's GPU suite, and each evaluation
    call copies what it has (the first waits for nothing, the second up to a minute)."""
    out = part_calls("scripts/model/assemble_qwen.sh final && SP_CALL_SECONDS=" + str(first_eval)
                     + " scripts/model/gpu_qwen.sh $OUT", 600, first_eval + 20,
                     "assembles and converts the model, calibrates, then evaluates until the call's time is spent",
                     prefix="export SP_CALL_START=$(date +%s); ")
    out.append({"carry": [], "command": f"SP_CALL_SECONDS={second_eval} scripts/model/gpu_qwen.sh $OUT",
                "timeout_s": 600, "expect_s": second_eval + 20,
                "note": "resumes the evaluation; set SP_CALL_SECONDS to the device time left minus 60 (at most "
                "540); repeat this call while device time is left"})
    if resume:
        out[-2]["carry"] = out[-2]["carry"] + [".carry/qwen-results"]
    if bench:
        start_bench(out[BENCH_CALL - 1], bench, commit)
    if patch:
        start_patch(out[1], patch)
        out[-2]["command"] += "; " + collect_patch(1)
        out[-1]["command"] = collect_patch(60) + "; " + out[-1]["command"]
    return out


def ruler_seconds(before: int, first_eval: int, second_eval: int) -> int:
    """RULER's seconds in the two evaluation calls: what the first leaves after `before` (its
    work ahead of RULER), and the second after loading the model."""
    return first_eval + 20 - before + second_eval - EXPECT["load"]


def plan(first_eval: int, second_eval: int) -> str:
    item = {L: PROMPTS * t for L, t in PER_PROMPT.items()}
    before = EXPECT["final"] + EXPECT["calibrate"] + EXPECT["load"] + EXPECT["ppl"] + EXPECT["timing"]
    ruler = ruler_seconds(before, first_eval, second_eval)
    queue = [(f"dense + {CHOSEN} chosen @ 32K", (1 + CHOSEN) * item[32768]),
             (f"dense + {CHOSEN} chosen @ 16K", (1 + CHOSEN) * item[16384]),
             ("dense @ 8K and 4K", item[8192] + item[4096]),
             (f"{CHOSEN} chosen @ 8K and 4K", CHOSEN * (item[8192] + item[4096]))]
    total = EXPECT["start"] + PARTS * EXPECT["part"] + first_eval + 20 + second_eval + 20
    lines = ["Plan (estimates; the run measures its own rates and stops each call before its deadline):",
             f"  RULER: {PROMPTS // 40} tasks x 40 samples = {PROMPTS} prompts per (setting, length); per item "
             + ", ".join(f"{L // 1024}K ~{s:.0f} s" for L, s in item.items()),
             f"  before RULER, in the first evaluation call: final {EXPECT['final']} s, calibrate "
             f"{EXPECT['calibrate']} s, load {EXPECT['load']} s, perplexity/KL of every setting {EXPECT['ppl']} s, "
             f"prefill timing {EXPECT['timing']} s",
             f"  RULER time in the two evaluation calls: ~{ruler} s; the queue, in order:"]
    acc = 0.0
    for what, s in queue:
        acc += s
        lines.append(f"    {what}: {s:.0f} s (cumulative {acc:.0f} s){'  <- within this plan' if acc <= ruler else ''}")
    lines += ["    then more settings at 32K, nearest the chosen densities first",
              f"  device time of calls 1-{PARTS + 1}: ~{total} s ({total / 60:.1f} min); each further "
              "evaluation call adds its SP_CALL_SECONDS + 20 s"]
    return "\n".join(lines)


def items_left(doc: dict) -> list:
    """(setting, length, prompts left) of each RULER item of a results document's queue not yet
    complete (PROMPTS prompts each), in queue order."""
    ruler = doc.get("ruler", {})
    results = ruler.get("results", {})
    out = []
    for setting, length in ruler.get("queue", []):
        tasks = results.get(setting, {}).get(str(length), {}).get("tasks", {})
        left = PROMPTS - sum(len(samples) for samples in tasks.values())
        if left > 0:
            out.append((setting, int(length), left))
    return out


def resume_plan(doc: dict, first_eval: int, second_eval: int) -> str:
    """The resumed run's sizing: the carried results' items left, at PER_PROMPT's rates."""
    before = EXPECT["final"] + EXPECT["calibrate"] + EXPECT["load"]
    ruler = ruler_seconds(before, first_eval, second_eval)
    left = items_left(doc)
    lines = [f"Plan of the resumed run (estimates): {len(left)} RULER items left in the carried results; "
             f"before RULER, final {EXPECT['final']} s, calibrate {EXPECT['calibrate']} s, load {EXPECT['load']} s",
             f"  RULER time in the two evaluation calls: ~{ruler} s; each further call ~SP_CALL_SECONDS - "
             f"{EXPECT['load']} s:"]
    acc = 0.0
    for setting, length, prompts in left:
        acc += prompts * PER_PROMPT[length]
        lines.append(f"    {setting} @ {length // 1024}K: {prompts} prompts, {prompts * PER_PROMPT[length]:.0f} s "
                     f"(cumulative {acc:.0f} s){'  <- within the two calls' if acc <= ruler else ''}")
    total = EXPECT["start"] + PARTS * EXPECT["part"] + before + acc + 40
    lines.append(f"  device time for all of it: ~{total:.0f} s ({total / 60:.1f} min) in one session's calls")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per call")
    p.add_argument("--first-eval", type=int, default=520, help="work seconds of the call with part 22")
    p.add_argument("--second-eval", type=int, default=420, help="work seconds of the next call")
    p.add_argument("--resume", action="store_true",
                   help="go on from .carry/qwen-results (an earlier session's qwen-long.json and cal.safetensors)")
    p.add_argument("--patch", metavar="FILE", default="",
                   help="also run this branch patch's GPU suite beside the uploads (an untracked file at the "
                        "repository's root: scripts/gpu_check_patch.sh)")
    p.add_argument("--bench", metavar="ARGS", default="",
                   help=f"also run bench/run_benchmarks.sh with these arguments in part call {BENCH_CALL}, on the "
                        "installed package, into $OUT/bench")
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    bench = " ".join(shlex.quote(a) for a in shlex.split(args.bench))
    plan_calls = calls(args.first_eval, args.second_eval, args.resume, args.patch, bench, commit or "unknown")
    fits = check_sizes(plan_calls, pathlib.Path(__file__).resolve().parents[2])
    for i, c in enumerate(plan_calls, 1):
        if args.json:
            print(json.dumps(dict(c, call=i)))
        else:
            print(f"call {i:2d}: carry={json.dumps(c['carry'])} timeout_s={c['timeout_s']} (~{c['expect_s']} s)"
                  + (f"  # {c['note']}" if "note" in c else ""))
            print(f"         command: {c['command']}")
    if not args.json:
        print()
        carried = pathlib.Path(__file__).resolve().parents[2] / ".carry" / "qwen-results" / "results.json"
        if args.resume and carried.is_file():
            print(resume_plan(json.loads(carried.read_text()), args.first_eval, args.second_eval))
        else:
            print(plan(args.first_eval, args.second_eval))
        print("\nAfter the calls, here: gzip -9nc the last $OUT/qwen-long.json > bench/records/quality/DATE-h200-"
              "qwen25-coder-1.5b-long.json.gz and run\n  python -m sparseprefill.quality.report bench/records/quality/"
              "2026-11-29-h200-smollm2-b128-operator-timing.json --mc-analysis bench/records/quality/"
              "2026-11-30-cpu-smollm2-b128-mc-analysis.json --long bench/records/quality/DATE-h200-qwen25-coder-"
              "1.5b-long.json.gz")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
