"""Doctor check of the launcher variables: torchrun, Slurm and MPI, present and consistent.

Reads only the environment (no torch). Catches the classic set-up mistakes: a rank outside the
world size, a non-numeric ``WORLD_SIZE``, a multi-process job without ``MASTER_ADDR``, a port out
of range, and a ``LOCAL_RANK`` with no GPU of its own (the ``local_rank % device_count`` trap
that silently puts two ranks on one GPU).

Usage::

    import os
    from devicekit.hardware.launcher_checks import check_launcher

    print(check_launcher(os.environ, visible_gpus=8).message)
"""

from __future__ import annotations

from collections.abc import Mapping

from devicekit.hardware.check_result import Check
from devicekit.hardware.slurm_job import is_batch_script

__all__ = ["check_launcher", "LAUNCHER_VARIABLES"]

#: launcher name -> (rank, world size, local rank, local world size) variable names
LAUNCHER_VARIABLES: dict[str, tuple[str, str, str, str | None]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    # SLURM_NTASKS_PER_NODE has forms like "2(x3)": the per-node size is not checked there
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich/intel-mpi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
_PRESENCE = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "slurm": ("SLURM_JOB_ID", "SLURM_PROCID"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    "mpich/intel-mpi": ("PMI_RANK", "PMI_SIZE"),
}


class _Problem(Exception):
    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


def _int(env: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise _Problem("fail", f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise _Problem("fail", f"{name}={raw!r} must be >= {minimum}")
    return value


def _check_one(launcher: str, env: Mapping[str, str], visible_gpus: int | None) -> str:
    rank_var, size_var, local_var, local_size_var = LAUNCHER_VARIABLES[launcher]
    rank = _int(env, rank_var, 0)
    size = _int(env, size_var, 1)
    local = _int(env, local_var, 0)
    local_size = _int(env, local_size_var, 1) if local_size_var else None
    if rank is not None and size is not None and rank >= size:
        raise _Problem("fail", f"{rank_var}={rank} is not below {size_var}={size}; ranks run "
                       f"0..{size - 1}")
    if local is not None and local_size is not None and local >= local_size:
        raise _Problem("fail", f"{local_var}={local} is not below {local_size_var}={local_size}")
    if local is not None and visible_gpus and local >= visible_gpus:
        raise _Problem("warn", f"{local_var}={local} but only {visible_gpus} GPU(s) are visible: "
                       "ranks would share a GPU (local_rank % device_count); start at most "
                       f"{visible_gpus} process(es) per node or give each its own GPU")
    parts = [f"{rank_var}={rank}" if rank is not None else None,
             f"{size_var}={size}" if size is not None else None,
             f"{local_var}={local}" if local is not None else None]
    return f"{launcher}: " + " ".join(p for p in parts if p)


def _check_rendezvous(env: Mapping[str, str]) -> str | None:
    size = _int(env, "WORLD_SIZE", 1)
    port = env.get("MASTER_PORT")
    if port is not None:
        value = _int(env, "MASTER_PORT", 1)
        if value is not None and value > 65535:
            raise _Problem("fail", f"MASTER_PORT={port!r} is not a TCP port (1..65535)")
    if size is not None and size > 1 and "TORCHELASTIC_RUN_ID" not in env:
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if not env.get(n)]
        if missing:
            raise _Problem("fail", f"WORLD_SIZE={size} but {' and '.join(missing)} unset; "
                           "init_process_group cannot meet the other ranks (use torchrun or "
                           "'devicekit run', which set them)")
    if env.get("MASTER_ADDR"):
        return f"master {env['MASTER_ADDR']}:{env.get('MASTER_PORT', '?')}"
    return None


def check_launcher(env: Mapping[str, str], *, visible_gpus: int | None = None) -> Check:
    """One check over every launcher whose variables are present."""
    found = [name for name, keys in _PRESENCE.items() if any(k in env for k in keys)]
    if not found:
        return Check("launcher", "pass", "no torchrun, Slurm or MPI variables: a single process")
    try:
        described = [_check_one(name, env, visible_gpus) for name in found]
        rendezvous = _check_rendezvous(env)
        if "torchrun" in found and "slurm" in found:
            rank, size = _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
            procid, ntasks = _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS", 1)
            # srun launching every rank itself: RANK must then be SLURM_PROCID
            if size is not None and size == ntasks and rank is not None and rank != procid:
                raise _Problem("warn", f"RANK={rank} but SLURM_PROCID={procid} with WORLD_SIZE="
                               f"SLURM_NTASKS={size}: two ranks may collide; derive RANK from "
                               "SLURM_PROCID")
    except _Problem as problem:
        return Check("launcher", problem.status, str(problem))  # type: ignore[arg-type]
    if rendezvous:
        described.append(rendezvous)
    if "slurm" in found and is_batch_script(env):
        described.append(f"the sbatch script itself (no srun step): one process, a world of one;"
                         f" srun starts the job's {env.get('SLURM_NTASKS', '?')} task(s)")
    return Check("launcher", "pass", "; ".join(described))
