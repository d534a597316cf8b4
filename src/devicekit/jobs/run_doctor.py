"""``devicekit run``'s hang doctor: watch a torchrun job's ranks, report and stop a hung job.

For a plan that starts torchrun, :meth:`RunDoctor.for_plan` makes a private directory, names it
in the ranks' environment (``DEVICEKIT_HANG_DIR``: ranks record their collectives there, whether
they call ``dk.dist.init`` or torch's own ``init_process_group``, through a ``sitecustomize``
put first on their ``PYTHONPATH``) and asks for torch's Flight Recorder on NCCL groups.
While the job runs, :meth:`RunDoctor.hung` checks the ranks' progress about once a second; on a
hang, :meth:`RunDoctor.report_and_stop` prints the report on stderr, saves it with every rank's
full dump and stops the job, which then exits :data:`HANG_EXIT_CODE`. The dump holds every
thread's stack, and ``--log-dir`` may be a directory other users can write (``/tmp``, a shared
project directory): it goes into a new directory with a random name, mode 0700, made there
(``DIR/devicekit-hang-k3v9x2qa/hang-report.txt``, the file mode 0600, created new: never through
a name planted before; :mod:`devicekit.jobs.private_files`); without ``--log-dir``, or when that
fails, into the private directory, which is then kept. torch's own Flight Recorder dumps (on an
NCCL timeout or error) go to the private directory too, not to ``/tmp/nccl_trace_rank_<N>``.

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
    HangReport,
    HangWatch,
    diagnose,
    save,
)
from devicekit.jobs.private_files import private_directory
from devicekit.parallel import boot

if TYPE_CHECKING:
    from devicekit.jobs.request import RunPlan

__all__ = ["RunDoctor", "record_in", "HANG_EXIT_CODE", "FLIGHT_RECORDER_ENTRIES", "TORCH_DUMP_ENVS",
           "TORCH_DUMP_PREFIX"]

#: where torch's Flight Recorder writes its dump on an NCCL timeout or error (the newer name
#: first; torch's default is the predictable ``/tmp/nccl_trace_rank_<rank>``, opened following
#: symlinks): devicekit switches the recorder on, so it points both into its private directory
TORCH_DUMP_ENVS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
#: the file-name prefix of those dumps (torch appends the rank)
TORCH_DUMP_PREFIX = "nccl_trace_rank_"


class RunDoctor:
    """The hang watch of one ``devicekit run`` job (this node's ranks)."""

    def __init__(self, directory: str, ranks: list[int], hang_timeout: float,
                 log_dir: str | None) -> None:
        self.directory = directory
        self.watch = HangWatch(directory, ranks, hang_timeout)
        self.log_dir = log_dir
        self.stopped = False
        self.checked = 0.0
        #: the report is in ``directory`` (no --log-dir, or saving there failed): keep it
        self.keep = False

    @classmethod
    def for_plan(cls, plan: RunPlan) -> RunDoctor | None:
        """A doctor for a torchrun plan with a hang timeout; sets the ranks' variables."""
        timeout = getattr(plan, "hang_timeout", None)
        if not plan.distributed or not timeout:
            return None
        directory = tempfile.mkdtemp(prefix="devicekit-hang-")
        record_in(plan, directory)
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
        try:
            self.report()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGTERM)

    def report(self) -> None:
        """Print the report on stderr and save the full dump (the job is stopped after it)."""
        limit = self.watch.limit(self.watch.progress())
        report = diagnose(self.directory, self.watch.ranks)
        print(f"devicekit run: no rank made progress for {limit:g} s while a rank waits in a"
              " collective; stopping the job", file=sys.stderr)
        print(report.text, file=sys.stderr)
        self.stopped = True
        try:
            path = self._save(report)
            if path is not None:
                print(f"devicekit run: full dump (every rank's collectives and all thread stacks):"
                      f" {path}", file=sys.stderr)
        finally:
            sys.stderr.flush()

    def _save(self, report: HangReport) -> str | None:
        """The report's path: in a new private directory under --log-dir, else in ours."""
        if self.log_dir:
            fresh = None
            try:  # never a name someone could have taken first: a new 0700 directory
                fresh = private_directory(self.log_dir, "devicekit-hang-")
                return save(report, report.answers, fresh)
            except OSError as exc:
                if fresh is not None:
                    shutil.rmtree(fresh, ignore_errors=True)
                print(f"devicekit run: cannot save the hang report under --log-dir"
                      f" {self.log_dir!r} ({exc.strerror or exc}); keeping it in"
                      f" {self.directory} instead", file=sys.stderr)
        self.keep = True
        try:
            return save(report, report.answers, self.directory)
        except OSError as exc:
            print(f"devicekit run: cannot save the hang report in {self.directory!r}"
                  f" ({exc.strerror or exc}); the report above is all there is", file=sys.stderr)
            return None

    def close(self) -> bool:
        """Remove the directory unless it holds a hang dump; True if the job was stopped hung."""
        dumps = _torch_dumps(self.directory)
        if dumps:  # torch's Flight Recorder wrote its own dump (an NCCL timeout or error)
            print(f"devicekit run: torch's Flight Recorder dump(s) {', '.join(dumps)} are in"
                  f" {self.directory}", file=sys.stderr, flush=True)
        if not (self.keep or dumps):
            shutil.rmtree(self.directory, ignore_errors=True)
        return self.stopped


def record_in(plan: RunPlan, directory: str) -> None:
    """Set the ranks' variables: record collectives in ``directory`` (also ranks that call
    torch's own ``init_process_group``), torch's Flight Recorder and its dumps there."""
    plan.env[HANG_DIR_ENV] = directory
    plan.env[FLIGHT_RECORDER_ENV] = FLIGHT_RECORDER_ENTRIES  # NCCL groups only
    if not any(plan.env.get(name) for name in TORCH_DUMP_ENVS):  # the user's own choice wins
        for name in TORCH_DUMP_ENVS:
            plan.env[name] = os.path.join(directory, TORCH_DUMP_PREFIX)
    # ranks that call torch's own init_process_group record too (boot/sitecustomize.py)
    plan.env["PYTHONPATH"] = os.pathsep.join(
        [boot.DIRECTORY, *filter(None, [plan.env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))])])


def _torch_dumps(directory: str) -> list[str]:
    """The Flight Recorder dumps torch wrote into ``directory`` (see :data:`TORCH_DUMP_ENVS`)."""
    try:
        return sorted(name for name in os.listdir(directory) if name.startswith(TORCH_DUMP_PREFIX))
    except OSError:
        return []


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
