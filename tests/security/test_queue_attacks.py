"""The fair queue attacked by a second user (bob, uid 65534) sharing alice's lease directory.

Each attack is one the issue's two-user round found: a ticket whose count is JSON infinity, a
squatted ``queue.lock``, a ticket whose number is rewritten or copied from alice's, a time limit
rewritten to be backfilled, quotas dodged with ``--gpus all`` or ``dk.launch``'s default, an
ignored policy nobody hears about, a full disk, a lease directory deleted under a running job.
Tests that need a second user run as root and drop to ``nobody`` in a child; they skip elsewhere.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.errors import LeaseError, NoDeviceAvailable
from devicekit.selection import select_gpus
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.leases import Lease, read_leases
from devicekit.sharing.machine_status import collect_status
from devicekit.sharing.queue_state import look
from devicekit.sharing.queue_turn import blocked
from devicekit.sharing.tickets import Ticket, read_ticket_files
from tests.children import wait_line
from tests.conftest import h100
from tests.ranks import devicekit_command
from tests.security.conftest import needs_root, src_env

#: bob: a child that imports devicekit, becomes nobody, takes a ticket in the directory argv[1],
#: applies EDIT to it and keeps it alive (its lock held) for a minute
BOB_TICKET = """
import fcntl, json, os, sys, time
from pathlib import Path
from devicekit.sharing.tickets import Ticket
os.setgid(65534)
os.setuid(65534)
directory = Path(sys.argv[1])
ticket = Ticket.take(directory, {"count": 1, "candidates": [], "command": "python bob.py"})
path = ticket.path
text = path.read_text()
EDIT
print(path, flush=True)
time.sleep(60)
"""


def bob(spawn, directory: str, edit: str = "pass") -> Path:
    """Start bob's ticket with ``edit`` applied (Python acting on ``path`` and ``text``)."""
    child = spawn(BOB_TICKET.replace("EDIT", edit), directory)
    return Path(wait_line(child, timeout=30))


def alice_ticket(directory: str, count: int = 1) -> Ticket:
    return Ticket.take(Path(directory), {"count": count, "command": "python alice.py",
                                         "candidates": [g.uuid for g in dk.gpus()]})


@needs_root
def test_a_ticket_counting_json_infinity_is_ignored_and_crashes_no_reader(
        spawn, admin_lease_dir, simulate) -> None:
    simulate([h100(), h100()])
    bob(spawn, admin_lease_dir, "path.write_text(text.replace('\"count\": 1', '\"count\": 1e999'))")
    files = read_ticket_files(Path(admin_lease_dir))
    assert files.tickets == () and len(files.ignored) == 1
    assert files.ignored[0].user == "nobody" and "count" in files.ignored[0].why
    assert "queue not shown" not in " ".join(collect_status().warnings)
    with select_gpus(1) as sel:  # no wait: no crash, a GPU
        assert len(sel.gpus) == 1
    env = src_env(DEVICEKIT_SIMULATE=os.environ["DEVICEKIT_SIMULATE"], DEVICEKIT_LEASE_DIR=admin_lease_dir)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    for args in (["queue"], ["status"], ["run", "--gpus", "1", "--dry-run", "--", "true"],
                 ["run", "--gpus", "1", "--wait", "1", "--", "true"]):
        done = subprocess.run(devicekit_command(*args), env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, (args, done.stderr)
        assert "Traceback" not in done.stderr
    queue = subprocess.run(devicekit_command("queue"), env=env, capture_output=True, text=True,
                           timeout=60)
    assert "ignored" in queue.stdout and "nobody" in queue.stdout and "count" in queue.stdout


@needs_root
def test_a_queue_lock_held_by_another_user_stops_nobody_joining(spawn, admin_lease_dir) -> None:
    squat = spawn("""
import fcntl, os, sys, time
os.setgid(65534); os.setuid(65534)
fd = os.open(os.path.join(sys.argv[1], "queue.lock"), os.O_RDONLY | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(60)
""", admin_lease_dir)
    assert wait_line(squat) == "holding"
    start = time.monotonic()
    ticket = alice_ticket(admin_lease_dir)
    try:
        assert time.monotonic() - start < 2
        assert [t.ticket for t in read_ticket_files(Path(admin_lease_dir)).tickets] == [ticket.ticket]
    finally:
        ticket.close()


@needs_root
@pytest.mark.parametrize("edit, why", [
    # the attack: the JSON's number rewritten in place to go first
    ("data = json.loads(text); data['seq'] = -1; path.write_text(json.dumps(data))", "`$.seq`"),
    ("data = json.loads(text); data['seq'] = 3; path.write_text(json.dumps(data))", "JSON says"),
    # the file renamed to alice's number, count raised: a copy of her row
    ("data = json.loads(text); data['seq'] = 1; data['count'] = 1000\n"
     "new = path.with_name('q.000000001.' + path.name.split('.', 2)[2])\n"
     "new.write_text(json.dumps(data)); fd = os.open(new, os.O_RDONLY)\n"
     "fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); os.unlink(path); path = new",
     "a second ticket numbered 1"),
])
def test_a_rewritten_or_copied_number_never_jumps_the_queue_or_takes_a_row(
        spawn, admin_lease_dir, simulate, edit: str, why: str) -> None:
    simulate([h100()])
    first = alice_ticket(admin_lease_dir)  # alice joins first: ticket 1
    try:
        assert first.ticket == "1"
        bob(spawn, admin_lease_dir, edit)
        files = read_ticket_files(Path(admin_lease_dir))
        assert [(t.ticket, t.user, t.count) for t in files.tickets] == [("1", "root", 1)]
        assert len(files.ignored) == 1 and why in files.ignored[0].why
        view = look(Path(admin_lease_dir), dk.gpus(), [])
        assert [e.record.user for e in view.waiting] == ["root"]
        assert view.entry_at(first.path) is not None  # alice finds her own row, and only hers
        assert blocked(Path(admin_lease_dir), dk.gpus(), [], first) == {}  # she is granted
    finally:
        first.close()


@needs_root
def test_rewriting_a_ticket_moves_it_to_the_back(spawn, admin_lease_dir, simulate) -> None:
    """The place is the file's change time, which any write or rename moves to now: bob joined
    first, then rewrote his ticket (to ask for fewer GPUs); alice, who joined meanwhile, is
    now ahead of him. Nobody can move a ticket forward."""
    simulate([h100()])
    child = spawn(BOB_TICKET.replace("EDIT", "print(path, flush=True)\nsys.stdin.readline()\n"
                                     "path.write_text(text.replace('\"count\": 1', '\"count\": 1 '))"),
                  admin_lease_dir, stdin=subprocess.PIPE)
    wait_line(child, timeout=30)
    second = alice_ticket(admin_lease_dir)
    try:
        assert [t.user for t in read_ticket_files(Path(admin_lease_dir)).tickets] == ["nobody", "root"]
        assert child.stdin is not None
        child.stdin.write("go\n")
        child.stdin.flush()
        wait_line(child, timeout=30)  # rewritten
        files = read_ticket_files(Path(admin_lease_dir))
        assert [(t.user, t.ticket) for t in files.tickets] == [("root", "2"), ("nobody", "1")]
    finally:
        second.close()


def test_a_time_limit_rewritten_in_the_ticket_is_the_one_enforced(tmp_path, simulate,
                                                                 monkeypatch) -> None:
    """alice declared no limit, rewrote her waiting ticket to 1 s to be backfilled: the queue
    planned with 1 s, so 1 s is what her job is held to."""
    from devicekit.jobs import run as run_module
    from devicekit.jobs.allocation import Allocation
    from devicekit.selection.choose import _planned_limit
    from devicekit.selection.result import Selection

    ticket = Ticket.take(lease_dir(), {"count": 1, "candidates": [], "time_limit": None})
    try:
        data = json.loads(ticket.path.read_text())
        data["time_limit"] = 1.0
        ticket.path.write_text(json.dumps(data))  # in place: the lock stays held
        assert _planned_limit(None, ticket) == 1.0
        assert _planned_limit(600.0, ticket) == 1.0
        data["time_limit"] = 9999.0
        ticket.path.write_text(json.dumps(data))
        assert _planned_limit(600.0, ticket) == 600.0  # a longer one buys nothing
    finally:
        ticket.close()
    simulate([h100()])
    gpu = dk.gpus()[0]
    held = Lease.acquire([gpu.uuid])
    allocation = Allocation(1, 1, Selection([gpu], lease=held, time_limit=1.0), "leased GPU 0")
    monkeypatch.setattr(run_module, "allocate", lambda *a, **k: allocation)
    plan = run_module.plan_run(run_module.RunRequest(gpus=1, command=["true"]))
    try:
        assert plan.time_limit is not None and plan.time_limit.seconds == 1.0
        assert any("queue planned this job" in note for note in plan.notes)
    finally:
        allocation.release()


def _policy(text: str) -> None:
    path = lease_dir() / "policy.toml"
    path.write_text(text)
    path.chmod(0o644)


def test_a_quota_holds_for_all_and_for_launch_defaults(simulate) -> None:
    from devicekit.jobs.allocation import allocate, plan_processes

    simulate([h100(), h100(), h100()])
    _policy("max_gpus_per_user = 1\n")
    with select_gpus("all") as sel:
        assert len(sel.gpus) == 1
        assert sum("Quota" in line for line in sel.rejected) == 2
    for make in (lambda: allocate("all"), lambda: plan_processes("auto", None)):
        plan = make()
        try:
            assert plan.nprocs == 1 and len(plan.uuids) == 1
        finally:
            plan.release()
    with select_gpus(1), pytest.raises(NoDeviceAvailable, match="Quota"):
        select_gpus("all")  # one held: none left


@pytest.mark.parametrize("line", ["[users.alice]\npriority = nan\n",
                                  "fair_share_weight = inf\n", "max_gpus_per_user = -1\n"])
def test_an_ignored_policy_is_said_by_run_status_and_doctor(simulate, line: str) -> None:
    from devicekit.jobs.run import RunRequest, plan_run
    from devicekit.sharing.doctor_checks import check_queue_policy
    from devicekit.sharing.policy import load_policy

    simulate([h100()])
    _policy(line)
    assert "ignored" in load_policy(lease_dir()).note
    assert any(w.startswith("queue policy") for w in collect_status().warnings)
    assert check_queue_policy().status == "warn"
    plan = plan_run(RunRequest(gpus=1, command=["true"]))
    try:
        assert any(note.startswith("queue policy") for note in plan.notes)
    finally:
        plan.allocation.release()


def test_a_full_disk_is_one_line_not_a_traceback(simulate, monkeypatch) -> None:
    """Writing a lease or a ticket on a full disk (here the write is made to fail with ENOSPC)."""
    import errno

    from devicekit.sharing import lease_directory

    simulate([h100()])
    real_write = os.write

    def full(fd: int, data: bytes) -> int:
        if data.startswith(b"{"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(lease_directory.os, "write", full)
    with pytest.raises(LeaseError, match="cannot write a lease .*No space left on device"):
        select_gpus(1)
    with pytest.raises(LeaseError, match="No space left on device.*free space"):
        Ticket.take(lease_dir(), {"count": 1, "candidates": []})
    assert [p.name for p in lease_dir().iterdir() if p.name.startswith(".tmp-")] == []


@needs_root
def test_a_really_full_lease_directory_is_one_line_from_the_cli(simulate, tmp_path) -> None:
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k,mode=1777", "tmpfs", str(mount)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        simulate([h100()])
        env = src_env(DEVICEKIT_SIMULATE=os.environ["DEVICEKIT_SIMULATE"], DEVICEKIT_LEASE_DIR=str(mount))
        env.pop("CUDA_VISIBLE_DEVICES", None)
        holder = subprocess.Popen(devicekit_command("run", "--gpus", "1", "--", "sleep", "20"),
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not any(mount.glob("*.lease")):
                time.sleep(0.1)
            fill = os.open(mount / "fill", os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # now the disk is full
                while os.write(fill, b"\0" * 4096) > 0:
                    pass
            except OSError:
                pass
            finally:
                os.close(fill)
            for args in (["run", "--gpus", "1", "--", "true"],
                         ["run", "--gpus", "1", "--wait", "2", "--", "true"]):
                got = subprocess.run(devicekit_command(*args), env=env, capture_output=True,
                                     text=True, timeout=60)
                assert got.returncode != 0 and "Traceback" not in got.stderr, got.stderr
                assert got.stderr.strip().count("\n") <= 1, got.stderr
        finally:
            holder.kill()
            holder.communicate(timeout=30)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, timeout=30)


def test_a_removed_lease_directory_is_no_invented_cancellation(simulate) -> None:
    simulate([h100()])
    directory = lease_dir()
    ticket = Ticket.take(directory, {"count": 1, "candidates": []})
    try:
        shutil.rmtree(directory)
        with pytest.raises(NoDeviceAvailable) as info:
            blocked(directory, dk.gpus(), [], ticket)
        assert "was removed" in str(info.value) and "nobody cancelled" in str(info.value)
        assert "queue cancel" not in str(info.value)
    finally:
        ticket.close()


def test_a_running_jobs_leases_come_back_with_the_directory(simulate) -> None:
    simulate([h100(), h100()])
    first = dk.gpus()[0]
    lease = Lease.acquire([first.uuid], command="python alice.py")
    try:
        assert lease.restore() == []  # nothing missing: nothing done
        shutil.rmtree(lease_dir())
        notes = lease.restore()
        assert len(notes) == 1 and "re-created" in notes[0]
        assert [r.gpu_uuid for r in read_leases()] == [first.uuid]
        with pytest.raises(NoDeviceAvailable):
            select_gpus(2)  # bob's --gpus 2 cannot take alice's GPU
    finally:
        lease.release()


def test_devicekit_run_keeps_its_leases_when_the_directory_is_removed(simulate, tmp_path) -> None:
    simulate([h100()])
    env = src_env(DEVICEKIT_SIMULATE=os.environ["DEVICEKIT_SIMULATE"],
                  DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    job = subprocess.Popen(devicekit_command("run", "--gpus", "1", "--", sys.executable, "-c",
                                             "import time; time.sleep(8)"),
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not read_leases():
            time.sleep(0.1)
        assert read_leases(), "the job never leased its GPU"
        shutil.rmtree(lease_dir())
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (os.path.isdir(os.environ["DEVICEKIT_LEASE_DIR"])
                                                   and read_leases()):
            time.sleep(0.1)
        assert [r.pid for r in read_leases()] == [job.pid]
        with pytest.raises(NoDeviceAvailable):
            select_gpus(1)
    finally:
        job.kill()
        _, err = job.communicate(timeout=30)
    assert "re-created" in err
