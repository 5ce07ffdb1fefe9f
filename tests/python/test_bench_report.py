# SPDX-License-Identifier: Apache-2.0
"""bench/bench_report.py's issue-33 checks on hand-made cases: dense at head dims 96 and 256
against SDPA cuDNN (SDPA flash where cuDNN could not run; the Llama and d 192/128 cases not
checked), the 4096-token window at 128K against Flex on the same window, and the window case
kept out of the Llama-shape targets of issues 3 and 4."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_report as br  # noqa: E402


def row(impl, ms, target=None, status="ok", family="peer"):
    return {"impl": impl, "ms": ms, "target": target, "status": status, "family": family, "label": impl,
            "density": 1.0}


def case(model, d, n, rows, **extra):
    return {"model": model, "n": n, "h_q": 16, "h_kv": 8, "d": d, "d_v": extra.pop("d_v", d), "n_sets": 1,
            "set_mb": 1.0, "rows": rows, **extra}


def checks(cases):
    return [(name, n, round(v, 6), ok) for name, n, v, _, ok in br.target_checks(cases) if name.startswith("#33")]


def test_family_dense_is_checked_against_cudnn_and_flash_where_cudnn_failed():
    got = checks([
        case("gemma-3-12b", 256, 32768, [row("sdpa_flash", 12.0), row("sdpa_cudnn", 10.0),
                                         row("ours_dense", 8.0, family="ours")]),
        case("phi-3-mini", 96, 16384, [row("sdpa_flash", 6.0), row("sdpa_cudnn", 0, status="error"),
                                       row("ours_dense", 7.5, family="ours")]),
        case("phi-3-mini", 96, 8192, [row("sdpa_cudnn", 3.0), row("ours_dense", 2.0, family="ours")]),
        case("deepseek-v2-lite", 192, 32768, [row("sdpa_cudnn", 3.0), row("ours_dense", 2.0, family="ours")],
             d_v=128)])
    assert got == [("#33 dense d 256 ≥ 1.0× SDPA cuDNN", 32768, 1.25, True),
                   ("#33 dense d 96 ≥ 1.0× SDPA flash (no cuDNN)", 16384, 0.8, False)]


def test_the_window_is_checked_at_128k_against_flex_and_not_as_the_llama_shape():
    rows = [row("flex_mask", 30.0, "window"), row("ours_dense_window", 15.0, "window", family="ours"),
            row("ours_dense", 15.0, family="ours"), row("sdpa_cudnn", 10.0)]
    window = case("llama-3.1-8b", 128, 131072, rows, window=4096)
    assert checks([window]) == [("#33 window 4096 ≥ 1.5× Flex, same window", 131072, 2.0, True)]
    assert checks([dict(window, n=65536)]) == []
    assert checks([dict(window, window=1024)]) == []
    assert all(not name.startswith("#4") for name, *_ in br.target_checks([window]))
    assert br.case_name(window) == "llama-3.1-8b (window 4096)"
    assert "window_size (4096, 0)" in br.case_title(window)
    assert br.row_ratios(window, rows[1])["flex_mask"] == 2.0


def test_a_v_head_dim_of_its_own_is_shown():
    assert "d 192/128" in br.case_title(case("deepseek-v2-lite", 192, 4096, [], d_v=128))
    assert "d 256," in br.case_title(case("gemma-3-12b", 256, 4096, []))
