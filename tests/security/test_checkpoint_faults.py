"""Checkpoint faults end in one clear line: a full disk, a killed save's debris, a file that is
not a checkpoint, a FIFO where a checkpoint should be."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit.errors import CheckpointError
from tests.security.conftest import src_env


@pytest.fixture
def small_tmpfs() -> Path:
    """A 2 MiB tmpfs mounted for this test (root only) and unmounted after."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a tmpfs")
    mount = Path(f"/tmp/devicekit-full-{uuid.uuid4().hex[:8]}")
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True, timeout=30)
        mount.rmdir()


def test_disk_full_names_the_directory_and_keeps_the_previous(small_tmpfs):
    target = small_tmpfs / "last.pt"
    dk.save_checkpoint({"w": torch.ones(1000)}, target)  # 4 KB: fits
    with pytest.raises(CheckpointError) as info:
        dk.save_checkpoint({"w": torch.ones(2 * 1024 * 1024)}, target)  # 8 MiB: does not
    message = str(info.value)
    assert message.startswith(f"no space left on {str(small_tmpfs)!r} (needed ~8")
    assert "previous checkpoint" in message and "intact" in message and "\n" not in message
    assert torch.equal(dk.load_checkpoint(target, map_location="cpu")["w"], torch.ones(1000))
    assert [p.name for p in small_tmpfs.iterdir()] == ["last.pt"]  # no temporary file left


KILLED_SAVE = """
import os, signal, sys, torch
import devicekit.placement.checkpoint as ck
real = torch.save
def save_then_die(obj, handle):
    real(obj, handle)
    handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)      # killed mid-save, before the rename
torch.save = save_then_die
ck.save_checkpoint({"w": torch.ones(10)}, sys.argv[1])
"""


def test_killed_save_temporaries_are_cleaned_on_the_next_save(tmp_path):
    target = tmp_path / "last.pt"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", KILLED_SAVE, str(target)], env=src_env(),
                              capture_output=True, timeout=120)
        assert done.returncode == -9
    debris = sorted(p.name for p in tmp_path.iterdir())  # the second save removed the first's
    assert len(debris) == 1 and debris[0].startswith(".last.pt.") and debris[0].endswith(".tmp")
    foreign = tmp_path / ".other.pt.x.tmp"  # another checkpoint's temporary: not ours to touch
    foreign.write_bytes(b"x")
    dk.save_checkpoint({"w": torch.zeros(3)}, target)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.x.tmp", "last.pt"]


def test_a_save_in_progress_is_not_taken_for_debris(tmp_path):
    import fcntl

    from devicekit.placement.save_faults import remove_stale_temporaries

    busy = tmp_path / ".last.pt.abc.tmp"
    busy.write_bytes(b"half")
    with open(busy, "rb") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        assert remove_stale_temporaries(tmp_path / "last.pt") == []
    assert remove_stale_temporaries(tmp_path / "last.pt") == [busy]


@pytest.mark.parametrize("path", ["/etc/passwd", "/etc/hostname", "text"])
def test_not_a_checkpoint_is_one_line(path, tmp_path):
    if path == "text":
        path = str(tmp_path / "notes.pt")
        Path(path).write_text("hello\n" * 100)
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    with pytest.raises(CheckpointError) as info:
        dk.load_checkpoint(path)
    assert path in str(info.value) and "\n" not in str(info.value)


def test_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "ck.pt"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointError, match="not a regular file"):
        dk.load_checkpoint(fifo)
