"""``devicekit run --wait`` in the fair queue, end to end on simulated GPUs with real processes:
FIFO, EASY backfill with ``--time`` (and none without), ``queue --json`` reasons, cancel,
quotas from ``policy.toml``, and ``--time`` enforced with SIGTERM then SIGKILL."""

from __future__ import annotations

import getpass
import json
import multiprocessing
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.tickets import TicketRecord, read_tickets
from tests.conftest import h100
from tests.ranks import child_env, devicekit_command

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(2)]


@pytest.fixture
def two_gpus(simulate: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return simulate([h100(uuid=u) for u in UUIDS])


class Jobs:
    """``devicekit run`` processes of one test; every one is stopped and reaped at the end."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[str]] = []

    def run(self, *args: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(devicekit_command("run", *args), env=child_env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(proc)
        return proc

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(devicekit_command(*args), env=child_env(), text=True,
                              capture_output=True, timeout=60)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)  # forwarded to its command
        for proc in self.procs:
            try:
                proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=10)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Jobs]:
    j = Jobs(tmp_path)
    yield j
    j.close()


def ticket_of(pid: int, state: str = "waiting", timeout: float = 60.0) -> TicketRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [t for t in read_tickets(lease_dir(), cleanup=False)
                 if t.pid == pid and t.state == state]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {state} ticket of pid {pid} within {timeout} s")


def _hold(count: int, ready: str) -> None:
    from devicekit.selection.choose import select_gpus

    select_gpus(count)
    Path(ready).write_text("held")
    time.sleep(120)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[Callable[[int], multiprocessing.process.BaseProcess]]:
    """``holder(n)``: a process holding n GPUs (until killed: kill -9 frees them at once)."""
    started: list[multiprocessing.process.BaseProcess] = []

    def start(count: int) -> multiprocessing.process.BaseProcess:
        ready = tmp_path / f"held-{len(started)}"
        proc = multiprocessing.get_context("fork").Process(target=_hold, args=(count, str(ready)))
        proc.start()
        started.append(proc)
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.is_alive() and time.monotonic() < deadline, "holder never got its GPUs"
            time.sleep(0.02)
        return proc

    yield start
    for proc in started:
        if proc.is_alive():
            proc.kill()
        proc.join(10)


def stop(proc: multiprocessing.process.BaseProcess) -> None:
    proc.kill()
    proc.join(10)


def test_three_2_gpu_jobs_start_in_arrival_order(two_gpus: Path, jobs: Jobs, holder: Callable,
                                                 tmp_path: Path) -> None:
    blocker = holder(2)
    log = tmp_path / "order.log"
    waiters = []
    for name in "ABC":
        proc = jobs.run("--gpus", "2", "--gpus-per-proc", "2", "--wait", "120", "--",
                        "sh", "-c", f"echo {name} >> {log}; sleep 0.3")
        ticket_of(proc.pid)
        waiters.append(proc)
    doc = json.loads(jobs.cli("queue", "--json").stdout)
    assert doc["schema"] == 1
    assert [w["pid"] for w in doc["waiting"]] == [p.pid for p in waiters]
    first = doc["waiting"][0]
    assert first["gpus_asked"] == 2 and first["user"] == getpass.getuser()
    assert first["reason"].startswith("Busy: GPU ") and "leased by" in first["reason"]
    assert "sh -c" in first["command"]
    stop(blocker)
    for proc in waiters:
        assert proc.wait(timeout=120) == 0
    assert log.read_text().split() == ["A", "B", "C"]
    assert read_tickets(lease_dir()) == []


def test_backfill_with_time_none_without_and_cancel(two_gpus: Path, jobs: Jobs,
                                                    tmp_path: Path) -> None:
    long = jobs.run("--gpus", "1", "--time", "10m", "--", "sleep", "120")
    running = ticket_of(long.pid, state="running")
    assert running.time_limit == 600 and len(running.gpus) == 1
    head = jobs.run("--gpus", "2", "--gpus-per-proc", "2", "--wait", "120", "--", "true")
    head_ticket = ticket_of(head.pid)
    unlimited = jobs.run("--gpus", "1", "--wait", "5", "--", "echo", "unlimited")
    ticket_of(unlimited.pid)
    doc = json.loads(jobs.cli("queue", "--json").stdout)
    entries = {w["pid"]: w for w in doc["waiting"]}
    assert entries[head.pid]["reserved"] and entries[head.pid]["reason"].startswith("Busy: ")
    assert entries[unlimited.pid]["reason"].startswith(f"Reserved for {head_ticket.ticket}")
    assert [r["pid"] for r in doc["running"]] == [long.pid]
    assert doc["running"][0]["time_limit"] == 600
    text = jobs.cli("queue").stdout
    assert f"Reserved for {head_ticket.ticket}" in text and "running with a time limit: 1" in text
    # a short job with a limit ends before the head could start (the long job's limit): backfilled
    short = jobs.run("--gpus", "1", "--time", "30s", "--wait", "120", "--", "echo", "short")
    out, err = short.communicate(timeout=120)
    assert short.returncode == 0, err
    assert "short" in out
    # without a limit: no backfill; it waits until its --wait runs out
    out, err = unlimited.communicate(timeout=120)
    assert unlimited.returncode == 3 and "unlimited" not in out
    assert "need 1 GPU(s)" in err and "Traceback" not in err
    # cancel: the head's waiter stops waiting, with one line saying why
    result = jobs.cli("queue", "cancel", head_ticket.ticket)
    assert result.returncode == 0, result.stderr
    out, err = head.communicate(timeout=60)
    assert head.returncode == 3 and f"ticket {head_ticket.ticket} was cancelled" in err
    assert "Traceback" not in err
    bad = jobs.cli("queue", "cancel", "999")
    assert bad.returncode != 0 and "no ticket 999" in bad.stderr and "Traceback" not in bad.stderr
    assert long.poll() is None  # the long job still runs: nothing above touched it


def test_quota_from_policy_keeps_a_job_waiting(two_gpus: Path, jobs: Jobs, holder: Callable) -> None:
    policy = lease_dir() / "policy.toml"
    policy.write_text("max_gpus_per_user = 1\n")
    policy.chmod(0o644)
    blocker = holder(1)
    over = jobs.run("--gpus", "1", "--wait", "60", "--", "true")
    ticket_of(over.pid)
    doc = json.loads(jobs.cli("queue", "--json").stdout)
    (entry,) = doc["waiting"]
    assert entry["reason"] == f"Quota: {getpass.getuser()} uses 1 of 1 GPU(s), asks 1"
    assert doc["policy"]["max_gpus_per_user"] == 1
    status = jobs.cli("status", "--json")
    (queued,) = json.loads(status.stdout)["queue"]  # status shows the queue too
    assert queued["ticket"] == entry["ticket"] and queued["reason"].startswith("Quota: ")
    assert f"queue: ticket {entry['ticket']}" in jobs.cli("status").stdout
    assert jobs.cli("queue", "cancel", entry["ticket"]).returncode == 0
    _, err = over.communicate(timeout=60)
    assert over.returncode == 3 and "cancelled" in err
    stop(blocker)


def test_policy_writable_by_others_is_ignored_with_a_note(two_gpus: Path, jobs: Jobs) -> None:
    policy = lease_dir() / "policy.toml"
    policy.write_text("max_gpus_per_user = 0\n")
    policy.chmod(0o666)
    doc = json.loads(jobs.cli("queue", "--json").stdout)
    assert "writable by others" in doc["policy"]["note"]
    assert doc["policy"]["max_gpus_per_user"] is None


def test_time_limit_sends_sigterm_then_sigkill(jobs: Jobs) -> None:
    policy = lease_dir() / "policy.toml"
    policy.write_text('time_limit_grace = "1s"\n')
    policy.chmod(0o644)
    polite = jobs.run("--time", "1s", "--", "sleep", "60")
    stubborn = jobs.run("--time", "1s", "--", "sh", "-c", "trap '' TERM; sleep 60")
    _, err = polite.communicate(timeout=60)
    assert polite.returncode == 143
    assert "time limit 1s (--time) reached: sent SIGTERM to the job; exit code 143" in err
    _, err = stubborn.communicate(timeout=60)
    assert stubborn.returncode == 137
    assert "sent SIGTERM, then SIGKILL after 1s" in err


def test_bad_time_limit_is_one_line(jobs: Jobs) -> None:
    result = jobs.cli("run", "--time", "45", "--", "true")
    assert result.returncode != 0 and "--time '45' needs a unit" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("option", ["--wait", "--hang-timeout"])
@pytest.mark.parametrize("seconds", ["nan", "1e999"])
def test_seconds_that_are_not_finite_are_named_as_typed(jobs: Jobs, option: str, seconds: str) -> None:
    # `run --wait 1e999` said "wait inf must be a number of seconds >= 0"; `--hang-timeout nan`
    # was taken (click's FloatRange lets NaN through) and the job started
    result = jobs.cli("run", "--procs", "2", option, seconds, "--", "true")
    assert result.returncode == 1, result.stderr
    assert result.stderr == (f"devicekit: Invalid value for '{option}': '{seconds}' is not a number"
                             " of seconds >= 0 (see 'devicekit run --help')\n")


def test_a_queued_run_whose_stderr_is_a_file_says_it_waits(two_gpus: Path, jobs: Jobs, holder: Callable,
                                                             tmp_path: Path) -> None:
    """Issue 46, item 2: run --wait under nohup or in a batch log wrote nothing while it waited."""
    blocker = holder(1)
    log = tmp_path / "job.err"
    with log.open("w") as err:
        proc = subprocess.Popen(devicekit_command("run", "--gpus", "2", "--wait", "120", "--", "true"),
                                env=child_env(), text=True, stdout=subprocess.DEVNULL, stderr=err)
    jobs.procs.append(proc)
    ticket = ticket_of(proc.pid)
    deadline = time.monotonic() + 60
    while "devicekit: waiting" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    first = log.read_text().splitlines()[0]
    assert first.startswith(f"devicekit: waiting for 2 GPU(s) (ticket {ticket.ticket}, 1 of 1 waiting), up to 1")
    assert ": Busy: GPU 0 leased by " in first, first
    stop(blocker)
    assert proc.wait(timeout=120) == 0
    # it polled on until the GPU freed; nothing changed and 30 s did not pass: nothing more said
    assert [line for line in log.read_text().splitlines() if "waiting" in line] == [first]
