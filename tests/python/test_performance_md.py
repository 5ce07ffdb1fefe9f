# SPDX-License-Identifier: Apache-2.0
"""bench/make_performance_md.py's choice of rows: the newest record measuring a row wins, except
a record whose `feeds` leaves the table out (a focused A/B run must not replace another table's
rows with rows that lack their peers)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import make_performance_md as pm  # noqa: E402

DENSE = next(c for c in pm.CLAIMS if c["title"] == "Dense attention, Hopper path")
FP8 = next(c for c in pm.CLAIMS if c["title"] == "FP8 dense (e4m3), Hopper path")


def record(name, date, dense_ms, fp8_ms, **extra):
    rows = [{"impl": "sdpa_cudnn", "status": "ok", "ms": 20.0},
            {"impl": "ours_dense", "status": "ok", "ms": dense_ms, "tflops": 600.0},
            {"impl": "ours_dense_fp8", "status": "ok", "ms": fp8_ms, "tflops": 800.0, "err_vs_ours_dense": 0.02}]
    return {"record": name, "date": date, "cases": [{"model": "llama-3.1-8b", "n": 32768, "d": 128, "rows": rows}],
            **extra}


def table_text(claim, records):
    return "\n".join(pm.claim_table(claim, records))


def test_the_newest_record_feeds_every_table_by_default():
    records = [record("old", "2026-11-01", 14.0, 11.5), record("new", "2026-12-01", 13.0, 10.5)]
    assert "| 13.0 |" in table_text(DENSE, records) and "new" in table_text(DENSE, records)
    assert "| 10.5 |" in table_text(FP8, records) and "old" not in table_text(FP8, records)


def test_a_record_with_feeds_leaves_the_other_tables_to_older_records():
    records = [record("old", "2026-11-01", 14.0, 11.5),
               record("focused", "2026-12-01", 13.0, 10.5, feeds=[FP8["title"]])]
    dense, fp8 = table_text(DENSE, records), table_text(FP8, records)
    assert "| 14.0 |" in dense and "focused" not in dense and "old" in dense
    assert "| 10.5 |" in fp8 and "focused" in fp8 and "| 11.5 |" not in fp8


def test_model_family_head_dims_and_windows_have_tables_of_their_own():
    family = next(c for c in pm.CLAIMS if c["title"] == "Dense attention at the model-family head dims")
    window = next(c for c in pm.CLAIMS if c["title"] == "Sliding window")
    rows = [{"impl": "sdpa_cudnn", "status": "ok", "ms": 10.0},
            {"impl": "ours_dense", "status": "ok", "ms": 8.0, "tflops": 300.0}]
    gemma = {"model": "gemma-3-12b", "n": 32768, "d": 256, "d_v": 256, "rows": rows}
    mla = {"model": "deepseek-v2-lite", "n": 32768, "d": 192, "d_v": 128, "rows": rows}
    win = {"model": "llama-3.1-8b", "n": 131072, "d": 128, "d_v": 128, "window": 4096,
           "rows": [{"impl": "flex_mask", "target": "window", "status": "ok", "ms": 21.0},
                    {"impl": "ours_dense_window", "target": "window", "status": "ok", "ms": 14.0, "tflops": 570.0,
                     "err_vs_flex_mask": 0.003}]}
    records = [{"record": "fam", "date": "2026-12-02", "cases": [gemma, mla, win]}]
    assert "gemma" not in table_text(DENSE, records) and "llama" not in table_text(DENSE, records)
    text = table_text(family, records)
    assert "| gemma-3-12b | 32K | 256 | 8 | 300 | 1.25 |" in text and "| 192/128 |" in text
    assert "| llama-3.1-8b | 128K | 4096 | 14.0 | 570 | 21.0 | 1.5 | 3.0e-03 |" in table_text(window, records)
