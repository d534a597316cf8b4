"""``devicekit run`` owns its command's whole process tree: daemons die with the job, the job
dies with ``run`` (even on SIGKILL), and the GPUs are free when nothing of it is left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devicekit.sharing.leases import read_leases
from tests.conftest import h100
from tests.security.conftest import src_env

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux prctl")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _pids(files: list[Path], timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(f.exists() and f.read_text().strip() for f in files):
            return [int(f.read_text()) for f in files]
        time.sleep(0.05)
    raise AssertionError(f"the job never wrote {files}")


def _gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_daemonizing_job_leaves_no_survivor_and_frees_gpus(simulate, tmp_path, run_cli):
    path = simulate([h100(), h100()])
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"])
    daemon = tmp_path / "daemon.pid"
    script = f'(setsid sh -c "echo \\$\\$ > {daemon}; exec sleep 60" &); sleep 0.3; exit 0'
    done = run_cli("run", "--gpus", "2", "--", "sh", "-c", script, env=env, timeout=120)
    pid = _pids([daemon])[0]
    try:
        assert done.returncode == 0, done.stderr
        assert not _alive(pid), "the daemon outlived devicekit run"
        assert read_leases() == []
    finally:
        _kill([pid])


def test_run_killed_with_sigkill_takes_its_job_along(simulate, tmp_path):
    path = simulate([h100()])
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"])
    files = [tmp_path / f"{n}.pid" for n in ("shell", "same-group", "own-session")]
    script = (f"echo $$ > {files[0]}; sleep 60 & echo $! > {files[1]}; "
              f"setsid sleep 61 & echo $! > {files[2]}; wait")
    run = subprocess.Popen([sys.executable, "-m", "devicekit", "run", "--", "sh", "-c", script],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        pids = _pids(files)
        assert len(read_leases()) == 1
        run.kill()
        run.wait(timeout=30)
        assert _gone(pids) == [], "processes of the job outlived a SIGKILLed devicekit run"
        deadline = time.monotonic() + 10
        while read_leases() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_leases() == []
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(timeout=30)
        _kill(pids)


def test_process_tree_spares_the_callers_own_children():
    from devicekit.jobs.process_tree import ProcessTree

    mine = subprocess.Popen(["sleep", "60"])
    try:
        with ProcessTree() as tree:
            started = subprocess.run(["sh", "-c", "setsid sleep 61 >/dev/null 2>&1 & echo $!"], capture_output=True,
                                     text=True, timeout=30, env={**os.environ, **tree.env()})
            orphan = int(started.stdout)  # its parent has exited: re-parented to us, not init
            assert _alive(orphan)
            stopped = tree.end(grace=2.0)
        assert orphan in stopped and not _alive(orphan)
        assert mine.poll() is None  # the caller's child before the tree: untouched
    finally:
        mine.kill()
        mine.wait(timeout=10)


HOLD_AND_EXIT = """
import os, sys, time
from devicekit.sharing.leases import Lease
lease = Lease.acquire(["GPU-a"], command="python train.py")
child = os.fork()
if child == 0:                       # inherits the locked lease file: the GPU stays held
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
os._exit(0)                          # the pid the lease names is gone
"""


def test_holder_named_is_the_live_process_not_the_dead_one(spawn):
    from devicekit.sharing.lease_records import read_leases as records

    proc = spawn(HOLD_AND_EXIT)
    survivor = int(proc.stdout.readline())
    proc.wait(timeout=30)
    try:
        deadline = time.monotonic() + 10
        while _alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (record,) = records()
        assert record.pid == survivor and _alive(record.pid)
        assert record.gpu_uuid == "GPU-a"
    finally:
        _kill([survivor])
