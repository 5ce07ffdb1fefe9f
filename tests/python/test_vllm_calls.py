# SPDX-License-Identifier: Apache-2.0
"""The GPU machine's plan for the vLLM backend (scripts/vllm/calls.py, pure Python): the
sessions fit the device limits, every stage gpu_vllm.sh runs has its expected seconds there (and
no other), each session builds the package once and carries vLLM's parts in order; and the
serving records' highest rate within the SLO (scripts/vllm/common.py), which the soak and the
report use; and the Qwen plan's resume and patch calls (scripts/model/qwen_calls.py, which
calls.py builds on)."""

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "vllm"))
import calls  # noqa: E402
import common  # noqa: E402
import qwen_calls  # noqa: E402  (scripts/model, on the path through calls)

SESSIONS = {name: make("c0ffee") for name, make in calls.SESSIONS.items()}


@pytest.mark.parametrize("name", sorted(SESSIONS))
def test_each_session_fits_the_device_limits(name):
    session = SESSIONS[name]
    assert calls.total(session) <= calls.SESSION_LIMIT
    for call in session:
        assert call["expect_s"] < call["timeout_s"] <= 600, call
        if "budget_s" in call:  # gpu_vllm.sh skips what would pass SP_CALL_SECONDS
            assert call["budget_s"] <= calls.CALL_SECONDS, call


def test_every_stage_of_gpu_vllm_has_its_seconds():
    script = (ROOT / "scripts" / "vllm" / "gpu_vllm.sh").read_text()
    run = set(re.findall(r"(?:^ *|&& |\) )stage ([a-z0-9-]+) ", script, re.M))  # a command's start
    assert run == set(calls.STAGES)
    named = set(re.findall(r"^    ([a-z0-9-]+)\)", script, re.M))
    assert named == set(calls.GROUPS) | (set(calls.STAGES) - {s for g in calls.GROUPS.values() for s in g})


def carried(session):
    return [path for call in session for path in call["carry"]]


def test_each_session_builds_once_and_carries_vllm_in_order():
    for name, session in SESSIONS.items():
        commands = " ; ".join(c["command"] for c in session)
        builds = commands.count("assemble.sh install") + commands.count("assemble_qwen.sh install")
        assert builds == 1, name
        first_run = next(i for i, c in enumerate(session) if "gpu_vllm.sh" in c["command"])
        assert "install" in session[0]["command"], name  # the build starts in the first call
        paths = carried(session)
        vllm = [p for p in paths if p.startswith(".carry/vllm/")]
        assert vllm == [f".carry/vllm/1/{n}" for n in calls.c_pieces()] + [".carry/vllm/2"], name
        assert paths.index(".carry/vllm/2") <= first_run, name
    assert not any(p.startswith(".carry/qwen/") for p in carried(SESSIONS["A"]))
    for name in ("B", "C"):  # the model's parts in order, joined before any stage needs it
        session = SESSIONS[name]
        assert [p for p in carried(session) if p.startswith(".carry/qwen/")] == \
            [f".carry/qwen/{i:02d}" for i in range(1, 23)]
        final = next(c for c in session if "assemble_qwen.sh final" in c["command"])
        assert session.index(final) < next(i for i, c in enumerate(session) if "gpu_vllm.sh" in c["command"])


def test_the_sessions_run_every_stage_once():
    runs = {name: [w for c in s if "gpu_vllm.sh" in c["command"] for w in c["command"].split("$OUT ")[1].split()]
            for name, s in SESSIONS.items()}
    # A-C on one GPU; D (tensor parallelism, two GPUs) runs tp and, on its own machine, ttft8b at TP 1
    one_gpu = [w for name, stages in runs.items() if name != "D" for w in stages]
    assert sorted(one_gpu + ["tp"]) == sorted(calls.GROUPS.keys() | (
        set(calls.STAGES) - {s for g in calls.GROUPS.values() for s in g}))
    assert runs["D"] == ["tp", "ttft8b"]
    assert all(c.get("kind") == "nvidia-h200-x2" for c in SESSIONS["D"])
    assert "SP_VLLM_TP=2 " in next(c["command"] for c in SESSIONS["D"] if "$OUT tp" in c["command"])
    # the soak reads its rate from a record that session B wrote (serving ran on another machine)
    soak = next(c for c in SESSIONS["C"] if "$OUT soak" in c["command"])
    assert soak["command"].startswith(f"SP_VLLM_SOAK_OF={calls.latest_serving_record()} ")


def test_a_patch_check_beside_session_c_ends_before_anything_timed():
    session = calls.session_c("c0ffee", "branch.patch")
    assert "gpu_check_patch.sh start branch.patch" in session[0]["command"]
    assert ".carry/gtest" in session[0]["carry"]  # gpu_check.sh's GoogleTest on the GPU machine
    timed = next(i for i, c in enumerate(session) if "$OUT ttft8b" in c["command"])
    assert "gpu_check_patch.sh collect" in session[timed]["command"]
    assert not any("gpu_check_patch.sh" in c["command"] for c in session[1:timed])
    assert session[timed]["budget_s"] <= calls.CALL_SECONDS  # its wait and the stage fit gpu_vllm.sh's time
    assert calls.total(session) <= calls.SESSION_LIMIT


def record(*runs):
    return {"runs": [{"rate": rate, "p99_ttft_ms": p99, "failed": failed} for rate, p99, failed in runs]}


def test_best_rate_is_the_highest_within_the_slo_without_failures():
    assert common.best_rate(record((2, 900.0, 0), (4, 9000.0, 0), (8, 30000.0, 0)), slo_s=10) == 4
    assert common.best_rate(record((2, 900.0, 0), (4, 9000.0, 3), (8, 30000.0, 0)), slo_s=10) == 2
    assert common.best_rate(record((4, 9000.0, 0), (2, 900.0, 0)), slo_s=10) == 4  # order of runs
    assert common.best_rate(record((2, 10000.0, 0)), slo_s=10) == 2  # the bound is inclusive
    assert common.best_rate(record((2, 10001.0, 0), (4, None, 0)), slo_s=10) is None
    # the inf rate (every request at once) measures capacity, never a sustained rate
    assert common.best_rate(record((2, 900.0, 0), (float("inf"), 900.0, 0)), slo_s=10) == 2


def test_capacity_is_the_throughput_of_the_inf_rate():
    runs = record((2, 900.0, 0), (float("inf"), 40000.0, 0))
    runs["runs"][0]["request_throughput"], runs["runs"][1]["request_throughput"] = 1.9, 7.5
    assert common.capacity(runs) == 7.5
    assert common.capacity(record((2, 900.0, 0))) is None


def test_the_soak_runs_at_the_capacity_else_the_best_rate():
    runs = record((4, 900.0, 0), (8, 9000.0, 0), (float("inf"), 40000.0, 0))
    for run, throughput in zip(runs["runs"], (3.9, 7.8, 10.27)):
        run["request_throughput"] = throughput
    assert common.soak_rate(runs) == 10.0  # rounded down to 0.5 req/s
    assert common.soak_rate({"serve-ours": runs, "serve-fa": record((2, 900.0, 0))}) == 10.0  # a session record
    assert common.soak_rate(record((4, 900.0, 0), (8, 9000.0, 0)), slo_s=10) == 8
    assert common.soak_rate(record((4, 90000.0, 0)), slo_s=10) is None


def test_the_qwen_plan_resumes_and_runs_a_patch_beside_its_uploads():
    plain = qwen_calls.calls(520, 420)
    both = qwen_calls.calls(520, 420, resume=True, patch="branch.patch")
    assert len(both) == len(plain) == qwen_calls.PARTS + 1
    assert not any(".carry/qwen-results" in c["carry"] or "gpu_check_patch" in c["command"] for c in plain)
    assert both[-2]["carry"] == [".carry/qwen/22", ".carry/qwen-results"]  # the call that runs gpu_qwen.sh first
    assert "gpu_check_patch.sh start branch.patch" in both[1]["command"] and ".carry/gtest" in both[1]["carry"]
    assert all("gpu_check_patch.sh collect" in c["command"] for c in both[-2:])


def test_the_qwen_plan_runs_a_benchmark_in_one_part_call_after_the_package_built():
    plain = qwen_calls.calls(520, 420)
    bench = qwen_calls.calls(520, 420, bench="--family-lengths 16384", commit="c0ffee")
    changed = [i for i, (a, b) in enumerate(zip(plain, bench)) if a != b]
    assert changed == [qwen_calls.BENCH_CALL - 1]
    cmd = bench[qwen_calls.BENCH_CALL - 1]["command"]
    assert cmd.index("assemble_qwen.sh part") < cmd.index("python_install_background.sh wait") < cmd.index(
        "bench/run_benchmarks.sh $OUT/bench --family-lengths 16384")
    assert "SP_LIB=installed SP_COMMIT=c0ffee" in cmd
    assert bench[qwen_calls.BENCH_CALL - 1]["timeout_s"] <= 600 and "install" in bench[0]["command"]
    assert not any("run_benchmarks" in c["command"] for c in plain)


def test_a_call_whose_tree_and_carry_exceed_the_limit_is_named():
    plan = qwen_calls.calls(520, 420, resume=True)
    sizes = {".carry/qwen-results": 2 << 20}
    part = lambda path: 50 << 20 if path.startswith(".carry/qwen/") else sizes.get(path, 0)  # noqa: E731
    assert qwen_calls.oversized(plan, 12 << 20, part) == []
    # The call with part 22 also carries the earlier results: 64 MiB and a byte more does not fit.
    over = qwen_calls.oversized(plan, (12 << 20) + 1, part)
    assert over == [(qwen_calls.PARTS, (64 << 20) + 1)]
    assert qwen_calls.oversized(plan, 15 << 20, part) == [(i, (65 << 20) + (2 << 20 if i == qwen_calls.PARTS else 0))
                                                          for i in range(1, qwen_calls.PARTS + 1)]
    assert qwen_calls.path_bytes(ROOT / "no-such-path") == 0 and qwen_calls.tree_bytes(ROOT) > 0


def test_the_resumed_qwen_plan_counts_the_prompts_each_item_has_left():
    whole = {t: [0] * 40 for t in "abcdefgh"}  # 8 tasks x 40 samples: PROMPTS
    doc = {"ruler": {"queue": [["dense", 32768], ["x", 32768], ["x", 16384], ["y", 32768]],
                     "results": {"dense": {"32768": {"tasks": whole}},
                                 "x": {"32768": {"tasks": {"a": [0] * 40, "b": [0] * 7}}}}}}
    assert qwen_calls.items_left(doc) == [("x", 32768, 320 - 47), ("x", 16384, 320), ("y", 32768, 320)]
    text = qwen_calls.resume_plan(doc, 520, 420)
    assert "3 RULER items left" in text and "x @ 32K: 273 prompts" in text and "dense @" not in text
    assert qwen_calls.items_left({"ruler": {"queue": [["dense", 4096]], "results": {"dense": {"4096": {
        "tasks": whole}}}}}) == []
