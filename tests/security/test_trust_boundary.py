"""Issue 44's local attacks: a second user (bob, uid 65534) writes lease files and tickets into
alice's lease directory to crash, freeze or flood every reader, or to fire the lab's alerts.

Each test is one item of the issue: lease fields of ``1e999`` (1), ``since`` of NaN or ``1e300``
(2), the same file freezing ``devicekit serve`` (3), 300 leases with 60 KB UUIDs flooding
``/metrics`` and ``/api/status`` (4), terminal escapes in a lease's job id (5), a ticket whose
``since`` is ``1e300`` (6) or ``0`` (7), and the lease metrics' job label that Prometheus
rewrites (12). Bob's files stay live (locked) while alice reads, as a real attacker's would.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import devicekit as dk
from devicekit.selection import select_gpus
from devicekit.serve.sampler import Sampler
from devicekit.sharing.machine_status import collect_status
from devicekit.sharing.status_ceiling import MAX_LEASES_LISTED
from devicekit.sharing.tickets import Ticket, read_ticket_files
from tests.children import wait_line
from tests.conftest import h100
from tests.ranks import devicekit_command
from tests.security.conftest import needs_root, src_env

#: bob: reads the (name, text) list of the JSON file argv[2], becomes nobody, writes each into
#: the directory argv[1] as a file he keeps locked (a live lease or ticket), then waits a minute
BOB_FILES = """
import fcntl, json, os, sys, time
with open(sys.argv[2]) as handle:
    files = json.load(handle)
os.setgid(65534)
os.setuid(65534)
fds = []
for name, text in files:
    fd = os.open(os.path.join(sys.argv[1], name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, text.encode())
    fds.append(fd)
print("ready", flush=True)
time.sleep(60)
"""


def bob_writes(spawn, directory: str, files: list[tuple[str, str]]) -> None:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(files, handle)
    try:
        child = spawn(BOB_FILES, directory, handle.name)
        assert wait_line(child, timeout=30) == "ready"
    finally:
        os.unlink(handle.name)


def lease_text(uuid: str, pid: int = 4242, **fields: object) -> str:
    record = {"gpu_uuid": uuid, "pid": pid, "host": "lab1", "command": "python bob.py",
              "since": time.time(), "memory": None, "share": False, **fields}
    return json.dumps(record)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = src_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run(devicekit_command(*args), env=env, capture_output=True, text=True,
                          timeout=60)


def assert_every_reader_lives(bad_words: list[str]) -> None:
    """status, status --json, select and run answer (no traceback); each bad file is shown
    ignored, owned by nobody, with a reason naming its bad field (``bad_words``, by file name)."""
    report = collect_status()
    assert sorted((i.user, i.name.split(".")[-2]) for i in report.ignored_leases) == sorted(
        ("nobody", str(n)) for n in range(len(bad_words)))
    for ignored in report.ignored_leases:
        word = bad_words[int(ignored.name.split(".")[-2])]
        assert word in ignored.why, (ignored, word)
    assert any("ignored" in w and "nobody" in w for w in report.warnings)
    with select_gpus(1) as sel:
        assert len(sel.gpus) == 1
    for args in (["status"], ["status", "--json"], ["select"],
                 ["run", "--gpus", "1", "--dry-run", "--", "true"]):
        done = cli(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert "Traceback" not in done.stderr and "OverflowError" not in done.stderr
    doc = json.loads(cli("status", "--json").stdout)
    assert {i["user"] for i in doc["ignored_leases"]} == {"nobody"}
    assert len(doc["ignored_leases"]) == len(bad_words)


def bad_leases(uuid: str, edits: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """One live lease file per (field, raw JSON token): ``<uuid>.<pid>.<n>.lease``."""
    files = []
    for n, (field, token) in enumerate(edits):
        body = json.dumps({**json.loads(lease_text(uuid, 4242 + n)), field: "@@"})
        files.append((f"{uuid}.{4242 + n}.{n}.lease", body.replace('"@@"', token)))
    return files


@needs_root
def test_item1_leases_of_huge_numbers_stop_nobody(spawn, admin_lease_dir, simulate) -> None:
    simulate([h100(), h100()])
    edits = [("memory", "1e999"), ("pid", "1e999"), ("pid", str(2**61)), ("memory", "-1"),
             ("memory", str(2**64))]
    bob_writes(spawn, admin_lease_dir, bad_leases(dk.gpus()[0].uuid, edits))
    assert_every_reader_lives([field for field, _ in edits])


@needs_root
def test_doctor_warns_of_ignored_lease_files_naming_their_owner(spawn, admin_lease_dir,
                                                                simulate) -> None:
    # doctor said "PASS lease_dir ..., 0 live lease(s)" while status warned of nobody's files
    from devicekit.sharing.doctor_checks import check_lease_dir

    simulate([h100()])
    bob_writes(spawn, admin_lease_dir, bad_leases(dk.gpus()[0].uuid, [("memory", "1e999")]))
    check = check_lease_dir()
    assert check.status == "warn", check
    assert "0 live lease(s); 1 live lease file(s) of nobody ignored" in check.message
    assert "at `$.memory`" in check.message and "ignored_leases" in check.message


@needs_root
def test_item2_leases_since_nan_or_1e300_stop_nobody(spawn, admin_lease_dir, simulate) -> None:
    simulate([h100(), h100()])
    edits = [("since", "NaN"), ("since", "1e300"), ("since", "1e18"), ("since", "-1"),
             ("since", "Infinity")]
    bob_writes(spawn, admin_lease_dir, bad_leases(dk.gpus()[0].uuid, edits))
    assert_every_reader_lives(["malformed", "since", "since", "since", "malformed"])


@needs_root
def test_item3_serve_keeps_sampling_through_a_bad_lease(spawn, admin_lease_dir, simulate) -> None:
    simulate([h100()])
    uuid = dk.gpus()[0].uuid
    bob_writes(spawn, admin_lease_dir, [
        (f"{uuid}.4242.a.lease", lease_text(uuid, since=0).replace('"since": 0', '"since": NaN')),
        (f"{uuid}.4243.b.lease", lease_text(uuid, 4243, memory=0).replace('"memory": 0',
                                                                           '"memory": 1e999'))])
    sampler = Sampler(interval=3600)
    sampler.start()  # the first sample: no exception
    try:
        first = sampler.snapshot.status["taken_at"]
        time.sleep(0.05)
        sampler.sample_once()
        snap = sampler.snapshot
        assert snap.error is None and snap.errors_total == 0
        assert snap.status["taken_at"] > first  # it moves: not frozen at a last good sample
        assert b"devicekit_sample_ok 1.0" in snap.metrics_text
        assert b"devicekit_ignored_lease_files 2.0" in snap.metrics_text
    finally:
        sampler.stop()


@needs_root
def test_item4_many_huge_leases_cannot_flood_metrics_or_api(spawn, admin_lease_dir,
                                                            simulate) -> None:
    simulate([h100()])
    uuid = dk.gpus()[0].uuid
    huge = [(f"{uuid}.{1000 + i}.h{i}.lease", lease_text("GPU-" + "f" * 60_000, 1000 + i))
            for i in range(150)]
    # and 150 well-formed shared leases on one GPU, each with the longest fields allowed
    many = [(f"{uuid}.{2000 + i}.m{i}.lease",
             lease_text(uuid, 2000 + i, share=True, memory=2**30, host="h" * 255,
                        command="\x1b" * 1024, job="j" * 64))
            for i in range(150)]
    bob_writes(spawn, admin_lease_dir, huge + many)
    sampler = Sampler(interval=3600)
    sampler.start()
    try:
        snap = sampler.snapshot
        gpu = snap.status["gpus"][0]
        assert len(gpu["leases"]) == MAX_LEASES_LISTED
        assert gpu["leases_not_listed"] == 150 - MAX_LEASES_LISTED
        assert len(snap.status["ignored_leases"]) + snap.status["ignored_leases_not_listed"] == 150
        assert all("regex" in i["why"] for i in snap.status["ignored_leases"])
        # 34 MiB and 17 MiB before: now bounded by the ceiling, whatever bob writes
        assert len(snap.metrics_text) < 64 * 1024, len(snap.metrics_text)
        assert len(snap.status_json) < 512 * 1024, len(snap.status_json)
        leases = [s for f in text_string_to_metric_families(snap.metrics_text.decode())
                  for s in f.samples if s.name == "devicekit_gpu_leases"]
        assert [s.value for s in leases] == [150.0]  # counted, though not all listed
    finally:
        sampler.stop()


@needs_root
def test_item5_escapes_in_a_job_id_never_reach_metrics(spawn, admin_lease_dir, simulate) -> None:
    simulate([h100(), h100()])
    uuid = dk.gpus()[0].uuid
    bob_writes(spawn, admin_lease_dir, [
        (f"{uuid}.4242.0.lease", lease_text(uuid, job="x\x1b]0;pwned\x07\x1b[2J"))])
    assert_every_reader_lives(["job"])
    sampler = Sampler(interval=3600)
    sampler.start()
    try:
        text = sampler.snapshot.metrics_text + sampler.snapshot.fragment_html
        assert b"\x1b" not in text and b"\x07" not in text
    finally:
        sampler.stop()


def _ticket_name(seq: int, pid: int) -> str:
    return f"q.{seq:09d}.{pid}.bobtoken.ticket"


def _ticket_text(seq: int, pid: int, since: str) -> str:
    return json.dumps({"version": 1, "seq": seq, "pid": pid, "host": "lab1", "since": 0,
                       "state": "waiting", "count": 1, "candidates": [],
                       "command": "python bob.py"}).replace('"since": 0', f'"since": {since}')


@needs_root
def test_item6_a_ticket_since_1e300_crashes_no_queue(spawn, admin_lease_dir, simulate) -> None:
    simulate([h100()])
    bob_writes(spawn, admin_lease_dir, [(_ticket_name(1, 4242), _ticket_text(1, 4242, "1e300"))])
    files = read_ticket_files(Path(admin_lease_dir))
    assert files.tickets == ()
    assert [(i.user, "since" in i.why) for i in files.ignored] == [("nobody", True)]
    for args in (["queue"], ["queue", "--json"], ["status"]):
        done = cli(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
    assert "nobody" in cli("queue").stdout


@needs_root
def test_item7_a_ticket_saying_since_0_waits_its_real_time(spawn, admin_lease_dir,
                                                           simulate) -> None:
    """A one-second-old ticket claiming 1970 does not make a 57-year queue wait (the lab's
    queue-wait alert fires at an hour): its age is its file's change time."""
    simulate([h100()])
    held = Ticket.take(Path(admin_lease_dir), {"count": 1, "command": "python alice.py",
                                               "candidates": [dk.gpus()[0].uuid]})
    try:  # alice waits too, so the queue has a line; bob joins after her, claiming 1970
        bob_writes(spawn, admin_lease_dir, [(_ticket_name(2, 4242), _ticket_text(2, 4242, "0"))])
        files = read_ticket_files(Path(admin_lease_dir))
        assert [t.user for t in files.tickets] == ["root", "nobody"]
        assert all(time.time() - t.since < 60 for t in files.tickets)
        sampler = Sampler(interval=3600)
        sampler.start()
        sampler.stop()
        wait = [s.value for f in text_string_to_metric_families(
            sampler.snapshot.metrics_text.decode()) for s in f.samples
            if s.name == "devicekit_queue_wait_seconds"]
        assert len(wait) == 1 and 0 <= wait[0] < 60, wait
        shown = cli("queue").stdout
        assert "nobody" in shown and "h)" not in shown.split("nobody", 1)[1].splitlines()[0]
    finally:
        held.close()


RESERVED = {"job", "instance"}


@needs_root
def test_item12_no_lease_label_prometheus_rewrites(spawn, admin_lease_dir, simulate) -> None:
    """bob's lease names its job; alice's /metrics carries it as ``job_id`` (Prometheus would
    store a ``job`` label as ``exported_job`` and show the scrape job instead)."""
    from devicekit.serve.prometheus import render_metrics

    simulate([h100()])
    uuid = dk.gpus()[0].uuid
    bob_writes(spawn, admin_lease_dir, [(f"{uuid}.4242.j.lease", lease_text(uuid, job="812_3"))])
    families = list(text_string_to_metric_families(
        render_metrics(collect_status().to_dict()).decode()))
    names = {k for f in families for s in f.samples for k in s.labels}
    assert not names & RESERVED and not any(n.startswith("__") for n in names), names
    holders = [s.labels for f in families for s in f.samples
               if s.name == "devicekit_lease_holders"]
    assert [(h["user"], h["job_id"]) for h in holders] == [("nobody", "812_3")]


@pytest.mark.parametrize("text", ["nan\n", "1e300\n", "-1e300\n", "inf\n", "0\n"])
def test_a_stopped_jobs_marker_says_no_time_of_its_own(tmp_path, text: str) -> None:
    """The marker a stopped job's owner keeps in the lease directory is made once; its change
    time says since when the job is stopped, never its text (``nan`` crashed every status)."""
    import signal

    from devicekit.sharing.stopped_jobs import marker_path, stopped_since

    child = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        before = time.time()
        marker_path(tmp_path, child.pid).write_text(text)
        deadline = time.monotonic() + 10
        while (since := stopped_since(tmp_path, child.pid, os.getuid())) is None:
            assert time.monotonic() < deadline, "the child was never seen stopped"
            time.sleep(0.01)
        assert before - 1 <= since <= time.time()
        time.strftime("%H:%M:%S", time.localtime(since))  # what status does with it
    finally:
        child.kill()
        child.wait(timeout=10)


# --- defences that held in the third round, kept as tests ---------------------------------


@needs_root
def test_held_a_symlinked_policy_is_ignored_and_said(spawn, admin_lease_dir, simulate) -> None:
    """bob points ``policy.toml`` at a file of his saying nobody may hold a GPU."""
    simulate([h100()])
    child = spawn("""
import os, sys, time
os.setgid(65534); os.setuid(65534)
own = os.path.join(sys.argv[1], "bobs-policy")
with open(own, "w") as handle:
    handle.write("max_gpus_per_user = 0\\n")
os.symlink(own, os.path.join(sys.argv[1], "policy.toml"))
print("ready", flush=True)
time.sleep(60)
""", admin_lease_dir)
    assert wait_line(child, timeout=30) == "ready"
    from devicekit.sharing.policy import load_policy

    policy = load_policy(Path(admin_lease_dir))
    assert policy.max_gpus_per_user is None and "ignored" in policy.note
    assert any(w.startswith("queue policy ") for w in collect_status().warnings)
    with select_gpus(1) as sel:  # no quota of bob's making
        assert len(sel.gpus) == 1


@needs_root
def test_held_a_ticket_hard_linked_under_a_lower_number_takes_no_row(
        spawn, admin_lease_dir, simulate) -> None:
    simulate([h100()])
    alice = Ticket.take(Path(admin_lease_dir), {"count": 1, "command": "python alice.py",
                                                "candidates": [dk.gpus()[0].uuid]})
    try:
        child = spawn("""
import os, sys, time
from pathlib import Path
from devicekit.sharing.tickets import Ticket
os.setgid(65534); os.setuid(65534)
ticket = Ticket.take(Path(sys.argv[1]), {"count": 1, "candidates": [], "command": "bob"})
name = ticket.path.name.split(".")
os.link(ticket.path, ticket.path.with_name(".".join(["q", "000000001", name[2], "ln"] + name[4:])))
print("ready", flush=True)
time.sleep(60)
""", admin_lease_dir)
        assert wait_line(child, timeout=30) == "ready"
        files = read_ticket_files(Path(admin_lease_dir))
        assert [(t.ticket, t.user) for t in files.tickets] == [("1", "root"), ("2", "nobody")]
        assert [(i.user, "JSON says" in i.why) for i in files.ignored] == [("nobody", True)]
    finally:
        alice.close()


@needs_root
def test_held_thousands_of_junk_lease_files_in_a_churning_directory(
        spawn, admin_lease_dir, simulate) -> None:
    """3,000 dead junk lease files alice cannot delete, and a directory bob changes nonstop (a
    view of one moment is retried only a few times): every reader still answers."""
    simulate([h100()])
    child = spawn("""
import os, sys, time
os.setgid(65534); os.setuid(65534)
for n in range(3000):
    with open(os.path.join(sys.argv[1], f"GPU-junk.{n + 1}.x.lease"), "w") as handle:
        handle.write("[" * 1000)
print("ready", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    path = os.path.join(sys.argv[1], "churn.lease")
    open(path, "w").close()
    os.unlink(path)
""", admin_lease_dir)
    assert wait_line(child, timeout=60) == "ready"
    for args in (["status", "--json"], ["select"], ["queue"]):
        done = cli(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
    assert json.loads(cli("status", "--json").stdout)["ignored_leases"] == []  # dead: skipped


def test_a_long_command_is_kept_cut_never_a_reason_to_ignore(simulate) -> None:
    """``devicekit run -- <5,000 characters>``: its lease and ticket are read (the command cut
    to 200 characters with ``...``), not ignored; so is a file an older version wrote whole."""
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.leases import Lease, read_leases

    simulate([h100(), h100()])
    first, second = (g.uuid for g in dk.gpus())
    long = "python train.py " + "--flag " * 700
    with Lease.acquire([first], command=long):
        old = lease_dir() / f"{second}.{os.getpid()}.old.lease"
        fd = os.open(old, os.O_WRONLY | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)  # live, as its writer holds it
        os.write(fd, lease_text(second, os.getpid(), command=long * 2).encode())
        ignored: list = []
        records = read_leases(ignored=ignored)
        old.unlink()
        os.close(fd)
    assert ignored == [] and len(records) == 2
    assert all(len(r.command) == 200 and r.command.endswith("...") for r in records)
    ticket = Ticket.take(lease_dir(), {"count": 1, "candidates": [first], "command": long})
    try:
        (record,) = read_ticket_files(lease_dir()).tickets
        assert len(record.command) == 200 and record.command.startswith("python train.py")
    finally:
        ticket.close()


def test_a_lease_or_ticket_every_reader_would_ignore_is_refused_when_written(simulate) -> None:
    """A writer never leaves a file its readers ignore (a waiter whose own ticket is ignored
    would wait unseen): one line naming the field instead."""
    from devicekit.errors import InvalidValueError, LeaseError
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.leases import Lease

    simulate([h100(uuid="GPU-not a uuid")])
    with pytest.raises(LeaseError, match=r"cannot lease GPU 'GPU-not a uuid': .*gpu_uuid"):
        Lease.acquire(["GPU-not a uuid"])
    with pytest.raises(InvalidValueError, match=r"cannot join the GPU queue .*time_limit"):
        Ticket.take(lease_dir(), {"count": 1, "candidates": [], "command": "x",
                                  "time_limit": 1e12})
    assert not [n for n in os.listdir(lease_dir()) if n.endswith((".lease", ".ticket"))]
