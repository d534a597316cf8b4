"""dk.latest_checkpoint / dk.resume: the newest checkpoint, never a save in progress."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

import devicekit as dk


def _save(path: Path, step: int, mtime: float) -> Path:
    dk.save_checkpoint({"step": step}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_the_newest_file_wins_and_temporaries_are_never_taken(tmp_path: Path) -> None:
    _save(tmp_path / "step9.pt", 9, 1000)
    newest = _save(tmp_path / "step10.pt", 10, 2000)
    (tmp_path / ".step11.pt.abc123.tmp").write_bytes(b"half a save")
    os.utime(tmp_path / ".step11.pt.abc123.tmp", (3000, 3000))
    assert dk.latest_checkpoint(tmp_path) == newest
    assert dk.resume(tmp_path, map_location="cpu") == {"step": 10}


def test_equal_times_go_to_the_natural_last_name(tmp_path: Path) -> None:
    _save(tmp_path / "step9.pt", 9, 1000)
    _save(tmp_path / "step10.pt", 10, 1000)
    assert dk.latest_checkpoint(tmp_path).name == "step10.pt"


def test_a_pattern_selects_among_the_files(tmp_path: Path) -> None:
    _save(tmp_path / "model-1.pt", 1, 1000)
    _save(tmp_path / "other.pt", 99, 5000)
    assert dk.latest_checkpoint(tmp_path / "model-*.pt").name == "model-1.pt"


def test_an_unreadable_newest_costs_one_checkpoint_with_a_warning(tmp_path: Path) -> None:
    _save(tmp_path / "a.pt", 1, 1000)
    bad = tmp_path / "b.pt"
    bad.write_bytes(b"PK\x03\x04 truncated")
    os.utime(bad, (2000, 2000))
    with pytest.warns(UserWarning, match=r"b\.pt.*resuming from the checkpoint before it"):
        assert dk.resume(tmp_path, map_location="cpu") == {"step": 1}


def test_nothing_to_resume_is_none_and_a_slurm_restart_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dk.resume(tmp_path / "none-yet") is None
        assert dk.latest_checkpoint(tmp_path) is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    with pytest.warns(UserWarning, match="SLURM_RESTART_COUNT=2.*no checkpoint.*from scratch"):
        assert dk.resume(tmp_path) is None


class Opaque:
    def __init__(self) -> None:
        self.value = 3


def test_unsafe_checkpoints_are_refused_not_skipped(tmp_path: Path) -> None:
    dk.save_checkpoint({"obj": Opaque()}, tmp_path / "unsafe.pt")
    with pytest.raises(dk.UnsafeCheckpointError):
        dk.resume(tmp_path)
