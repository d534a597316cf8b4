"""save_checkpoint / load_checkpoint: atomic under SIGKILL, device mapping, safe loading."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit.placement import checkpoint

# The child saves a checkpoint whose bytes are written in slow chunks (torch.save is wrapped),
# and signals after the first chunks are on disk: the parent then kills it mid-write.
THROTTLED_SAVE = textwrap.dedent(
    """
    import io, sys, time
    import torch
    import devicekit as dk

    path, marker = sys.argv[1], sys.argv[2]
    real_save = torch.save

    def throttled_save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        chunk = len(data) // 20 + 1
        for start in range(0, len(data), chunk):
            f.write(data[start:start + chunk])
            f.flush()
            if start == chunk:
                with open(marker, "w") as m:
                    m.write(str(len(data)))
            time.sleep(0.2)

    torch.save = throttled_save
    dk.save_checkpoint({"step": 2, "weights": torch.full((300_000,), 2.0)}, path)
    """
)

# The child saves in a loop as fast as it can; the parent reads concurrently, then kills it.
SAVE_LOOP = textwrap.dedent(
    """
    import sys
    import torch
    import devicekit as dk

    path = sys.argv[1]
    step = 0
    while True:
        step += 1
        dk.save_checkpoint({"step": step, "weights": torch.full((200_000,), float(step))}, path)
    """
)


def run_child(code: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_for(condition: Any, child: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if child.poll() is not None:
            raise AssertionError(f"child exited early: {child.stderr.read().decode()[-2000:]}")
        if time.monotonic() > deadline:
            child.kill()
            child.wait(5)
            raise AssertionError("child never reached the point to kill it at")
        time.sleep(0.02)


def kill(child: subprocess.Popen[bytes]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    if child.stderr is not None:
        child.stderr.close()


def test_kill_mid_write_leaves_previous_checkpoint(tmp_path: Path, child_env: dict[str, str]) -> None:
    path = tmp_path / "model.pt"
    dk.save_checkpoint({"step": 1, "weights": torch.full((300_000,), 1.0)}, path)
    before = path.read_bytes()
    marker = tmp_path / "half-written"
    child = run_child(THROTTLED_SAVE, [str(path), str(marker)], child_env)
    try:
        wait_for(marker.exists, child)
        kill(child)
    finally:
        if child.poll() is None:
            kill(child)
    assert child.returncode == -signal.SIGKILL
    full_size = int(marker.read_text())
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".model.pt.")]
    assert len(partial) == 1 and 0 < partial[0].stat().st_size < full_size  # killed mid-write
    assert path.read_bytes() == before
    state = dk.load_checkpoint(path)
    assert state["step"] == 1 and torch.all(state["weights"] == 1.0)


def test_kill_during_a_loop_of_saves_never_leaves_a_torn_file(
    tmp_path: Path, child_env: dict[str, str]
) -> None:
    path = tmp_path / "loop.pt"
    child = run_child(SAVE_LOOP, [str(path)], child_env)
    seen: list[int] = []
    try:
        wait_for(path.exists, child)
        deadline = time.monotonic() + 20
        while len(set(seen)) < 3 and time.monotonic() < deadline:  # read while it writes
            state = dk.load_checkpoint(path)
            assert torch.all(state["weights"] == float(state["step"]))
            seen.append(state["step"])
        kill(child)
    finally:
        if child.poll() is None:
            kill(child)
    assert len(set(seen)) >= 2
    state = dk.load_checkpoint(path)
    assert state["step"] >= max(seen) and torch.all(state["weights"] == float(state["step"]))


def save_as_if_on_cuda1(obj: Any, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Save CPU tensors with the location tag a cuda:1 save writes."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
        dk.save_checkpoint(obj, path)


def test_checkpoint_from_cuda1_loads_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu1.pt"
    save_as_if_on_cuda1({"w": torch.arange(4.0)}, path, monkeypatch)
    if torch.cuda.device_count() < 2:
        with pytest.raises(RuntimeError):  # what plain torch.load does with such a file here
            torch.load(path, weights_only=True)
    state = dk.load_checkpoint(path)
    assert state["w"].device == checkpoint.default_map_location()
    assert torch.equal(state["w"].cpu(), torch.arange(4.0))
    assert dk.load_checkpoint(path, map_location={"cuda:1": "cpu"})["w"].device.type == "cpu"
    assert dk.load_checkpoint(path, map_location="cpu")["w"].device.type == "cpu"
    assert dk.load_checkpoint(path, map_location=lambda s, loc: s)["w"].device.type == "cpu"


def test_map_location_missing_the_saved_device_is_explained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.device_count() >= 2:
        pytest.skip("cuda:1 exists here, so the file loads as saved")
    path = tmp_path / "gpu1.pt"
    save_as_if_on_cuda1({"w": torch.ones(2)}, path, monkeypatch)
    # "a device this machine lacks", not "truncated or corrupt" (the path names map_location too)
    with pytest.raises(dk.CheckpointError, match="device this machine lacks.*map_location="):
        dk.load_checkpoint(path, map_location={"cuda:0": "cpu"})


def test_bad_map_location_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    dk.save_checkpoint({"x": 1}, path)
    with pytest.raises(dk.InvalidDeviceError, match="gpu:0"):
        dk.load_checkpoint(path, map_location="gpu:0")
    with pytest.raises(dk.InvalidDeviceError, match="gpu"):
        dk.load_checkpoint(path, map_location={"cuda:1": "gpu"})
    with pytest.raises(dk.InvalidDeviceError, match="3.5"):
        dk.load_checkpoint(path, map_location=3.5)  # type: ignore[arg-type]


class Opaque:
    def __init__(self) -> None:
        self.value = 3


def test_arbitrary_pickle_is_refused_with_the_way_to_opt_in(tmp_path: Path) -> None:
    path = tmp_path / "pickle.pt"
    dk.save_checkpoint({"obj": Opaque()}, path)
    with pytest.raises(dk.UnsafeCheckpointError) as info:
        dk.load_checkpoint(path)
    message = str(info.value)
    assert "weights_only=False" in message and "Opaque" in message and "\n" not in message
    assert dk.load_checkpoint(path, weights_only=False)["obj"].value == 3


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all", None])
def test_missing_empty_and_corrupt_files_name_the_path(tmp_path: Path, content: bytes | None) -> None:
    path = tmp_path / "broken.pt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(dk.CheckpointError) as info:
        dk.load_checkpoint(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_truncated_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    dk.save_checkpoint({"w": torch.ones(1000)}, good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(dk.CheckpointError, match="truncated or corrupt"):
        dk.load_checkpoint(cut)


def test_save_replaces_keeps_mode_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "ckpt.pt"
    assert dk.save_checkpoint({"v": 1}, path) == path
    os.chmod(path, 0o640)
    dk.save_checkpoint({"v": 2}, path)
    assert dk.load_checkpoint(path) == {"v": 2}
    assert (path.stat().st_mode & 0o777) == 0o640
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]


def test_unpicklable_object_fails_cleanly_and_keeps_old_file(tmp_path: Path) -> None:
    path = tmp_path / "c.pt"
    dk.save_checkpoint({"v": 1}, path)
    with pytest.raises(dk.CheckpointError, match="pickle"):
        dk.save_checkpoint({"f": lambda: 0}, path)
    assert dk.load_checkpoint(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]


def test_directory_as_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(dk.CheckpointError, match="directory"):
        dk.save_checkpoint({"v": 1}, tmp_path)


def _fake_broadcast(received: list[list[object]], rank0_says: object = "keep") -> Any:
    """Stands in for broadcast_object_list: records what rank 0 sent, or delivers ``rank0_says``."""

    def broadcast(objects: list[object], src: int = 0, **kwargs: Any) -> None:
        if rank0_says != "keep":
            objects[0] = rank0_says
        received.append(list(objects))

    return broadcast


def test_only_rank_zero_writes_and_every_rank_waits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[list[object]] = []
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", _fake_broadcast(received))
    monkeypatch.setattr(checkpoint, "_distributed", lambda: (True, 1))
    path = tmp_path / "dist.pt"
    dk.save_checkpoint({"v": 1}, path)
    assert not path.exists() and received == [[None]]
    monkeypatch.setattr(checkpoint, "_distributed", lambda: (True, 0))
    dk.save_checkpoint({"v": 1}, path)
    assert path.exists() and received == [[None], [None]]


def test_rank_zero_failure_still_reaches_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[list[object]] = []
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", _fake_broadcast(received))
    monkeypatch.setattr(checkpoint, "_distributed", lambda: (True, 0))
    with pytest.raises(dk.CheckpointError):
        dk.save_checkpoint({"f": lambda: 0}, tmp_path / "x.pt")
    assert len(received) == 1 and isinstance(received[0][0], str)  # the others are told, not left hanging


def test_other_ranks_raise_when_rank_zero_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.distributed, "broadcast_object_list",
                        _fake_broadcast([], rank0_says="No space left on device"))
    monkeypatch.setattr(checkpoint, "_distributed", lambda: (True, 1))
    with pytest.raises(dk.CheckpointError, match="rank 0 could not write .*No space left"):
        dk.save_checkpoint({"v": 1}, tmp_path / "y.pt")


def test_real_single_process_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        path = tmp_path / "pg.pt"
        dk.save_checkpoint({"v": torch.ones(2)}, path)
        assert torch.equal(dk.load_checkpoint(path, map_location="cpu")["v"], torch.ones(2))
    finally:
        dist.destroy_process_group()


def test_unreadable_file_is_not_called_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "locked.pt"
    dk.save_checkpoint({"v": 1}, path)

    def denied(*args: Any, **kwargs: Any) -> Any:  # what a file without read permission gives
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(torch, "load", denied)
    with pytest.raises(dk.CheckpointError, match="Permission denied") as info:
        dk.load_checkpoint(path)
    assert "corrupt" not in str(info.value)


def test_non_path_is_refused() -> None:
    with pytest.raises(dk.CheckpointError, match="BytesIO"):
        dk.save_checkpoint({"v": 1}, __import__("io").BytesIO())  # type: ignore[arg-type]
