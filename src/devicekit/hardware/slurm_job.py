"""Where in a Slurm job this process is: a task ``srun`` started, the sbatch script, or a shell.

Read from Slurm's variables alone (no torch, no ``scontrol``), so that ``dk.dist`` (the rank's
view), ``devicekit run`` (the launcher's view) and ``doctor`` agree: the sbatch script itself
is one process even though SLURM_NTASKS is the job's task count.

Usage::

    from devicekit.hardware.slurm_job import is_batch_script

    is_batch_script({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NAME": "train"})  # True
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["NOT_SRUN_STEPS", "in_slurm_job", "is_batch_script"]

#: ``SLURM_JOB_NAME`` of an interactive allocation shell (``salloc``, ``srun --pty bash``)
_INTERACTIVE_NAMES = ("bash", "interactive", "sh", "zsh")

#: Slurm step ids of a batch script and of the "extern" step: not tasks started by srun
NOT_SRUN_STEPS = ("4294967294", "4294967295", "batch", "extern")


def in_slurm_job(environ: Mapping[str, str]) -> bool:
    """Slurm's task variables are set and this is not an interactive allocation shell."""
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return False
    return environ.get("SLURM_JOB_NAME", "") not in _INTERACTIVE_NAMES


def is_batch_script(environ: Mapping[str, str]) -> bool:
    """The sbatch script itself, not a task ``srun`` started: no step id (or the batch step's).

    sbatch sets SLURM_PROCID=0 and the job's SLURM_NTASKS there, but the other tasks exist
    only once ``srun`` starts them: the script is one process, a world of one.
    """
    if not in_slurm_job(environ):
        return False
    step = (environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID") or "").strip()
    if step:
        return step in NOT_SRUN_STEPS
    # no step id: the batch script is task 0 and has none of srun's SLURM_STEP_* variables
    if environ.get("SLURM_PROCID", "").strip() not in ("0", ""):
        return False
    return not any(name.startswith("SLURM_STEP_") for name in environ)
