"""The launcher ``devicekit run`` itself runs under: srun, mpirun, torchrun, a Kubernetes pod.

``srun devicekit run -- python train.py`` (and mpirun, torchrun, a Kubeflow PyTorchJob pod)
starts ``devicekit run`` once per task; each must join the launcher's job, never start a world
of its own. :func:`detect_outer` reads the variables ``dk.dist.env()`` reads (plus the ``PET_*``
ones Kubeflow sets for torchrun) and says what the launcher decided:

- the launcher started the ranks (``OuterJob.task`` is set: one task per GPU, or one process per
  pod): ``devicekit run`` leases this task's GPU(s) and runs the command as that rank;
- one task per node (``srun --ntasks-per-node=1``, ``mpirun --npernode 1``, a pod): asked for
  several processes, ``devicekit run`` starts torchrun on this node with the launcher's node
  count, node rank and master;
- ``PET_NNODES`` & co. (Kubeflow's variables for torchrun): torchrun on this node, always.

Usage::

    from devicekit.jobs.outer import detect_outer

    outer = detect_outer({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_STEP_ID": "0",
                          "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]"})
    print(outer.describe())   # srun (Slurm): rank 3 of 8, node 0 of 2, master gpu01:...
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from devicekit.errors import LaunchError
from devicekit.hardware.launchers import DistEnv, detect_environment, slurm_place
from devicekit.hardware.launchers.base import integer_variable

__all__ = ["OuterJob", "detect_outer", "refuse_nested_world", "parse_nnodes", "LAUNCHERS",
           "PET_VARIABLES"]

#: what each source is called in messages
LAUNCHERS = {
    "slurm": "srun (Slurm)",
    "mpi": "mpirun (MPI)",
    "torchrun": "torchrun",
    "devicekit": "dk.launch",
    "kubeflow": "a Kubeflow PyTorchJob pod",
    "pet": "a Kubeflow pod (PET_* variables for torchrun)",
}

#: Kubeflow's variables for torchrun (torchrun reads ``PET_<OPTION>`` as the option's default)
PET_VARIABLES = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
                 "PET_NPROC_PER_NODE", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID")


@dataclass(frozen=True)
class OuterJob:
    """What the outer launcher says about the job ``devicekit run`` is part of."""

    source: str
    #: node count: "2", or "MIN:MAX" for an elastic job (PET_NNODES)
    nnodes: str
    node_rank: int | None
    master_addr: str | None
    master_port: int | None
    #: this task's rank facts when the launcher started the ranks itself; None: node level
    task: DistEnv | None = None
    #: PET_NPROC_PER_NODE ("4", "auto", "gpu", "cpu"), None when not set
    nproc_per_node: str | None = None
    #: False when the master address is a default (no variable named it)
    master_given: bool = True
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None

    @property
    def launcher(self) -> str:
        return LAUNCHERS.get(self.source, self.source)

    @property
    def tasks_per_node(self) -> int:
        return self.task.local_world_size if self.task is not None else 1

    @property
    def max_nodes(self) -> int:
        return parse_nnodes(self.nnodes, self.launcher)[1]

    def describe(self) -> str:
        """One line: who started this process and what it says."""
        master = (f"{self.master_addr}:{self.master_port}" if self.master_addr
                  else self.rdzv_endpoint or "?")
        if self.task is not None:
            t = self.task
            return (f"{self.launcher}: rank {t.rank} of {t.world_size} (local {t.local_rank} of"
                    f" {t.local_world_size}, node {t.node_rank} of {t.nnodes}), master {master}")
        node = f"node {self.node_rank} of {self.nnodes}" if self.node_rank is not None \
            else f"{self.nnodes} node(s)"
        return f"{self.launcher}: {node}, master {master}"


def parse_nnodes(value: str, where: str = "--nnodes") -> tuple[int, int]:
    """``"2"`` -> (2, 2), ``"1:4"`` -> (1, 4); a one-line error for anything else."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(value))
    if match is None:
        raise LaunchError(f"{where} {value!r} is not a node count (N, or MIN:MAX for an elastic job)")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if not 1 <= low <= high:
        raise LaunchError(f"{where} {value!r} must be N >= 1, or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def detect_outer(environ: Mapping[str, str]) -> OuterJob | None:
    """The launcher this process runs under, or None (a plain shell, or a world of one)."""
    pet = _pet(environ)
    if pet is not None:
        return pet
    kind = detect_environment(environ)
    if kind.name == "single":
        place = slurm_place(environ)
        if place.outside_step:
            _refuse_outside_step_over_nodes(environ, place.where)
        return None
    facts = kind.read()  # a one-line DistributedError when the variables are bad
    if facts.world_size <= 1:
        return None
    given = "MASTER_ADDR" in environ or (
        kind.name == "slurm" and bool(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")))
    return OuterJob(kind.name, str(facts.nnodes), facts.node_rank, facts.master_addr,
                    facts.master_port, task=facts, master_given=given)


def _pet(environ: Mapping[str, str]) -> OuterJob | None:
    """Kubeflow's PET_* variables: torchrun is to run on this node (not inside a rank of it)."""
    if not any(name in environ for name in PET_VARIABLES):
        return None
    if "LOCAL_RANK" in environ or "TORCHELASTIC_RUN_ID" in environ:
        return None  # a rank of that torchrun already: its own variables describe it
    nnodes = (environ.get("PET_NNODES") or "1").strip()
    parse_nnodes(nnodes, f"PET_NNODES={nnodes!r}:")
    if environ.get("PET_NODE_RANK", "").strip():
        node_rank: int | None = integer_variable(environ, "PET_NODE_RANK")
    elif environ.get("RANK", "").strip() and "PET_RDZV_ENDPOINT" not in environ:
        node_rank = integer_variable(environ, "RANK")  # a PyTorchJob pod: RANK is the pod's index
    else:
        node_rank = None  # elastic: the rendezvous numbers the nodes
    addr = environ.get("PET_MASTER_ADDR") or environ.get("MASTER_ADDR") or None
    port_var = "PET_MASTER_PORT" if environ.get("PET_MASTER_PORT") else "MASTER_PORT"
    port = integer_variable(environ, port_var) if environ.get(port_var) else None
    return OuterJob(
        "pet", nnodes, node_rank, addr, port,
        nproc_per_node=(environ.get("PET_NPROC_PER_NODE") or "").strip() or None,
        master_given=addr is not None,
        rdzv_backend=environ.get("PET_RDZV_BACKEND") or None,
        rdzv_endpoint=environ.get("PET_RDZV_ENDPOINT") or None,
        rdzv_id=environ.get("PET_RDZV_ID") or None,
    )


def _refuse_outside_step_over_nodes(environ: Mapping[str, str], where: str) -> None:
    """The sbatch script (or salloc's shell) is one process on one host: a plain machine (a
    world of one, as ``dk.dist`` also says), but a job over several nodes would use only one."""
    nodes = integer_variable(environ, "SLURM_NNODES", integer_variable(environ, "SLURM_JOB_NUM_NODES", 1))
    if nodes > 1:
        raise LaunchError(
            f"this is {where} of a Slurm job on {nodes} nodes (no srun step), so it runs on one"
            " host only; start it on every node: srun --ntasks-per-node=1 devicekit run ..."
            " (devicekit run then starts torchrun per node)"
        )


def refuse_nested_world(what: str, environ: Mapping[str, str] | None = None) -> None:
    """Refuse to start ranks inside a launcher's world of several (each rank would start a
    world of its own): ``dk.launch`` in an ``srun -n 2`` step, under torchrun or mpirun.

    The rule (docs/many-gpus.md): the launcher that started several ranks owns the world;
    ``dk.launch`` runs only where the launcher started one process per node.
    """
    environ = os.environ if environ is None else environ
    kind = detect_environment(environ)
    facts = kind.read()
    if facts.world_size <= 1:
        return
    if kind.name == "slurm":
        where = f"srun task {facts.rank} of {facts.world_size} in {slurm_place(environ).describe()}"
        fix = (f"let srun start the ranks ('srun -n {facts.world_size} python ...' with"
               " dk.dist.init() in each), or start one task per node (srun -n 1,"
               " --ntasks-per-node=1) and let it start them there")
    else:
        where = f"rank {facts.rank} of {facts.world_size} started by {LAUNCHERS.get(kind.name, kind.name)}"
        fix = "call dk.dist.init() in each rank instead, or start one process per node"
    raise LaunchError(f"{what} runs in {where}: each of the {facts.world_size} ranks would start"
                      f" a world of its own; {fix}")
