import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from devicekit.errors import LeaseError
from devicekit.sharing.leases import Lease, LeaseRecord, directory_lock, lease_dir, read_leases
from tests.children import child_env, wait_line

HOLD = """
import time
from devicekit.sharing.leases import Lease
lease = Lease.acquire([{uuid!r}], memory=2**30, command="python train.py")
print("ready", flush=True)
time.sleep(60)
"""


def test_acquire_read_release():
    lease = Lease.acquire(["GPU-aaa", "GPU-bbb"], memory=5 * 2**30, command="python train.py")
    live = read_leases()
    assert [r.gpu_uuid for r in live] == ["GPU-aaa", "GPU-bbb"]
    record = live[0]
    assert record.pid == os.getpid() and record.command == "python train.py"
    assert record.memory == 5 * 2**30 and record.share is False and record.host
    assert "leased by" in record.describe() and "python train.py" in record.describe()
    # per GPU: its lease file and its lock file (holding the lock is holding the GPU)
    assert len(lease.fds) == 4 and not any(os.get_inheritable(fd) for fd in lease.fds)
    lease.release()
    lease.release()  # idempotent
    assert read_leases() == []
    # only the lock files stay (deleting one could let two holders in); no lease file
    assert sorted(n for n in os.listdir(lease_dir()) if not n.startswith(".")) == [
        "GPU-aaa.hold", "GPU-bbb.hold"]


def test_context_manager_and_json_content():
    with Lease.acquire(["GPU-ccc"], share=True, memory=123) as lease:
        (name,) = [n for n in os.listdir(lease_dir()) if n.endswith(".lease")]
        data = json.loads((lease_dir() / name).read_text())
        assert {"gpu_uuid", "pid", "user", "host", "command", "since", "memory", "share"} <= set(data)
        assert data["share"] is True and data["memory"] == 123
        assert stat.S_IMODE((lease_dir() / name).stat().st_mode) == 0o644
    assert lease.released and read_leases() == []


def test_exclusive_conflicts_and_share_coexists():
    with Lease.acquire(["GPU-x"]):
        with pytest.raises(LeaseError, match="GPU-x is already leased by"):
            Lease.acquire(["GPU-x"], share=True)
    with Lease.acquire(["GPU-y"], share=True, memory=1), Lease.acquire(["GPU-y"], share=True, memory=2):
        assert len(read_leases()) == 2
        with pytest.raises(LeaseError, match="already shared by"):
            Lease.acquire(["GPU-y"])


def test_sigkilled_holder_frees_gpu_at_once(spawn):
    proc = spawn(HOLD.format(uuid="GPU-kill"))
    assert wait_line(proc) == "ready"
    (record,) = read_leases()
    assert record.pid == proc.pid and record.command == "python train.py"
    with pytest.raises(LeaseError):
        Lease.acquire(["GPU-kill"])
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert read_leases() == []  # free at once: no timeout, no pid polling
    with directory_lock() as path:
        read_leases(path, cleanup=True)
    assert [n for n in os.listdir(lease_dir()) if n.endswith(".lease")] == []  # stale file cleaned
    with Lease.acquire(["GPU-kill"]):
        pass


def test_lease_lives_while_a_child_holds_passed_fds(spawn):
    code = """
import subprocess, sys, time
from devicekit.sharing.leases import Lease
lease = Lease.acquire(["GPU-run"])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=lease.fds)
print(child.pid, flush=True)
time.sleep(60)
"""
    proc = spawn(code)
    grandchild = int(wait_line(proc))
    try:
        proc.send_signal(signal.SIGKILL)  # the holder dies; the child it handed the fds to lives
        proc.wait(timeout=10)
        assert [r.gpu_uuid for r in read_leases()] == ["GPU-run"]
    finally:
        os.kill(grandchild, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while read_leases() and time.monotonic() < deadline:
        time.sleep(0.02)  # the grandchild is reaped by init; its fds close when it dies
    assert read_leases() == []


def test_user_comes_from_file_owner_not_content():
    import fcntl

    path = lease_dir() / "GPU-f.1.abc.lease"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        forged = LeaseRecord("GPU-f", 1, "somebody-else", "h", "x", time.time(), None, False)
        os.write(fd, forged.to_json().encode())
        (record,) = read_leases()
        assert record.user != "somebody-else"
    finally:
        os.close(fd)


def test_stale_and_garbage_files_are_ignored():
    directory = lease_dir()
    (directory / "GPU-s.99.dead.lease").write_text(json.dumps({"gpu_uuid": "GPU-s", "pid": 99}))
    (directory / "notes.txt").write_text("hello")
    os.symlink("/etc/passwd", directory / "GPU-l.1.x.lease")
    assert read_leases() == []
    with directory_lock() as path:
        assert read_leases(path, cleanup=True) == []
    assert not (directory / "GPU-s.99.dead.lease").exists()


def test_lease_dir_created_sticky_world_writable(tmp_path, monkeypatch):
    target = tmp_path / "leases"
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(target))
    old = os.umask(0o077)
    try:
        assert lease_dir() == target
    finally:
        os.umask(old)
    assert stat.S_IMODE(target.stat().st_mode) == 0o1777


def test_leases_work_across_processes_with_env_dir(tmp_path):
    env = child_env(DEVICEKIT_LEASE_DIR=str(tmp_path / "shared"))
    code = "from devicekit.sharing.leases import read_leases; print(len(read_leases()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout
    assert out.strip() == "0"
    assert stat.S_IMODE((tmp_path / "shared").stat().st_mode) == 0o1777


def test_lease_file_is_private_until_locked(monkeypatch):
    """Another user who opened a fresh lease file before its writer locked it could hold a
    shared flock and block the writer's LOCK_EX forever, with the directory lock held."""
    import fcntl

    modes: list[int] = []
    real_flock = fcntl.flock

    def spy(fd, op):
        if op == fcntl.LOCK_EX and stat.S_ISREG(os.fstat(fd).st_mode) \
                and os.fstat(fd).st_size == 0 and os.path.basename(os.readlink(
                    f"/proc/self/fd/{fd}")).startswith(".tmp-"):
            modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", spy)  # where lease_directory.write_locked locks
    with Lease.acquire(["GPU-private"]) as lease:
        assert modes and all(mode & 0o077 == 0 for mode in modes), [oct(m) for m in modes]
        final = os.stat(lease._paths[0])
        assert stat.S_IMODE(final.st_mode) == 0o644  # readable by all once locked


def test_a_lease_in_a_slurm_job_carries_the_slurm_job_id(monkeypatch) -> None:
    from devicekit.sharing.lease_records import current_job
    from devicekit.sharing.leases import default_job

    for name in ("DEVICEKIT_JOB_ID", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID"):
        monkeypatch.delenv(name, raising=False)
    assert default_job() == current_job()                 # no job: devicekit's own token
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert default_job() == "4242"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4240")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    assert default_job() == "4240_2"                      # as squeue shows an array task
    monkeypatch.setenv("DEVICEKIT_JOB_ID", "4240_2")      # what devicekit run passes its command
    assert default_job() == "4240_2"
    monkeypatch.setenv("DEVICEKIT_JOB_ID", "nightly")     # devicekit run --name nightly
    assert default_job() == "nightly"
    monkeypatch.setenv("SLURM_JOB_ID", "$(rm -rf ~)")     # not a job id: not taken
    for name in ("SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "DEVICEKIT_JOB_ID"):
        monkeypatch.delenv(name)
    assert default_job() == current_job()
