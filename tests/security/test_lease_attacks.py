"""The lease attacks devicekit already withstood, moved here from tests/hardware so that every
attack lives in one place: symlinked and loose lease directories, a foreign owner, deleting or
hijacking another user's leases, a FIFO swapped for a lease, other users holding locks."""

import json
import os
import shutil
import tempfile
import time

import pytest

import devicekit as dk
from devicekit.errors import LeaseError
from devicekit.hardware.document_fields import BadDocument
from devicekit.selection.choose import select_gpus
from devicekit.sharing.leases import Lease, directory_lock, lease_dir, read_leases
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


def test_lease_dir_refuses_symlink(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path / "link"))
    with pytest.raises(LeaseError, match=r"link'.* is a symlink"):
        lease_dir()


def test_lease_dir_refuses_file_and_unsticky(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path / "file"))
    with pytest.raises(LeaseError, match="not a directory"):
        lease_dir()
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(loose))
    with pytest.raises(LeaseError, match=r"chmod \+t"):
        lease_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown a directory to another user")
def test_lease_dir_refuses_other_users_directory(tmp_path, monkeypatch):
    other = tmp_path / "other"
    other.mkdir(mode=0o1777)
    os.chown(other, 54321, 54321)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(other))
    with pytest.raises(LeaseError, match="owned by 54321"):
        lease_dir()


def test_symlinked_lock_file_refused():
    os.symlink("/etc/hostname", lease_dir() / ".lock")
    with pytest.raises(LeaseError, match=r"\.lock"):
        with directory_lock():
            pass


OTHER_USER = """
import json, os, sys, time
from devicekit.errors import LeaseError
from devicekit.hardware.document_fields import BadDocument
from devicekit.sharing.leases import Lease, lease_dir, read_leases
os.setgid(65534)
os.setuid(65534)  # from here on this process is another, unprivileged user
out = {"seen": [(r.gpu_uuid, r.user) for r in read_leases()]}
theirs = [n for n in os.listdir(lease_dir()) if n.endswith(".lease")][0]
try:
    os.unlink(lease_dir() / theirs)
    out["unlink"] = "deleted"
except PermissionError:
    out["unlink"] = "refused"
try:
    Lease.acquire(["GPU-root"])
    out["hijack"] = "taken"
except LeaseError:
    out["hijack"] = "refused"
mine = Lease.acquire(["GPU-other"])
print(json.dumps(out), flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
def test_two_users_share_a_root_owned_directory(spawn, monkeypatch):
    import pwd

    directory = tempfile.mkdtemp(prefix="devicekit-leases-", dir="/tmp")
    try:
        os.chmod(directory, 0o1777)
        monkeypatch.setenv("DEVICEKIT_LEASE_DIR", directory)
        with Lease.acquire(["GPU-root"]):
            proc = spawn(OTHER_USER)
            result = json.loads(wait_line(proc, timeout=30))
            me = pwd.getpwuid(os.geteuid()).pw_name
            assert result == {"seen": [["GPU-root", me]], "unlink": "refused", "hijack": "refused"}
            other = pwd.getpwuid(65534).pw_name if _has_uid(65534) else "65534"
            assert [(r.gpu_uuid, r.user) for r in read_leases()] == [
                ("GPU-root", me), ("GPU-other", other)]
            proc.kill()
            proc.wait(timeout=10)
            assert [r.gpu_uuid for r in read_leases()] == ["GPU-root"]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _has_uid(uid: int) -> bool:
    import pwd

    try:
        pwd.getpwuid(uid)
        return True
    except KeyError:
        return False


def test_a_lease_swapped_for_a_fifo_does_not_hang_readers(tmp_path):
    """The owner of a live lease can rename a FIFO over it between a reader's probe and its
    read; opening that FIFO for reading would block select_gpus under the directory lock."""
    import threading

    from devicekit.sharing import lease_records as leases_module

    path = lease_dir()
    fifo = path / "GPU-x.1.abc.lease"
    os.mkfifo(fifo)
    info = os.stat(fifo)
    result: list[object] = []

    def read() -> None:
        try:
            result.append(leases_module._read_record(fifo, info))
        except BadDocument as exc:  # ignored, with the reason
            result.append(str(exc))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=2)
    if reader.is_alive():  # unblock the reader so the test process can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=2)
        pytest.fail("reading a FIFO lease blocked")
    assert result == ["not a regular file"]


@needs_root
def test_another_user_holding_the_old_global_lock_does_not_stop_leasing(simulate, spawn, admin_lease_dir):
    """Before per-device locks, one user's flock on .lock made every select fail after 30 s."""
    simulate([h100(), h100()])
    proc = spawn(AS_NOBODY + """
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(60)
""", admin_lease_dir)
    assert wait_line(proc) == "holding"
    start = time.monotonic()
    with select_gpus(2) as sel:
        assert len(sel.gpus) == 2
    with Lease.acquire([dk.gpus()[0].uuid]):
        pass
    assert time.monotonic() - start < 10  # two reservations, each waiting at most a moment


@needs_root
def test_another_user_holding_a_gpu_lock_makes_that_gpu_busy_and_is_named(simulate, spawn,
                                                                         admin_lease_dir):
    simulate([h100(), h100()])
    first, second = dk.gpus()
    proc = spawn(HOLD_GPU_LOCK, admin_lease_dir, first.uuid)
    assert wait_line(proc) == "holding"
    with select_gpus(1, order="index") as sel:
        assert sel.gpus[0].uuid == second.uuid  # the other GPU is still leasable
        (line,) = sel.rejected
        assert line.startswith("GPU 0: held by nobody (pid ") and "through its lock file" in line
    with pytest.raises(LeaseError, match=f"GPU {first.uuid} is already held by nobody"):
        Lease.acquire([first.uuid])
    (record,) = read_leases()
    assert (record.gpu_uuid, record.user, record.pid, record.kind) == (
        first.uuid, "nobody", proc.pid, "lock")
    doc = collect_status().to_dict()  # status attributes it: user, pid, command
    (shown,) = doc["gpus"][0]["leases"]
    assert shown["user"] == "nobody" and shown["pid"] == proc.pid and shown["kind"] == "lock"
    assert "python" in shown["command"]
    proc.kill()
    proc.wait(timeout=10)
    with Lease.acquire([first.uuid]):  # free at once when its holder dies
        pass


@needs_root
def test_another_user_cannot_delete_or_take_our_lock_files(simulate, spawn, admin_lease_dir):
    simulate([h100()])
    (gpu,) = dk.gpus()
    with Lease.acquire([gpu.uuid]):
        proc = spawn(AS_NOBODY + """
path = os.path.join(sys.argv[1], sys.argv[2] + ".hold")
out = {}
try:
    os.unlink(path)
    out["unlink"] = "deleted"
except PermissionError:
    out["unlink"] = "refused"
fd = os.open(path, os.O_RDONLY)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    out["lock"] = "taken"
except BlockingIOError:
    out["lock"] = "refused"
print(json.dumps(out), flush=True)
""", admin_lease_dir, gpu.uuid)
        assert json.loads(wait_line(proc)) == {"unlink": "refused", "lock": "refused"}


def test_a_symlinked_old_lock_does_not_stop_leasing(simulate):
    simulate([h100()])
    os.symlink("/etc/hostname", lease_dir() / ".lock")
    with select_gpus(1) as sel:
        assert len(sel.gpus) == 1
