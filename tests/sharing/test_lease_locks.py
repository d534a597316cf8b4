"""Per-device lock files: nobody can stop everyone's leasing; old versions are honoured."""

import fcntl
import json
import os
import threading
import time
from itertools import pairwise

import pytest

import devicekit as dk
from devicekit.errors import LeaseError
from devicekit.selection.choose import select_gpus
from devicekit.sharing import device_locks
from devicekit.sharing.lease_records import LeaseRecord
from devicekit.sharing.leases import Lease, lease_dir, read_leases
from devicekit.sharing.machine_status import collect_status
from tests.children import wait_line
from tests.conftest import h100

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")

AS_NOBODY = """
import fcntl, json, os, sys, time  # imported first: nobody may not read the interpreter's files
os.setgid(65534)
os.setuid(65534)  # from here on this process is another, unprivileged user
"""


HOLD_GPU_LOCK = AS_NOBODY + """
path = os.path.join(sys.argv[1], sys.argv[2] + ".hold")
fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(60)
"""


@needs_root
def test_an_unusable_lock_file_blocks_only_its_gpu_and_names_its_owner(simulate, spawn,
                                                                       admin_lease_dir):
    simulate([h100(), h100()])
    first, second = dk.gpus()
    proc = spawn(AS_NOBODY + """
os.mkdir(os.path.join(sys.argv[1], sys.argv[2] + ".hold"))
print("made", flush=True)
""", admin_lease_dir, first.uuid)
    assert wait_line(proc) == "made"
    with select_gpus(1, order="index") as sel:
        assert sel.gpus[0].uuid == second.uuid
        assert "unusable" in sel.rejected[0] and "belongs to nobody" in sel.rejected[0]
    with pytest.raises(LeaseError, match="cannot be leased, unusable: .* is not a regular file"):
        Lease.acquire([first.uuid])


def _old_style_lease(uuid: str, pid: int = 1) -> int:
    """A lease as devicekit wrote them before per-device locks: a locked file, no .hold lock."""
    record = LeaseRecord(uuid, pid, "x", "h", "python old.py", time.time(), None, False)
    fd = os.open(lease_dir() / f"{uuid}.{pid}.0ld.lease", os.O_WRONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, record.to_json().encode())
    return fd


def test_an_old_versions_lease_is_never_granted_again(simulate, monkeypatch):
    """Its lease file is read again after the device is locked, so even a look that missed
    it (taken a moment before) cannot hand the GPU out twice."""
    from devicekit.selection import look as selection

    simulate([h100(), h100()])
    first, second = dk.gpus()
    fd = _old_style_lease(first.uuid)
    try:
        monkeypatch.setattr(selection, "read_leases", lambda *_, **__: [])  # a stale look
        with select_gpus(1, order="index") as sel:
            assert sel.gpus[0].uuid == second.uuid
            assert "leased by" in sel.rejected[0] and "python old.py" in sel.rejected[0]
        with pytest.raises(LeaseError, match="is already leased by"):
            Lease.acquire([first.uuid])
    finally:
        os.close(fd)


def test_an_old_version_sees_our_leases():
    """devicekit before per-device locks reads *.lease files whose flock is held: still there."""
    def old_read(directory):
        live = []
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".lease"):
                continue
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(json.loads(os.read(fd, 65536))["gpu_uuid"])
            finally:
                os.close(fd)
        return live

    with Lease.acquire(["GPU-new"]), Lease.acquire(["GPU-shared"], share=True, memory=1):
        assert sorted(old_read(lease_dir())) == ["GPU-new", "GPU-shared"]
    assert old_read(lease_dir()) == []


def test_an_old_version_choosing_under_its_lock_is_waited_for(simulate, spawn, monkeypatch):
    """While an old devicekit holds .lock it may be about to write a lease: we wait (a moment)."""
    simulate([h100(), h100()])
    first, second = dk.gpus()
    monkeypatch.setattr(device_locks, "LEGACY_PATIENCE", 30.0)  # no timing in the assertion
    go = lease_dir() / "go"
    proc = spawn("""
import fcntl, os, sys, time
from devicekit.sharing.lease_records import LeaseRecord
directory, uuid, go = sys.argv[1:]
fd = os.open(os.path.join(directory, ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)          # the old version chooses...
print("locked", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
lease = os.open(os.path.join(directory, uuid + ".1.0ld.lease"), os.O_WRONLY | os.O_CREAT, 0o644)
fcntl.flock(lease, fcntl.LOCK_EX)       # ...and writes its lease before letting go
os.write(lease, LeaseRecord(uuid, os.getpid(), "x", "h", "old", time.time(), None, False).to_json().encode())
fcntl.flock(fd, fcntl.LOCK_UN)
print("leased", flush=True)
time.sleep(60)
""", str(lease_dir()), first.uuid, str(go))
    assert wait_line(proc) == "locked"
    got: list[object] = []
    chooser = threading.Thread(target=lambda: got.append(select_gpus(1, order="index")))
    chooser.start()
    time.sleep(0.2)
    assert got == [] and chooser.is_alive()  # waiting for the old version's choice
    go.touch()
    chooser.join(timeout=30)
    (sel,) = got
    assert sel.gpus[0].uuid == second.uuid and wait_line(proc) == "leased"
    sel.release()


def test_a_multi_gpu_request_that_cannot_get_all_leaks_nothing(simulate):
    simulate([h100(), h100(), h100()])
    gpus = dk.gpus()
    with Lease.acquire([gpus[2].uuid]):
        with pytest.raises(LeaseError, match=f"GPU {gpus[2].uuid} is already leased"):
            Lease.acquire([g.uuid for g in gpus])
        assert [r.gpu_uuid for r in read_leases()] == [gpus[2].uuid]  # nothing half-taken
        lease, refused = Lease.take([g.uuid for g in gpus], count=3)
        assert lease is None and list(refused) == [gpus[2].uuid]
        assert [r.gpu_uuid for r in read_leases()] == [gpus[2].uuid]


def test_share_leases_coexist_but_exclude_an_exclusive_one():
    with Lease.acquire(["GPU-s"], share=True, memory=1), Lease.acquire(["GPU-s"], share=True,
                                                                       memory=2):
        with pytest.raises(LeaseError, match="already shared by"):
            Lease.acquire(["GPU-s"])
    with Lease.acquire(["GPU-s"]):
        with pytest.raises(LeaseError, match="already leased by"):
            Lease.acquire(["GPU-s"], share=True, memory=1)


PAIR_RACER = """
import json, sys, time
from pathlib import Path
from devicekit.selection.choose import select_gpus

go = Path(sys.argv[1])
print("ready", flush=True)
limit = time.monotonic() + 30
while not go.exists() and time.monotonic() < limit:
    time.sleep(0.001)
sel = select_gpus(2, wait=25, poll_interval=0.02)
start = time.monotonic()
time.sleep(0.05)
print(json.dumps({"gpus": [g.uuid for g in sel.gpus], "start": start, "end": time.monotonic()}),
      flush=True)
sel.release()
"""


@pytest.mark.slow
def test_twelve_processes_taking_two_gpus_each_never_overlap(simulate, spawn, tmp_path):
    """Multi-GPU requests lock one device at a time and give back partial grants: no
    deadlock, no GPU held twice, everyone served."""
    simulate([h100() for _ in range(8)])
    go = tmp_path / "go"
    racers = [spawn(PAIR_RACER, str(go)) for _ in range(12)]
    for proc in racers:
        assert wait_line(proc, timeout=30) == "ready"
    go.touch()
    results = [json.loads(wait_line(proc, timeout=40)) for proc in racers]
    spans: dict[str, list[tuple[float, float]]] = {}
    for r in results:
        assert len(set(r["gpus"])) == 2
        for uuid in r["gpus"]:
            spans.setdefault(uuid, []).append((r["start"], r["end"]))
    for held in spans.values():
        held.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(held))
    for proc in racers:
        assert proc.wait(timeout=30) == 0
    assert read_leases() == []


def test_a_gpu_lock_held_by_hand_is_shown_and_skipped(simulate, spawn):
    """The same check without root: a bare lock holder is named by pid and command."""
    from rich.console import Console

    from devicekit.sharing.status_table import render_status

    simulate([h100(), h100()])
    first, second = dk.gpus()
    proc = spawn(HOLD_GPU_LOCK.replace(AS_NOBODY, "import fcntl, os, sys, time\n"),
                 str(lease_dir()), first.uuid)
    assert wait_line(proc) == "holding"
    (record,) = read_leases()
    assert (record.gpu_uuid, record.pid, record.kind, record.share) == (
        first.uuid, proc.pid, "lock", False)
    assert "without a lease" in record.describe()
    with select_gpus(1, order="index") as sel:
        assert sel.gpus[0].uuid == second.uuid
    out = __import__("io").StringIO()
    Console(file=out, width=160).print(render_status(collect_status()))
    assert "(lock only) python -c" in out.getvalue()
