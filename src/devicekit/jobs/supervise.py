"""Run a started job's command and supervise it: signals, exit codes, no orphans.

The command runs in its own process group and gets SIGTERM if ``devicekit run`` dies
(``PR_SET_PDEATHSIG``); SIGINT, SIGTERM and SIGHUP are forwarded to its group (killed after
:data:`KILL_AFTER_SECONDS`), except a SIGTERM Slurm sent to every process of the step itself;
Slurm's warnings (SIGUSR1, SIGUSR2) are passed to every rank once and the job goes on
(:mod:`devicekit.jobs.preempt_signals`; ``--requeue``: :mod:`devicekit.jobs.requeue`); on a
terminal it is the foreground group; descendants it leaves behind in other sessions (torchrun's
ranks) are stopped when it exits. The exit code comes back as a shell gives it (128 + N for
death by signal N).

Usage::

    from devicekit.jobs.supervise import execute

    code = execute(plan)          # a RunPlan from devicekit.jobs.run.plan_run (type in jobs.request)
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from devicekit.errors import CommandNotFoundError
from devicekit.hardware.printable import printable
from devicekit.jobs.preempt_signals import (
    WARNING_SIGNALS,
    Caught,
    PreemptSignals,
    child_dispositions,
    deliver,
)
from devicekit.jobs.process_tree import ProcessTree, children_of
from devicekit.jobs.requeue import requeue
from devicekit.jobs.run_doctor import HANG_EXIT_CODE
from devicekit.jobs.step_doctor import doctor_for
from devicekit.sharing.stopped_jobs import StopMarker

if TYPE_CHECKING:
    from devicekit.jobs.request import RunPlan

__all__ = ["execute", "KILL_AFTER_SECONDS"]

#: after forwarding a signal, how long the child may take before its group is killed
KILL_AFTER_SECONDS = 15.0
#: forwarded to the command's process group by a plain handler (SIGTERM: PreemptSignals)
_FORWARDED = (signal.SIGINT, signal.SIGHUP)


def execute(plan: RunPlan) -> int:
    """Start the plan's command, forward signals to its process group, wait; its exit code.

    Every process the command leaves behind, daemons included, is stopped before this returns
    (:mod:`devicekit.jobs.process_tree`), so the leases end with the last of them.
    """
    with ProcessTree() as tree, PreemptSignals(plan.env) as caught:
        return _execute(plan, {**tree.env(), **caught.env()}, caught)


def _say(line: str) -> None:
    print(f"devicekit run: {line}", file=sys.stderr, flush=True)


def _execute(plan: RunPlan, tree_env: dict[str, str], preempt: PreemptSignals) -> int:
    doctor = doctor_for(plan)  # several ranks: a hang is reported and stopped
    try:
        child = subprocess.Popen(
            plan.argv,
            env={**plan.env, **tree_env},
            pass_fds=plan.allocation.lease_fds,
            # setpgid, parent-death signal, signal dispositions: nothing else
            preexec_fn=_agent_setup if plan.distributed else _child_setup,  # noqa: PLW1509
        )
    except OSError as exc:
        if doctor is not None:
            doctor.close()
        raise CommandNotFoundError(
            f"cannot start {plan.argv[0]!r}: {exc.strerror}; check the command after '--'"
        ) from None
    with contextlib.suppress(OSError):
        os.setpgid(child.pid, child.pid)  # also from here, so it holds before we signal
    forwarded: list[float] = []
    signals: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        forwarded.append(time.monotonic())
        signals.append(signum)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signum)

    def take(caught: Caught) -> None:
        """A signal read with its sender: a warning goes to the ranks, SIGTERM to the group."""
        if caught.signo not in WARNING_SIGNALS:
            if caught.reached_ranks:  # Slurm stops every process of the step itself
                forwarded.append(time.monotonic())
                signals.append(caught.signo)
                _say(f"{caught.name} from Slurm to every process of the step: stopping")
            else:
                forward(caught.signo, None)
            return
        if caught.reached_ranks:
            _say(f"{caught.name} from Slurm (time limit or preemption ahead): Slurm gave it to"
                 " every rank itself; the job goes on")
            return
        roots = children_of(child.pid) if plan.distributed else [child.pid]
        sent = deliver(caught.signo, roots)
        where = (f"passed to {len(sent)} process(es) of the ranks" if sent else
                 "no rank has started yet (dk.preempted() will be True in them)")
        _say(f"{caught.name} (Slurm's warning: time limit or preemption ahead): {where};"
             " the job goes on")

    # torchrun starts each rank in a session of its own: the ranks are not in the child's
    # process group, so remember the child's descendants to stop any it leaves behind
    family = _Descendants(child.pid)
    marker = _stop_marker(plan)
    ticks = 0
    limit = plan.time_limit
    if limit is not None:
        limit.start()
    with _terminal_given_to(child.pid), _handlers(forward):
        while True:
            try:
                code = child.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                ticks += 1
                for caught in preempt.poll():
                    take(caught)
                marker.update(child.pid)  # Ctrl-Z: status tells since when the job is stopped
                if ticks % 5 == 1:
                    family.update()
                    _keep_leases(plan)
                if limit is not None:  # run --time: SIGTERM at the limit, SIGKILL after grace
                    limit.check(child.pid)
                if doctor is not None and not forwarded and doctor.hung():
                    doctor.report_and_stop(child.pid)
                    forwarded.append(time.monotonic())
                if forwarded and time.monotonic() - forwarded[0] > KILL_AFTER_SECONDS:
                    family.update()
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(child.pid, signal.SIGKILL)
    preempt.poll()  # what came as the command ended is recorded, not passed on
    marker.clear()
    _reap_group(child.pid)
    family.stop_survivors()
    hung = doctor is not None and doctor.close()  # always closed: it owns a directory
    if plan.requeue and preempt.warned and not hung and preempt.first is not None \
            and (preempt.saved_by(0) or _hosts_rank_zero(plan)):  # the others leave it to that one
        if preempt.terminated:  # scancel (or the limit) after the warning: it must stay stopped
            _say(f"{preempt.first.name}, then SIGTERM (scancel or the time limit): not requeued")
        else:
            preempt.ignore_term()  # scontrol requeue stops this job with SIGTERM: finish first
            _say(requeue(plan.env, saved=preempt.saved_by(0), signal_name=preempt.first.name))
    if hung:
        return HANG_EXIT_CODE
    if limit is not None and limit.reached:
        return limit.exit_code(code)
    if code < 0:
        return 128 - code
    if signals and code != 0 and plan.distributed:
        # torchrun turns a signal into its own exit code 1 (SignalException): give back the
        # shell's 128 + N for the signal that stopped the job, as for a single process
        return 128 + signals[0]
    return code



def _hosts_rank_zero(plan: RunPlan) -> bool:
    """This ``devicekit run`` supervises global rank 0 (as far as its flags tell)."""
    if not plan.distributed:
        return plan.env.get("RANK", "0") == "0"
    argv = plan.argv  # torchrun's options come before --no-python and the command
    options = argv[:argv.index("--no-python")] if "--no-python" in argv else argv
    if "--node-rank" in options:
        where = options.index("--node-rank") + 1
        return where < len(options) and options[where] == "0"
    return "--standalone" in options or "--rdzv-backend" not in options


def _keep_leases(plan: RunPlan) -> None:
    """The job's leases stay in the lease directory while it runs: a removed directory (and
    with it the lease files) is made again with them, so nobody else sees its GPUs as free."""
    lease = getattr(plan.allocation.selection, "lease", None) if plan.allocation else None
    if lease is None:
        return
    for line in lease.restore():
        print(f"devicekit run: {printable(line)}", file=sys.stderr, flush=True)


def _stop_marker(plan: RunPlan) -> StopMarker:
    """The stopped-job marker in the lease directory, for a run that holds leases."""
    if not plan.allocation.lease_fds:
        return StopMarker(None)
    from devicekit.sharing.lease_directory import lease_dir

    return StopMarker(lease_dir())


def _agent_setup() -> None:
    """The same for torchrun's agent, which also ignores Slurm's warnings (until its entry
    point replaces that with a handler, so that its ranks start with the default)."""
    _child_setup()
    child_dispositions(ignore_warnings=True)


def _child_setup() -> None:
    """In the child before exec: its own process group; SIGTERM when ``devicekit run`` dies;
    every signal unblocked."""
    os.setpgid(0, 0)
    child_dispositions()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)


@contextlib.contextmanager
def _handlers(forward: Callable[[int, object], None]) -> Iterator[None]:
    previous = {sig: signal.signal(sig, forward) for sig in _FORWARDED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _terminal_given_to(pgid: int) -> Iterator[None]:
    """Make the child's group the terminal's foreground group so Ctrl-C and pdb reach it."""
    fd = None
    try:
        if sys.stdin is not None and sys.stdin.isatty() and os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp():
            fd = sys.stdin.fileno()
    except (OSError, ValueError):
        fd = None
    if fd is not None:
        with contextlib.suppress(OSError):
            os.tcsetpgrp(fd, pgid)
    try:
        yield
    finally:
        if fd is not None:
            old = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # we are in the background now
            try:
                with contextlib.suppress(OSError):
                    os.tcsetpgrp(fd, os.getpgrp())
            finally:
                signal.signal(signal.SIGTTOU, old)


class _Descendants:
    """The child's descendants seen so far, to stop those that outlive it (orphaned ranks)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.seen: dict[int, object] = {}

    def update(self) -> None:
        import psutil

        try:
            for proc in psutil.Process(self.pid).children(recursive=True):
                self.seen.setdefault(proc.pid, proc)
        except psutil.Error:
            pass

    def stop_survivors(self) -> None:
        """SIGTERM every remembered descendant still running, SIGKILL it after a grace period."""
        import psutil

        alive = []
        for proc in self.seen.values():
            try:  # is_running() also checks the start time: a reused pid is not ours
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:  # type: ignore[attr-defined]
                    proc.terminate()  # type: ignore[attr-defined]
                    alive.append(proc)
            except psutil.Error:
                continue
        _, left = psutil.wait_procs(alive, timeout=3.0)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=1.0)


def _reap_group(pgid: int) -> None:
    """Stop whatever the child left behind in its process group (no orphans)."""
    for sig, pause in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 1.0)):
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.05)
