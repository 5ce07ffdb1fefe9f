# SPDX-License-Identifier: Apache-2.0
"""A quality run resumed from a record's results alone (its calibration file not kept):
data.calibration_epoch gives the SOURCE_DATE_EPOCH under which calibrate records the results'
calibration date, so that the calibration made again can be the same file; a malformed epoch is
refused by name, and without the variable the file records today."""

import datetime

import pytest

from sparseprefill.quality import data


def results(date):
    return {"meta": {"calibration": {"metadata": {"date": date, "model": "m"}}}}


@pytest.mark.parametrize("date", ["2026-12-01", "2024-02-29", "1999-12-31"])
def test_the_epoch_of_the_results_gives_their_date_back(monkeypatch, date):
    epoch = data.calibration_epoch(results(date))
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(epoch))
    assert data.record_date() == date
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(epoch + 86399))  # any second of that day (UTC)
    assert data.record_date() == date
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(epoch + 86400))
    assert data.record_date() != date


def test_without_the_variable_the_date_is_today(monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    assert data.record_date() == datetime.date.today().isoformat()


@pytest.mark.parametrize("bad", ["yesterday", "1.5e9", "99999999999999999999"])
def test_a_malformed_epoch_is_refused_by_name(monkeypatch, bad):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", bad)
    with pytest.raises(SystemExit, match="SOURCE_DATE_EPOCH"):
        data.record_date()


def test_results_without_a_calibration_date_are_refused():
    with pytest.raises(SystemExit, match="no date"):
        data.calibration_epoch({"meta": {"calibration": {"metadata": {}}}})
