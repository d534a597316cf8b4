"""The ``sbatch`` job script for the strategy ``advise`` recommends: from "will it fit" to a job.

One node (advise sizes the GPUs of one node), one task per node that runs ``devicekit run``
(which starts torchrun there: the form docs/many-gpus.md describes), ``--gres=gpu:N`` for the
strategy's GPUs, this node's cores shared out per GPU, the time limit, and ``--signal=USR1@90``
so the job is warned 90 s before its time limit or a preemption.

Usage::

    from devicekit.strategy.sbatch import sbatch_script

    print(sbatch_script(dk.advise(model, sample), time="02:00:00", cores=32))
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from devicekit.errors import InvalidValueError

if TYPE_CHECKING:  # advise imports torch; --time is checked before it is
    from devicekit.strategy.advise import Advice, Strategy

__all__ = ["sbatch_script", "check_time", "WARNING_SIGNAL"]

#: Slurm warns the job this long before its time limit (USR1, which devicekit run forwards)
WARNING_SIGNAL = "USR1@90"
#: sbatch's --time forms: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_TIME = re.compile(r"\d{1,6}(:\d{1,2}){0,2}|\d{1,4}-\d{1,2}(:\d{1,2}){0,2}")


def check_time(value: str) -> str:
    """``value`` if sbatch's ``--time`` accepts its form; a one-line error naming it otherwise."""
    text = value.strip()
    if not _TIME.fullmatch(text):
        raise InvalidValueError(
            f"--time {value!r} is not a Slurm time limit; write MINUTES, HH:MM:SS or"
            " DAYS-HH:MM:SS (e.g. 90, 02:00:00, 1-12:00:00)")
    return text


def sbatch_script(advice: Advice, *, time: str = "01:00:00", cores: int = 1) -> str:
    """A job script for ``advice.best`` on one node with ``cores`` CPU cores; refused (one line)
    when no strategy fits."""
    time = check_time(time)
    best = advice.best
    if not best.fits:
        raise InvalidValueError(
            f"no strategy fits these GPUs (the best, {best.name}, does not: {best.reason});"
            " no sbatch script: try a smaller --batch or a node with larger GPUs (--simulate)")
    gpus_here = max(len(advice.budgets), 1)
    command, note = _command(best)
    per_task = max(cores * best.gpus // gpus_here, 1) if best.gpus else max(cores, 1)
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={_job_name(best)}",
             "#SBATCH --nodes=1",
             "#SBATCH --ntasks-per-node=1"]
    if best.gpus:
        lines.append(f"#SBATCH --gres=gpu:{best.gpus}")
    lines += [f"#SBATCH --cpus-per-task={per_task}",
              f"#SBATCH --time={time}",
              f"#SBATCH --signal={WARNING_SIGNAL}",
              f"# devicekit advise: {best.name}{f'; in train.py: {note}' if note else ''}",
              f"srun {command}"]
    return "\n".join(lines) + "\n"


def _command(best: Strategy) -> tuple[str, str]:
    """The shell command the script runs, and the line of Python the strategy asks for."""
    command, _, note = best.command.partition("#")
    command, note = command.strip(), note.strip()
    if command.startswith("devicekit run"):
        return command, note
    if best.gpus == 0:  # the CPU row
        return command, note
    # a split / pipeline: one process that drives all the strategy's GPUs
    return f"devicekit run --gpus {best.gpus} --procs 1 -- python train.py", best.command


def _job_name(best: Strategy) -> str:
    return re.sub(r"[^a-z0-9]+", "-", best.name.lower()).strip("-") or "train"
