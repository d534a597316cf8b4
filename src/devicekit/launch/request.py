"""What ``devicekit run`` was asked (:class:`RunRequest`) and what it will start (:class:`RunPlan`).

Shared by :mod:`devicekit.launch.run` (which builds a plan), :mod:`devicekit.launch.run_world`
(which reads the request against an outer launcher) and :mod:`devicekit.launch.supervise`
(which runs a plan), so none of them imports another for its types.

Usage::

    from devicekit.launch.request import RunRequest

    request = RunRequest(gpus=2, command=["python", "train.py"])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from devicekit.launch.allocation import Allocation

__all__ = ["RunRequest", "RunPlan", "TORCHRUN_ENTRY"]


@dataclass
class RunRequest:
    """The ``devicekit run`` flags."""

    command: list[str] = field(default_factory=list)
    #: a count, "all", or None (not asked)
    gpus: int | str | None = None
    procs: int | None = None
    gpus_per_proc: int = 1
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
    max_utilization: float | None = None
    # torchrun's own options, passed to it
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    standalone: bool = False
    max_restarts: int | None = None
    log_dir: str | None = None
    #: seconds without progress while a rank waits in a collective before the job is stopped
    #: as hung (a report names the rank); None or 0: never
    hang_timeout: float | None = 600.0

    def __post_init__(self) -> None:
        if self.nnodes is not None:
            self.nnodes = str(self.nnodes)


#: the module ``devicekit run`` starts for several processes or nodes (torchrun underneath)
TORCHRUN_ENTRY = "devicekit.launch.torchrun_entry"


@dataclass
class RunPlan:
    """What will be started: ``argv`` with ``env``, on ``allocation``; ``notes`` say why."""

    argv: list[str]
    env: dict[str, str]
    allocation: Allocation
    notes: list[str]
    #: the hang doctor's timeout (torchrun jobs); None: off
    hang_timeout: float | None = None
    #: ``--log-dir``: where a hang report is saved
    log_dir: str | None = None

    @property
    def distributed(self) -> bool:
        return TORCHRUN_ENTRY in self.argv
