"""``devicekit run --requeue``: after a preemption warning and rank 0's save, requeue the job.

Once the ranks have exited after Slurm's warning (SIGUSR1 or SIGUSR2; SIGTERM is how
``scancel`` stops a job, so it never requeues, and one after the warning cancels the requeue)
and rank 0 saved a checkpoint with
``dk.save_checkpoint`` after it, the ``devicekit run`` that hosts rank 0 runs ``scontrol requeue
$SLURM_JOB_ID``. Slurm then stops the job with SIGTERM (ignored from here on, so the clean-up
finishes) and starts it again later with ``SLURM_RESTART_COUNT`` one higher, where
``dk.resume(dir)`` loads the newest checkpoint. Without a save there is nothing to resume from
and the job is not requeued (it says so): a job that had simply finished must not run again.

Usage::

    from devicekit.jobs.requeue import check_requeue, requeue

    note = check_requeue(environ)               # at plan time: None, or why it cannot work
    line = requeue(environ, saved=True, signal_name="SIGUSR1")
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping

__all__ = ["check_requeue", "requeue", "JOB_ENV"]

#: the variable that names the Slurm job
JOB_ENV = "SLURM_JOB_ID"
#: how long ``scontrol requeue`` may take
_TIMEOUT = 30.0


def check_requeue(environ: Mapping[str, str]) -> str | None:
    """Why ``--requeue`` cannot act here (not in a Slurm job, no scontrol), or None."""
    job = environ.get(JOB_ENV, "")
    if not job:
        return (f"--requeue: not in a Slurm job (no {JOB_ENV}): a preempted job will not be"
                " requeued")
    if not job.isdigit():
        return f"--requeue: {JOB_ENV}={job[:40]!r} is not a job id: nothing will be requeued"
    if shutil.which("scontrol", path=environ.get("PATH")) is None:
        return "--requeue: scontrol is not on PATH: a preempted job cannot be requeued"
    return None


def requeue(environ: Mapping[str, str], *, saved: bool, signal_name: str) -> str:
    """Requeue this Slurm job if rank 0 saved after the warning; the line to print."""
    why = check_requeue(environ)
    if why is not None:
        return why
    job = environ[JOB_ENV]
    if not saved:
        return (f"{signal_name} came but rank 0 saved no checkpoint after it (dk.save_checkpoint):"
                f" job {job} not requeued")
    scontrol = shutil.which("scontrol", path=environ.get("PATH")) or "scontrol"
    try:
        done = subprocess.run([scontrol, "requeue", job], capture_output=True, text=True,
                              timeout=_TIMEOUT, env=dict(environ))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"scontrol requeue {job} failed ({exc}): the job is not requeued"
    if done.returncode != 0:
        reason = (done.stderr.strip() or done.stdout.strip()).splitlines()
        return (f"scontrol requeue {job} failed ({reason[-1][:200] if reason else done.returncode}):"
                " the job is not requeued (was it submitted with --no-requeue?)")
    restarts = environ.get("SLURM_RESTART_COUNT", "0")
    nxt = int(restarts) + 1 if restarts.isdigit() else 1
    return (f"{signal_name}: rank 0 saved a checkpoint; requeued job {job} (scontrol requeue);"
            f" it restarts with SLURM_RESTART_COUNT={nxt}")
