"""devicekit run and Slurm's warning signals, without Slurm: survive it, pass it to every rank
once (through a wrapper shell too), requeue only after rank 0's save (a stand-in scontrol)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devicekit.jobs.preempt_signals import deliver, in_srun_step
from tests.ranks import child_env

#: a rank that counts SIGUSR1 (dk chains its handler), says it is ready, waits for the flag
RANK = """\
import os, signal, sys, time
import devicekit as dk
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(s))
dk.preempted()
open(os.path.join(sys.argv[1], "ready." + os.environ.get("RANK", "0")), "w").close()
t0 = time.monotonic()
while not dk.preempted() and time.monotonic() - t0 < 60:
    time.sleep(0.02)
if len(sys.argv) > 2:
    dk.save_checkpoint({"saved": True}, os.path.join(sys.argv[1], "ckpt.pt"))
time.sleep(0.5)  # a second delivery would arrive by now
print(f"rank {os.environ.get('RANK', '0')} usr1={len(got)}", flush=True)
"""


def _devicekit(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    (tmp_path / "rank.py").write_text(RANK)
    return subprocess.Popen([sys.executable, "-m", "devicekit", "run", *args],
                            env=child_env(**(env or {})), cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _when_ready(tmp_path: Path, proc: subprocess.Popen[str], count: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready.*"))) < count:
        if proc.poll() is not None or time.monotonic() > deadline:
            out, err = proc.communicate(timeout=10)
            raise AssertionError(f"ranks not ready (exit {proc.returncode}): {out}{err}")
        time.sleep(0.05)


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=10)
    return proc.returncode, out, err


def test_usr1_to_devicekit_run_reaches_each_of_two_ranks_once(tmp_path: Path) -> None:
    proc = _devicekit(tmp_path, "--procs", "2", "--", "rank.py", str(tmp_path))
    _when_ready(tmp_path, proc, 2)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out, err = _finish(proc)
    assert code == 0, err
    assert sorted(out.split("\n"))[-2:] == ["rank 0 usr1=1", "rank 1 usr1=1"], out + err
    assert "SIGUSR1 (Slurm's warning: time limit or preemption ahead): passed to 2 process(es)" \
        " of the ranks; the job goes on" in err


def test_a_wrapper_shell_is_passed_over_for_the_python_below_it(tmp_path: Path) -> None:
    proc = _devicekit(tmp_path, "--", "sh", "-c", f"{sys.executable} rank.py {tmp_path}; exit $?")
    _when_ready(tmp_path, proc, 1)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out, err = _finish(proc)
    assert (code, out.strip()) == (0, "rank 0 usr1=1"), err


def test_a_command_that_does_not_ask_survives_the_warning(spawn) -> None:  # noqa: ANN001
    proc = subprocess.Popen(
        [sys.executable, "-m", "devicekit", "run", "--", sys.executable, "-c",
         "import time; print('up', flush=True); time.sleep(2); print('alive', flush=True)"],
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    os.kill(proc.pid, signal.SIGUSR2)
    code, out, err = _finish(proc)
    assert (code, out.strip()) == (0, "alive"), err


def _fake_scontrol(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"  # records its arguments: the real one is tests/slurm's
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


def test_requeue_runs_scontrol_only_after_rank_0_saved(tmp_path: Path) -> None:
    env = _fake_scontrol(tmp_path)
    proc = _devicekit(tmp_path, "--requeue", "--", "rank.py", str(tmp_path), "save", env=env)
    _when_ready(tmp_path, proc, 1)
    os.kill(proc.pid, signal.SIGUSR1)
    code, out, err = _finish(proc)
    assert code == 0, err
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert "SIGUSR1: rank 0 saved a checkpoint; requeued job 4242 (scontrol requeue); it" \
        " restarts with SLURM_RESTART_COUNT=1" in err


def test_no_save_no_requeue(tmp_path: Path) -> None:
    env = _fake_scontrol(tmp_path)
    proc = _devicekit(tmp_path, "--requeue", "--", "rank.py", str(tmp_path), env=env)
    _when_ready(tmp_path, proc, 1)
    os.kill(proc.pid, signal.SIGUSR1)
    code, _, err = _finish(proc)
    assert code == 0, err
    assert not (tmp_path / "scontrol.log").exists()
    assert "SIGUSR1 came but rank 0 saved no checkpoint after it (dk.save_checkpoint): job 4242" \
        " not requeued" in err


def test_requeue_outside_slurm_says_it_cannot(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "devicekit", "run", "--requeue", "--", "true"],
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--requeue: not in a Slurm job (no SLURM_JOB_ID): a preempted job will not be" \
        " requeued" in done.stderr


@pytest.mark.parametrize("environ,step", [
    ({"SLURM_STEP_ID": "0"}, True), ({"SLURM_STEPID": "3"}, True), ({}, False),
    ({"SLURM_STEP_ID": "batch"}, False), ({"SLURM_JOB_ID": "7"}, False),
])
def test_only_a_numbered_step_counts_as_an_srun_step(environ: dict[str, str], step: bool) -> None:
    assert in_srun_step(environ) is step


def test_deliver_skips_processes_that_are_gone(tmp_path: Path) -> None:
    assert deliver(signal.SIGUSR1, [2 ** 22 + 12345]) == []


def test_the_step_directory_is_private_and_never_one_someone_else_made(tmp_path: Path) -> None:
    from devicekit.jobs.step_doctor import step_directory

    made = step_directory("c-7.0.0", base=str(tmp_path))
    assert made is not None and os.stat(made).st_mode & 0o777 == 0o700
    assert step_directory("c-7.0.0", base=str(tmp_path)) == made  # the step's other task
    loose = tmp_path / f"devicekit-hang-{os.getuid()}-c-8.0.0"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    assert step_directory("c-8.0.0", base=str(tmp_path)) is None
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", tmp_path / f"devicekit-hang-{os.getuid()}-c-9.0.0")
    assert step_directory("c-9.0.0", base=str(tmp_path)) is None


def test_sigterm_lets_a_polling_rank_save_and_never_requeues(tmp_path: Path) -> None:
    env = _fake_scontrol(tmp_path)
    proc = _devicekit(tmp_path, "--requeue", "--", "rank.py", str(tmp_path), "save", env=env)
    _when_ready(tmp_path, proc, 1)
    os.kill(proc.pid, signal.SIGTERM)  # scancel's signal: save and stop, not a requeue
    code, out, err = _finish(proc)
    assert (code, out.strip()) == (0, "rank 0 usr1=0"), err
    assert (tmp_path / "ckpt.pt").is_file()
    assert not (tmp_path / "scontrol.log").exists()


def test_ranks_start_with_the_default_so_lightning_registers_its_handler(tmp_path: Path) -> None:
    """Lightning's signal connector skips SIGUSR1 when the rank already has a disposition other
    than the default (an inherited SIG_IGN would silently switch its auto-requeue off)."""
    code = ("import os, signal; print(os.environ['RANK'],"
            " signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL,"
            " signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL)")
    done = subprocess.run([sys.executable, "-m", "devicekit", "run", "--procs", "2", "--",
                           sys.executable, "-c", code], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split("\n"))[-2:] == ["0 True True", "1 True True"], done.stdout


def test_a_sigterm_after_the_warning_cancels_the_requeue(tmp_path: Path) -> None:
    env = _fake_scontrol(tmp_path)
    script = tmp_path / "slow.py"  # handles both, saves, and is still saving when TERM comes
    script.write_text(
        "import os, sys, time, devicekit as dk\n"
        "dk.preempted()\nopen(os.path.join(sys.argv[1], 'ready.0'), 'w').close()\n"
        "while not dk.preempted():\n    time.sleep(0.02)\n"
        "open(os.path.join(sys.argv[1], 'warned'), 'w').close()\n"
        "time.sleep(1.5)\n"
        "dk.save_checkpoint({'s': 1}, os.path.join(sys.argv[1], 'ckpt.pt'))\n")
    proc = subprocess.Popen([sys.executable, "-m", "devicekit", "run", "--requeue", "--",
                             str(script), str(tmp_path)], env=child_env(**env), cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _when_ready(tmp_path, proc, 1)
    os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not (tmp_path / "warned").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # the user cancels the warned job
    code, _, err = _finish(proc)
    assert (tmp_path / "ckpt.pt").is_file(), err
    assert not (tmp_path / "scontrol.log").exists()
    assert "SIGUSR1, then SIGTERM (scancel or the time limit): not requeued" in err
