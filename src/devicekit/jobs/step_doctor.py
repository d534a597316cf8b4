"""The hang doctor when Slurm starts the ranks: ``srun -n N devicekit run -- python train.py``.

There every task's ``devicekit run`` supervises one rank, so no one of them sees the others.
:class:`StepDoctor` gives the tasks of one step on one node one directory, named by the user,
cluster, job, step and restart (``$TMPDIR/devicekit-hang-<uid>-<cluster>-<job>.<step>.<restart>``,
mode 0700, refused if it is anything but a directory of ours that nobody else can read): every rank
records its collectives there as under torchrun, and every task watches all of the node's
ranks. When the job hangs, the first task to claim the report (an exclusive create) prints and
saves it, naming the rank and its line; then it marks the step stopped, and every task stops
its own rank and exits :data:`HANG_EXIT_CODE` (124), so ``srun`` and the step end with 124 too.

Usage (what :func:`devicekit.jobs.supervise.execute` does)::

    doctor = doctor_for(plan)        # RunDoctor (torchrun), StepDoctor (a task of a step), None
    if doctor is not None and doctor.hung():
        doctor.report_and_stop(child.pid)
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from devicekit.jobs.run_doctor import RunDoctor, record_in

if TYPE_CHECKING:
    from devicekit.jobs.request import RunPlan

__all__ = ["StepDoctor", "doctor_for", "step_directory", "CLAIM_FILE", "STOPPED_FILE"]

#: created (exclusively) by the task that prints the report
CLAIM_FILE = "hang.claim"
#: created once the report is out: every task stops its rank
STOPPED_FILE = "hang.stopped"
#: how long a task waits for the reporting task before it stops its rank anyway
_FOLLOW_SECONDS = 30.0


def doctor_for(plan: RunPlan) -> RunDoctor | None:
    """The hang doctor for ``plan``: torchrun's ranks, one task of a step, or none."""
    if plan.distributed:
        return RunDoctor.for_plan(plan)
    return StepDoctor.for_plan(plan)


def step_directory(step: str, base: str | None = None) -> str | None:
    """The node's directory for ``step`` (made if missing); None if the name is taken by
    something that is not a private directory of this user (it says so on stderr)."""
    path = os.path.join(base or tempfile.gettempdir(), f"devicekit-hang-{os.getuid()}-{step}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        info = os.lstat(path)
    except OSError as exc:
        print(f"devicekit run: no hang doctor for this step: {path}: {exc.strerror}",
              file=sys.stderr, flush=True)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        print(f"devicekit run: no hang doctor for this step: {path} exists and is not a private"
              " directory of yours (someone else made it?)", file=sys.stderr, flush=True)
        return None
    return path


class StepDoctor(RunDoctor):
    """The hang watch one task of an srun step shares with the node's other tasks."""

    def __init__(self, directory: str, ranks: list[int], hang_timeout: float,
                 log_dir: str | None, own_rank: int) -> None:
        super().__init__(directory, ranks, hang_timeout, log_dir)
        self.own_rank = own_rank
        self.following = False
        #: a claim older than this task is a previous run's (a kept directory of a job id reused)
        self.since = time.time() - 60.0

    @classmethod
    def for_plan(cls, plan: RunPlan) -> StepDoctor | None:  # type: ignore[override]
        timeout = plan.hang_timeout
        if not plan.step or not timeout or not plan.step_ranks:
            return None
        directory = step_directory(plan.step)
        if directory is None:
            return None
        record_in(plan, directory)
        own = int(plan.env.get("RANK", plan.step_ranks[0]))
        return cls(directory, list(plan.step_ranks), float(timeout), plan.log_dir, own)

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def hung(self) -> bool:
        """True once the node's ranks hang, or another task has stopped the step as hung."""
        if self.stopped:
            return False
        if self._fresh(STOPPED_FILE) or self._fresh(CLAIM_FILE):
            self.following = True
            return True
        return super().hung()

    def _fresh(self, name: str) -> bool:
        """``name`` exists and was made by this run of the step (not a kept earlier one)."""
        try:
            return os.stat(self._path(name)).st_mtime >= self.since
        except OSError:
            return False

    def report_and_stop(self, pgid: int) -> None:
        """The first task reports (and stops its rank); the others wait for it, then stop."""
        if not self.following and self._claim():
            try:
                self.report()
            finally:  # every rank of the node at once: none dies of another's end, blaming it
                self._stop_ranks(pgid)
                with contextlib.suppress(OSError):
                    os.close(os.open(self._path(STOPPED_FILE), os.O_WRONLY | os.O_CREAT, 0o600))
            return
        deadline = time.monotonic() + _FOLLOW_SECONDS
        while time.monotonic() < deadline and not self._fresh(STOPPED_FILE):
            time.sleep(0.1)  # the reporter is collecting every rank's stack: keep ours alive
        self.stopped = True
        reporter = _read_small(self._path(CLAIM_FILE)) or "another"
        print(f"devicekit run: rank {self.own_rank}: the step hangs (rank {reporter}'s devicekit"
              f" run prints the report); stopping rank {self.own_rank}", file=sys.stderr,
              flush=True)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGTERM)

    def _stop_ranks(self, pgid: int) -> None:
        """SIGTERM every rank of the node (pid files; only processes of this step; our own by
        its group), those waiting in a collective first: they are the ones that would fail,
        with a traceback, on a peer's end; the hung ones do not notice."""
        progress = self.watch.progress()
        order = sorted(self.watch.ranks,
                       key=lambda rank: progress.get(rank, {}).get("state") != "started")
        for rank in order:
            if rank == self.own_rank:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, signal.SIGTERM)
                continue
            pid = _read_small(self._path(f"rank{rank}.pid"))
            if pid and _records_in(int(pid), self.directory):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGTERM)

    def _claim(self) -> bool:
        for name in (CLAIM_FILE, STOPPED_FILE):  # an earlier run's, in a kept directory
            if not self._fresh(name):
                with contextlib.suppress(OSError):
                    os.unlink(self._path(name))
        try:
            fd = os.open(self._path(CLAIM_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return False
        with os.fdopen(fd, "w") as handle:
            handle.write(str(self.own_rank))
        return True

    def close(self) -> bool:
        """Remove this rank's files; the directory goes with the last task, unless it holds a
        hang report or torch's dump. True if the step was stopped as hung."""
        self.stopped = self.stopped or self._fresh(STOPPED_FILE)  # another task stopped it
        prefix = f"rank{self.own_rank}."
        names = _names(self.directory)
        kept = self.keep or any(n.startswith("nccl_trace_rank_") or n == "hang-report.txt"
                                for n in names)
        if not kept:
            for name in names:
                if name.startswith(prefix):
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(name))
            if not any(n.startswith("rank") for n in _names(self.directory)):
                for name in _names(self.directory):
                    with contextlib.suppress(OSError):
                        os.unlink(self._path(name))
                with contextlib.suppress(OSError):
                    os.rmdir(self.directory)
        return self.stopped


def _names(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except OSError:
        return []


def _records_in(pid: int, directory: str) -> bool:
    """``pid`` is a rank that records into ``directory`` (not a pid reused by another process)."""
    from devicekit.parallel.collective_log import HANG_DIR_ENV

    try:
        with open(f"/proc/{pid}/environ", "rb") as handle:
            return f"{HANG_DIR_ENV}={directory}".encode() in handle.read(1 << 20).split(b"\0")
    except OSError:
        return False


def _read_small(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read(24).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""
