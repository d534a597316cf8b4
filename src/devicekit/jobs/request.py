"""What ``devicekit run`` was asked (:class:`RunRequest`) and what it will start (:class:`RunPlan`).

Shared by :mod:`devicekit.jobs.run` (which builds a plan), :mod:`devicekit.jobs.run_world`
(which reads the request against an outer launcher) and :mod:`devicekit.jobs.supervise`
(which runs a plan), so none of them imports another for its types.

Usage::

    from devicekit.jobs.request import RunRequest

    request = RunRequest(gpus=2, command=["python", "train.py"])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from devicekit.jobs.allocation import Allocation

__all__ = ["RunRequest", "RunPlan", "TORCHRUN_ENTRY"]


@dataclass
class RunRequest:
    """The ``devicekit run`` flags."""

    command: list[str] = field(default_factory=list)
    #: a count, "all", or None (not asked)
    gpus: int | str | None = None
    procs: int | None = None
    #: GPUs each process drives; None: inferred (``--gpus 4 --procs 1`` is one process with 4)
    gpus_per_proc: int | None = None
    min_free_memory: int | str | None = None
    wait: float | None = None
    #: "N" or "MIN:MAX"; None: one node, or what the outer launcher says
    nnodes: str | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    #: explicit GPUs (indices or UUIDs), in the order the ranks get them
    gpu_ids: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    #: percent busy at most: a number, or "0.5%" (a bare 0 < x < 1 is refused as a fraction)
    max_utilization: float | str | None = None
    # torchrun's own options, passed to it
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    standalone: bool = False
    max_restarts: int | None = None
    log_dir: str | None = None
    #: the job's time limit (``"30m"``, seconds), enforced with SIGTERM then SIGKILL; None: the
    #: queue policy's default_time_limit, if any
    time_limit: float | str | None = None
    #: seconds without progress while a rank waits in a collective before the job is stopped
    #: as hung (a report names the rank); None or 0: never
    hang_timeout: float | None = 600.0
    #: after Slurm's warning signal and rank 0's save: ``scontrol requeue $SLURM_JOB_ID``
    requeue: bool = False

    def __post_init__(self) -> None:
        if self.nnodes is not None:
            self.nnodes = str(self.nnodes)
        if self.gpus_per_proc is None:
            self.gpus_per_proc = _inferred_gpus_per_proc(self.gpus, self.procs)


def _inferred_gpus_per_proc(gpus: int | str | None, procs: int | None) -> int:
    """``--gpus 4 --procs 1``: one process driving 4 GPUs (DataParallel, a split model), not an
    error; ``--gpus 4 --procs 2``: 2 each. Without both, or where they do not divide, 1 (the
    allocation then names the mismatch)."""
    count = int(gpus) if isinstance(gpus, int) or (isinstance(gpus, str) and gpus.isdigit()) else None
    if count and procs and procs >= 1 and count % procs == 0:
        return count // procs
    return 1


#: the module ``devicekit run`` starts for several processes or nodes (torchrun underneath)
TORCHRUN_ENTRY = "devicekit.jobs.torchrun_entry"


@dataclass
class RunPlan:
    """What will be started: ``argv`` with ``env``, on ``allocation``; ``notes`` say why."""

    argv: list[str]
    env: dict[str, str]
    allocation: Allocation
    notes: list[str]
    #: a :class:`~devicekit.jobs.time_limit.TimeLimit` to enforce, or None
    time_limit: Any = None
    #: the hang doctor's timeout (torchrun jobs); None: off
    hang_timeout: float | None = None
    #: ``--log-dir``: where a hang report is saved
    log_dir: str | None = None
    #: ``--requeue``: requeue the Slurm job after a warning signal and rank 0's save
    requeue: bool = False
    #: one rank an outer launcher started (``srun -n N devicekit run``): its step's identity
    #: for the hang doctor shared by the node's tasks, and this node's global ranks
    step: str | None = None
    step_ranks: list[int] | None = None

    @property
    def distributed(self) -> bool:
        return TORCHRUN_ENTRY in self.argv
