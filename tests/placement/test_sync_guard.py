"""sync_guard on a CPU-only run explains itself; its collector attributes syncs to lines."""

from __future__ import annotations

import warnings

import pytest
import torch

import devicekit as dk
from devicekit.placement.sync_guard import SYNC_MESSAGE, SyncReport, _collect


def test_cpu_runs_the_body_and_does_not_claim_a_clean_loop() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; see tests/gpu")
    ran = []
    with dk.sync_guard() as report:
        for i in range(3):
            ran.append(torch.ones(2).sum().item() + i)
    assert ran == [2.0, 3.0, 4.0]
    assert not report.checked and report.count == 0
    text = str(report)
    assert "not checked" in text and "host" in text and "CUDA" in text
    assert "no host syncs caught" not in text


def test_explicit_cpu_device_is_explained_too() -> None:
    with dk.sync_guard(device="cpu") as report:
        pass
    assert not report.checked and "cpu" in str(report)


def test_bad_mode_is_rejected() -> None:
    with pytest.raises(dk.InvalidValueError, match="'loud'"):
        with dk.sync_guard(mode="loud"):
            pass


def emit_sync() -> None:
    warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)  # the same text torch's debug mode warns with


def test_collector_counts_each_line_and_passes_other_warnings_on() -> None:
    """The warning-collection half of sync_guard, driven by torch's message (CUDA does the rest)."""
    report = SyncReport("warn", torch.device("cuda", 0), checked=True)
    with warnings.catch_warnings(record=True) as others:
        warnings.simplefilter("always")
        with _collect(report):
            for _ in range(5):
                emit_sync()
            warnings.warn("unrelated", UserWarning, stacklevel=1)
    assert report.count == 5 and len(report.syncs) == 1
    sync = report.syncs[0]
    assert sync.filename == __file__ and "warnings.warn(SYNC_MESSAGE" in sync.line
    assert [str(w.message) for w in others] == ["unrelated"]
    assert "5 host sync(s)" in str(report) and "x5" in str(report)


def test_collector_records_the_raising_line_in_error_mode() -> None:
    report = SyncReport("error", torch.device("cuda", 0), checked=True)
    with pytest.raises(RuntimeError), _collect(report):
        raise RuntimeError(SYNC_MESSAGE)
    assert report.raised and report.count == 1
    assert "raise RuntimeError(SYNC_MESSAGE)" in report.syncs[0].line
