"""Slurm's signals against a real cluster: the warning reaches every rank once, the job saves,
requeues and resumes, scancel and a hang leave nothing behind.

The warning is delivered as Slurm delivers it, without waiting for the 1-minute granularity of
``--signal=USR1@N``: ``scancel --batch --signal=USR1`` is what ``--signal=B:USR1@N`` sends (the
batch shell alone), ``scancel --signal=USR1`` what ``--signal=USR1@N`` sends (every process of
every srun step). One test checks that a real time limit's ``--signal`` takes the same path.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import h100
from tests.slurm.cluster import SlurmCluster

SRC = str(Path(__file__).resolve().parents[2] / "src")

#: a rank that polls dk.preempted() and saves with dk.save_checkpoint; it counts every SIGUSR1
#: it gets (its own handler, which dk's chains), so a signal delivered twice shows
TRAIN = """\
import os, signal, sys, time
import torch, torch.distributed as dist
import devicekit as dk
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
dk.preempted()
dist.init_process_group("gloo")
rank = dist.get_rank()
state = dk.resume("ckpt") or {"step": 0}
print(f"rank {rank} starts at step {state['step']} restart={os.environ.get('SLURM_RESTART_COUNT', '-')}", flush=True)
t = torch.ones(1)
for step in range(state["step"], int(sys.argv[1])):
    dist.all_reduce(t)
    time.sleep(0.05)
    if dk.preempted():
        dk.save_checkpoint({"step": step + 1}, f"ckpt/step{step + 1:05d}.pt")
        time.sleep(1.0)  # a second signal, if one were sent, would arrive by now
        print(f"rank {rank} saved at step {step + 1} usr1={len(got)}", flush=True)
        break
else:
    print(f"rank {rank} finished at step {step + 1}", flush=True)
dist.destroy_process_group()
"""


def _devicekit() -> str:
    import sys

    return str(Path(sys.executable).with_name("devicekit"))


def _out(tmp_path: Path, job: str) -> str:
    path = tmp_path / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_for_text(tmp_path: Path, job: str, text: str, count: int = 1,
                   timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _out(tmp_path, job).count(text) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} x{count} not in job {job}'s output after {timeout:.0f} s:\n"
                         f"{_out(tmp_path, job)}")


def _job_processes(job: str) -> list[str]:
    """Every process still running with this job's SLURM_JOB_ID in its environment."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_JOB_ID") == job and proc.status() != psutil.STATUS_ZOMBIE:
            found.append(f"{proc.pid}: {' '.join(proc.info['cmdline'] or [])}")
    return found


def _no_processes_left(job: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := _job_processes(job)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of job {job} left behind: {left}"


def _leases(directory: str) -> list[object]:
    from devicekit.sharing.lease_records import read_leases

    return read_leases(directory)


@pytest.fixture
def two_gpus(simulate, tmp_path: Path) -> str:  # noqa: ANN001 - the conftest fixture
    """Two simulated GPUs for devicekit run to lease (and a lease directory to look at)."""
    simulate([h100(uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000"),
              h100(uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000")])
    (tmp_path / "train.py").write_text(TRAIN)
    return os.environ["DEVICEKIT_LEASE_DIR"]


def _submit(slurm: SlurmCluster, tmp_path: Path, body: str, *args: str) -> str:
    return slurm.submit(f"#!/bin/bash\n{body}\n", cwd=tmp_path, args=args,
                        env={"PYTHONPATH": SRC})


def test_usr1_to_the_batch_shell_reaches_every_rank_once_and_the_job_saves_and_ends_clean(
        slurm: SlurmCluster, tmp_path: Path, two_gpus: str) -> None:
    job = _submit(slurm, tmp_path, f"exec {_devicekit()} run --gpus 2 -- train.py 100000",
                  "-n", "2")
    _wait_for_text(tmp_path, job, "starts at step 0", count=2)
    assert len(_leases(two_gpus)) == 2  # both simulated GPUs leased while it runs
    done = slurm.run(["scancel", "--batch", "--signal=USR1", job])
    assert done.returncode == 0, done.stderr
    assert slurm.wait_for_job(job) == "COMPLETED", _out(tmp_path, job)
    out = _out(tmp_path, job)
    assert "SIGUSR1 (Slurm's warning: time limit or preemption ahead): passed to 2 process(es)" in out
    saved = [line for line in out.splitlines() if " saved at step " in line]
    assert len(saved) == 2 and all(line.endswith("usr1=1") for line in saved), out
    step = int(saved[0].split(" saved at step ")[1].split()[0])
    assert (tmp_path / "ckpt" / f"step{step:05d}.pt").is_file()
    _no_processes_left(job)
    assert _leases(two_gpus) == []


def test_usr1_slurm_gives_every_process_of_a_step_is_not_passed_on_again(
        slurm: SlurmCluster, tmp_path: Path, two_gpus: str) -> None:
    job = _submit(slurm, tmp_path, f"srun {_devicekit()} run --gpus 2 -- train.py 100000",
                  "-n", "1", "-c", "2")
    _wait_for_text(tmp_path, job, "starts at step 0", count=2)
    done = slurm.run(["scancel", "--signal=USR1", job])  # what --signal=USR1@N sends
    assert done.returncode == 0, done.stderr
    assert slurm.wait_for_job(job) == "COMPLETED", _out(tmp_path, job)
    out = _out(tmp_path, job)
    assert "Slurm gave it to every rank itself; the job goes on" in out
    saved = [line for line in out.splitlines() if " saved at step " in line]
    assert len(saved) == 2 and all(line.endswith("usr1=1") for line in saved), out
    _no_processes_left(job)
    assert _leases(two_gpus) == []


def test_requeue_after_the_save_and_the_restart_resumes_from_the_checkpoint(
        slurm: SlurmCluster, tmp_path: Path, two_gpus: str) -> None:
    job = _submit(slurm, tmp_path,
                  f"exec {_devicekit()} run --requeue --gpus 2 -- train.py 60", "-n", "2")
    _wait_for_text(tmp_path, job, "starts at step 0", count=2)
    assert slurm.run(["scancel", "--batch", "--signal=USR1", job]).returncode == 0
    _wait_for_text(tmp_path, job, "requeued job")
    requeued = time.time()
    out = _out(tmp_path, job)
    step = int(out.split(" saved at step ")[1].split()[0])
    assert f"rank 0 saved a checkpoint; requeued job {job} (scontrol requeue); it restarts" \
           " with SLURM_RESTART_COUNT=1" in out
    deadline = time.monotonic() + 30
    while not {"Restarts=1", "JobState=PENDING"} <= set(
            slurm.run(["scontrol", "-o", "show", "job", job]).stdout.split()):
        assert time.monotonic() < deadline, slurm.run(["scontrol", "show", "job", job]).stdout
        time.sleep(0.1)
    _no_processes_left(job)  # the first run is gone before the second starts
    # Slurm holds a requeued job for two minutes (its BeginTime); start it now, as it then would.
    # Not within the second of the requeue's kill: slurmd refuses a launch credential made in
    # the second its job's credentials were revoked ("Job N already killed, do not launch")
    time.sleep(max(0.0, requeued + 2.0 - time.time()))
    held = slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    assert held.returncode == 0, held.stderr
    state = slurm.wait_for_job(job, timeout=90)
    assert state == "COMPLETED", f"{_out(tmp_path, job)}\n{slurm.logs()}"
    out = _out(tmp_path, job)
    assert out.count(f"starts at step {step} restart=1") == 2, out
    assert out.count("finished at step 60") == 2, out
    _no_processes_left(job)
    assert _leases(two_gpus) == []


def test_scancel_leaves_no_process_and_no_lease(slurm: SlurmCluster, tmp_path: Path,
                                                two_gpus: str) -> None:
    job = _submit(slurm, tmp_path, f"{_devicekit()} run --gpus 2 -- train.py 100000", "-n", "2")
    _wait_for_text(tmp_path, job, "starts at step 0", count=2)
    assert _job_processes(job)
    assert slurm.run(["scancel", job]).returncode == 0
    slurm.wait_for_job(job)
    _no_processes_left(job)
    assert _leases(two_gpus) == []


HANG = """\
import datetime, time, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(4)
for step in range(6):
    if step == 3 and dist.get_rank() == 1:
        time.sleep(120)
    dist.all_reduce(t)
dist.destroy_process_group()
"""


def test_a_hang_with_one_task_per_rank_names_the_rank_and_line_and_ends_the_step_124(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(HANG)
    # the fixture's node name does not resolve: the master is named, as docs/run.md says to
    job = _submit(slurm, tmp_path, f"export MASTER_ADDR=127.0.0.1 TMPDIR={tmp_path}\n"
                  f"srun -n 2 {_devicekit()} run --hang-timeout 4 -- hang.py\necho srun exit $?",
                  "-n", "2")
    slurm.wait_for_job(job, timeout=90)
    out = _out(tmp_path, job)
    assert "  rank 1: not in a collective; now at hang.py:6 in <module>" in out, out
    assert "devicekit run: look at rank 1: it never reached all_reduce seq 4 that rank(s) [0]" \
           " wait in; it is at hang.py:6 in <module>" in out
    assert out.count("hang report (2 ranks)") == 1  # one task reports, not each
    assert "srun exit 124" in out
    assert "Traceback" not in out  # rank 0 is stopped with rank 1, not killed by its end
    kept = list(tmp_path.glob("devicekit-hang-*/hang-report.txt"))
    assert len(kept) == 1 and "hang.py:6" in kept[0].read_text()
    _no_processes_left(job)


@pytest.mark.slow
def test_a_real_time_limit_signal_takes_the_same_path(slurm: SlurmCluster, tmp_path: Path) -> None:
    """``--time=1 --signal=B:USR1@55``: slurmctld sends SIGUSR1 within its check interval."""
    (tmp_path / "poll.py").write_text(
        "import time, devicekit as dk\nt0 = time.time(); dk.preempted()\n"
        "while not dk.preempted() and time.time() - t0 < 58:\n    time.sleep(0.1)\n"
        "print(f'preempted={dk.preempted()}', flush=True)\n")
    job = _submit(slurm, tmp_path, f"exec {_devicekit()} run -- poll.py",
                  "--time=1", "--signal=B:USR1@55")
    assert slurm.wait_for_job(job, timeout=70) == "COMPLETED", _out(tmp_path, job)
    out = _out(tmp_path, job)
    assert "SIGUSR1 (Slurm's warning: time limit or preemption ahead): passed to 1" in out, out
    assert "preempted=True" in out
    _no_processes_left(job)
