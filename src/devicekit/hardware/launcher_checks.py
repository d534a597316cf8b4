"""Doctor check of the launcher variables: what :mod:`devicekit.hardware.launchers` reads, judged.

The variables are read once, by the same classes ``dk.dist.env()`` uses (torchrun, dk.launch,
Kubeflow, Slurm, MPI); this check only judges the result: a rank outside the world, a
non-numeric ``WORLD_SIZE``, a multi-process job without ``MASTER_ADDR``, a local rank with no GPU
of its own (the ``local_rank % device_count`` trap that silently puts two ranks on one GPU),
torchrun's ``RANK`` contradicting Slurm's ``SLURM_PROCID``, and where in a Slurm job this is.

Usage::

    import os
    from devicekit.hardware.launcher_checks import check_launcher

    print(check_launcher(os.environ, visible_gpus=8).message)
"""

from __future__ import annotations

from collections.abc import Mapping

from devicekit.errors import DistributedError
from devicekit.hardware.check_result import Check
from devicekit.hardware.launchers import (
    DistEnv,
    SlurmEnvironment,
    detect_environment,
    slurm_place,
)
from devicekit.hardware.launchers.base import integer_variable

__all__ = ["check_launcher"]


def check_launcher(env: Mapping[str, str], *, visible_gpus: int | None = None) -> Check:
    """One check over the launcher whose variables are present (and Slurm's job around it)."""
    kind = detect_environment(env)
    place = slurm_place(env)
    try:
        facts = kind.read()
        problem = _problem(env, kind.name, facts, visible_gpus)
    except DistributedError as exc:
        return Check("launcher", "fail", str(exc))
    if problem:
        return Check("launcher", "warn", problem)
    if kind.name != "single":
        described = [f"{kind.name}: {facts.describe()}"]
    elif place.kind == "none":
        described = ["no torchrun, Slurm or MPI variables: a single process"]
    else:
        described = []
    if place.kind != "none":
        described.append(place.describe() if place.kind != "task" else f"in {place.describe()}")
    if place.outside_step:
        described.append(f"one process, a world of one; srun starts the job's {place.job_tasks}"
                         " task(s)")
    return Check("launcher", "pass", "; ".join(described))


def _problem(env: Mapping[str, str], name: str, facts: DistEnv, visible: int | None) -> str | None:
    """A warning about facts that read well but will go wrong; DistributedError for a failure."""
    stray = [n for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE") if n in env]
    if name == "single" and stray:
        for variable in stray:
            integer_variable(env, variable)  # garbage fails, naming the value
        return (f"{', '.join(stray)} set but not both RANK and WORLD_SIZE: dk.dist (and"
                " torch's env:// rendezvous) cannot use them; set both, or unset them")
    if (facts.world_size > 1 and name in ("torchrun", "kubeflow")
            and "TORCHELASTIC_RUN_ID" not in env):
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if missing:
            raise DistributedError(
                f"WORLD_SIZE={facts.world_size} but {' and '.join(missing)} unset;"
                " init_process_group cannot meet the other ranks (use torchrun or"
                " 'devicekit run', which set them)")
    if visible and facts.local_rank >= visible:
        return (f"local rank {facts.local_rank} ({name}) but only {visible} GPU(s) are visible:"
                " ranks would share a GPU (local_rank % device_count); start at most"
                f" {visible} process(es) per node or give each its own GPU")
    if name == "torchrun" and SlurmEnvironment.detect(env):
        slurm = SlurmEnvironment(env).read()
        # srun launching every rank itself: RANK must then be SLURM_PROCID
        if facts.world_size == slurm.world_size and facts.rank != slurm.rank:
            return (f"RANK={facts.rank} but SLURM_PROCID={slurm.rank} with WORLD_SIZE="
                    f"SLURM_NTASKS={facts.world_size}: two ranks may collide; derive RANK from"
                    " SLURM_PROCID")
    return None

