"""Files other users can write are read bounded, never blocking, never unpickled: simulate
files, the bench cache, the batch-size cache. Each bad one is a one-line error, fast."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.errors import SimulationFileError
from devicekit.hardware.simulated import load_simulation
from tests.conftest import h100
from tests.security.conftest import src_env

GOOD = json.dumps({"gpus": [h100(), h100(used="3GiB")]})


def _bad_file(kind: str, tmp_path: Path) -> Path:
    if kind == "dev-zero":
        return Path("/dev/zero")
    path = tmp_path / "gpus.json"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "nested":
        path.write_text("[" * 10000 + "]" * 10000)
    elif kind == "huge":
        with open(path, "wb") as f:
            f.truncate(64 * 1024 * 1024)  # sparse: costs no disk
    elif kind == "directory":
        path.mkdir()
    return path


@pytest.mark.parametrize("kind,problem", [
    ("dev-zero", "not a regular file"), ("fifo", "FIFO"), ("nested", "nested more than"),
    ("huge", "bytes, more than"), ("directory", "directory")])
def test_bad_simulation_file_is_one_line_and_fast(kind, problem, tmp_path, run_cli):
    path = _bad_file(kind, tmp_path)
    with pytest.raises(SimulationFileError, match=problem) as info:
        load_simulation(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    if kind in ("fifo", "nested"):  # and from the command line: one line, exit 1
        done = run_cli("--simulate", str(path), "status", env=src_env(), timeout=60)
        assert done.returncode == 1 and done.stdout == ""
        assert len(done.stderr.strip().splitlines()) == 1 and problem in done.stderr


def test_absurd_memory_size_refused(tmp_path):
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [h100(memory_total="1e99GiB")]}))
    with pytest.raises(SimulationFileError, match=r"gpus\[0\]\.memory_total.*PiB"):
        load_simulation(path)


def test_file_rewritten_in_place_is_reread_not_fatal(tmp_path):
    """A writer truncates and rewrites the file (not atomically) while a --wait job reads it."""
    path = tmp_path / "gpus.json"
    path.write_text(GOOD)
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            with open(path, "w") as f:  # truncated here: a reader may see nothing, or half
                f.write(GOOD[: len(GOOD) // 2])
                f.flush()
                time.sleep(0.003)
                f.write(GOOD[len(GOOD) // 2:])
            time.sleep(0.001)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    try:
        for _ in range(150):
            assert len(load_simulation(path)) == 2
    finally:
        stop.set()
        writer.join(timeout=10)


def test_persistently_broken_old_file_fails_at_once(tmp_path):
    path = tmp_path / "gpus.json"
    path.write_text("{broken")
    old = time.time() - 60
    os.utime(path, (old, old))
    start = time.monotonic()
    with pytest.raises(SimulationFileError, match="not valid JSON"):
        load_simulation(path)
    assert time.monotonic() - start < 1.5  # no settling wait for a file nobody is writing


@pytest.mark.parametrize("kind", ["fifo", "nested", "huge"])
def test_bench_cache_bad_file_reads_as_no_result(kind, tmp_path, monkeypatch):
    from devicekit.hardware import bench_cache

    monkeypatch.setenv(bench_cache.CACHE_ENV, str(tmp_path))
    target = bench_cache._file("GPU-x")
    built = _bad_file(kind, tmp_path)
    built.rename(target)
    assert bench_cache.read_result("GPU-x") is None


@pytest.mark.parametrize("kind", ["fifo", "nested"])
def test_batch_size_cache_bad_file_is_one_line(kind, tmp_path):
    from devicekit.memory.batch_size_cache import read_cached

    built = _bad_file(kind, tmp_path)
    with pytest.raises(dk.InvalidValueError, match="batch-size cache") as info:
        read_cached("k", cache=built)
    assert "\n" not in str(info.value)
