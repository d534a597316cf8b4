"""``devicekit run``'s hang doctor: watch a torchrun job's ranks, report and stop a hung job.

For a plan that starts torchrun, :meth:`RunDoctor.for_plan` makes a private directory, names it
in the ranks' environment (``DEVICEKIT_HANG_DIR``: ranks record their collectives there, whether
they call ``dk.dist.init`` or torch's own ``init_process_group``, through a ``sitecustomize``
put first on their ``PYTHONPATH``) and asks for torch's Flight Recorder on NCCL groups.
While the job runs, :meth:`RunDoctor.hung` checks the ranks' progress about once a second; on a
hang, :meth:`RunDoctor.report_and_stop` prints the report on stderr, saves it with every rank's
full dump (under ``--log-dir``, or the private directory, which is then kept) and stops the job,
which then exits :data:`HANG_EXIT_CODE`.

Usage (what :func:`devicekit.jobs.supervise.execute` does)::

    doctor = RunDoctor.for_plan(plan)          # None for a single process or --hang-timeout 0
    ...
    if doctor is not None and doctor.hung():
        doctor.report_and_stop(child.pid)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from devicekit.jobs.hang_report import (
    FLIGHT_RECORDER_ENTRIES,
    FLIGHT_RECORDER_ENV,
    HANG_DIR_ENV,
    HANG_EXIT_CODE,
    HangWatch,
    diagnose,
    save,
)
from devicekit.parallel import boot

if TYPE_CHECKING:
    from devicekit.jobs.request import RunPlan

__all__ = ["RunDoctor", "HANG_EXIT_CODE", "FLIGHT_RECORDER_ENTRIES"]

class RunDoctor:
    """The hang watch of one ``devicekit run`` job (this node's ranks)."""

    def __init__(self, directory: str, ranks: list[int], hang_timeout: float,
                 log_dir: str | None) -> None:
        self.directory = directory
        self.watch = HangWatch(directory, ranks, hang_timeout)
        self.log_dir = log_dir
        self.stopped = False
        self.checked = 0.0

    @classmethod
    def for_plan(cls, plan: RunPlan) -> RunDoctor | None:
        """A doctor for a torchrun plan with a hang timeout; sets the ranks' variables."""
        timeout = getattr(plan, "hang_timeout", None)
        if not plan.distributed or not timeout:
            return None
        directory = tempfile.mkdtemp(prefix="devicekit-hang-")
        plan.env[HANG_DIR_ENV] = directory
        plan.env[FLIGHT_RECORDER_ENV] = FLIGHT_RECORDER_ENTRIES  # NCCL groups only
        # ranks that call torch's own init_process_group record too (boot/sitecustomize.py)
        plan.env["PYTHONPATH"] = os.pathsep.join(
            [boot.DIRECTORY, *filter(None, [plan.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))])])
        return cls(directory, _local_ranks(plan), float(timeout), getattr(plan, "log_dir", None))

    def hung(self) -> bool:
        """True once the job made no progress for the hang timeout (checked once a second)."""
        now = time.monotonic()
        if self.stopped or now - self.checked < 1.0:
            return False
        self.checked = now
        found = _ranks_in(self.directory)
        if len(found) == len(self.watch.ranks):  # the ranks torchrun's rendezvous gave this node
            self.watch.ranks = found
        return self.watch.hung()

    def report_and_stop(self, pgid: int) -> None:
        """Print the report, save the full dump, SIGTERM the job's process group."""
        limit = self.watch.limit(self.watch.progress())
        report = diagnose(self.directory, self.watch.ranks)
        where = os.path.join(self.log_dir, f"devicekit-hang-{int(time.time())}") if self.log_dir \
            else self.directory
        path = save(report, report.answers, where)
        print(f"devicekit run: no rank made progress for {limit:g} s while a rank waits in a"
              " collective; stopping the job", file=sys.stderr)
        print(report.text, file=sys.stderr)
        print(f"devicekit run: full dump (every rank's collectives and all thread stacks): {path}",
              file=sys.stderr, flush=True)
        self.stopped = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)

    def close(self) -> bool:
        """Remove the directory unless it holds a hang dump; True if the job was stopped hung."""
        if not self.stopped or self.log_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
        return self.stopped


def _ranks_in(directory: str) -> list[int]:
    """The ranks that wrote their pid file into ``directory``."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        middle = name[len("rank"):-len(".pid")]
        if name.startswith("rank") and name.endswith(".pid") and middle.isdigit():
            found.append(int(middle))
    return sorted(found)


def _local_ranks(plan: RunPlan) -> list[int]:
    """This node's global ranks: node rank x processes per node, onwards (static rendezvous)."""
    nprocs = plan.allocation.nprocs
    argv = plan.argv
    node = 0
    if "--node-rank" in argv:
        with contextlib.suppress(ValueError, IndexError):
            node = int(argv[argv.index("--node-rank") + 1])
    return list(range(node * nprocs, node * nprocs + nprocs))
