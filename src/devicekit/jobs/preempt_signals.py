"""``devicekit run``'s side of preemption: survive Slurm's warning, pass it to every rank once.

Slurm warns a job with a signal (``--signal=USR1@90``) and stops it with SIGTERM. How far the
signal reaches depends on the form: in an ``srun`` step slurmstepd signals every process of the
step, the ranks in their own sessions included; ``--signal=B:USR1`` (``scancel --batch``)
signals the batch shell alone, ``scancel --full`` the shell's process group; ``kill`` one
process. :class:`PreemptSignals` blocks SIGUSR1, SIGUSR2 and SIGTERM in ``devicekit run``'s main
thread and reads them with ``sigtimedwait``, which names the sender: a signal that came from
slurmstepd inside an srun step has reached the ranks already and is not sent again; any other
is delivered once to every rank that handles it (:func:`deliver`). torchrun's agent and the
guard outlive the warning (:func:`agent_survives_warnings`); the ranks start with the default
disposition, so ``dk.preempted()`` or Lightning installs its handler as without devicekit. The
signal is also written to a marker file in a private directory (``DEVICEKIT_PREEMPT_DIR``),
where ``dk.preempted()`` finds it even if it came before the rank's handler.

Usage (what :func:`devicekit.jobs.supervise.execute` does)::

    with PreemptSignals(environ) as signals:
        for caught in signals.poll():          # each tick of the supervising loop
            if not caught.reached_ranks:
                deliver(caught.signo, rank_pids)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType

from devicekit.placement.preemption import PREEMPT_DIR_ENV, SIGNAL_FILE, saved_file

__all__ = ["PreemptSignals", "Caught", "deliver", "child_dispositions", "agent_survives_warnings",
           "in_srun_step",
           "WARNING_SIGNALS", "CAUGHT_SIGNALS"]

#: Slurm's warnings: passed to the ranks, the job carries on (``--requeue`` acts on these)
WARNING_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
#: what ``devicekit run`` reads with the sender's pid
CAUGHT_SIGNALS = (*WARNING_SIGNALS, signal.SIGTERM)


def in_srun_step(environ: Mapping[str, str]) -> bool:
    """True inside an srun step (a numbered ``SLURM_STEP_ID``), not the batch or extern step."""
    return environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", "")).isdigit()


def _command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as handle:
            return handle.read(64).decode("utf-8", "replace").strip()
    except OSError:
        return ""


@dataclass
class Caught:
    """One signal ``devicekit run`` received."""

    signo: int
    #: the sender's pid (0: unknown, e.g. taken by another thread's handler)
    sender: int
    #: Slurm sent it to every process of the step: the ranks have it already
    reached_ranks: bool

    @property
    def name(self) -> str:
        return signal.Signals(self.signo).name


class PreemptSignals:
    """Read SIGUSR1/SIGUSR2/SIGTERM with their senders while a job runs (see module doc)."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ = dict(os.environ if environ is None else environ)
        self.step = in_srun_step(self.environ)
        self.directory = tempfile.mkdtemp(prefix="devicekit-preempt-")
        self.first: Caught | None = None
        #: a SIGTERM came (then the job is never requeued: it is being stopped)
        self.terminated = False
        self._late: list[int] = []
        self._previous: dict[int, object] = {}
        self._mask: set[int] | None = None

    def env(self) -> dict[str, str]:
        """The variable that tells the ranks where the marker is."""
        return {PREEMPT_DIR_ENV: self.directory}

    def __enter__(self) -> PreemptSignals:
        # a handler as well as the mask: another thread that takes the signal must not die of it
        for sig in CAUGHT_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._other_thread)
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, CAUGHT_SIGNALS)
        return self

    def _other_thread(self, signum: int, _frame: object) -> None:
        self._late.append(signum)

    def poll(self) -> list[Caught]:
        """The signals that came since the last look (never blocks)."""
        found = []
        while True:
            try:
                info = signal.sigtimedwait(CAUGHT_SIGNALS, 0)
            except InterruptedError:
                continue
            if info is None:
                break
            sender = int(info.si_pid)
            found.append(Caught(info.si_signo, sender,
                                self.step and _command_name(sender) == "slurmstepd"))
        while self._late:
            found.append(Caught(self._late.pop(0), 0, False))
        for caught in found:
            self._record(caught)
        return found

    def _record(self, caught: Caught) -> None:
        if caught.signo == signal.SIGTERM:
            self.terminated = True  # scancel, the time limit, a preemption: the job is to end
        if self.first is None:
            self.first = caught
        with contextlib.suppress(OSError):
            path = os.path.join(self.directory, SIGNAL_FILE)
            if not os.path.exists(path):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as handle:
                    handle.write(caught.name)

    def ignore_term(self) -> None:
        """From now on SIGTERM is ignored, also after :meth:`close` (after ``scontrol requeue``,
        Slurm stops the job with it: ``devicekit run`` finishes its clean-up instead)."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a pending one is discarded
        self._previous[signal.SIGTERM] = signal.SIG_IGN

    @property
    def warned(self) -> bool:
        """A warning signal (SIGUSR1/SIGUSR2) came: the job was told to save and stop."""
        return self.first is not None and self.first.signo in WARNING_SIGNALS

    def saved_by(self, rank: int) -> bool:
        """Rank ``rank`` saved a checkpoint with ``dk.save_checkpoint`` after the signal."""
        return os.path.exists(saved_file(self.directory, rank))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Take what is still pending (the job has ended: it is only recorded), unblock, put
        the previous handlers back, remove the directory."""
        if self._mask is not None:
            self.poll()
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
            self._mask = None
        for sig, previous in self._previous.items():
            with contextlib.suppress(TypeError, ValueError):
                signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


def child_dispositions(ignore_warnings: bool = False) -> None:
    """In a child before exec: every signal unblocked (the mask is inherited through exec);
    ``ignore_warnings`` (torchrun's agent): SIGUSR1/SIGUSR2 ignored too."""
    if ignore_warnings:
        for sig in WARNING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, CAUGHT_SIGNALS)


def agent_survives_warnings() -> None:
    """In torchrun's agent (``torchrun_entry``): a handler that does nothing for SIGUSR1 and
    SIGUSR2 instead of ignoring them, so that the agent outlives Slurm's warning while its ranks
    start with the default disposition (an ignored signal stays ignored through exec, and
    Lightning would then take the rank's SIGUSR1 for someone else's and not register its own)."""
    for sig in WARNING_SIGNALS:
        with contextlib.suppress(ValueError, OSError):
            signal.signal(sig, _nothing)


def _nothing(_signum: int, _frame: object) -> None:
    """The agent's handler for Slurm's warnings: devicekit run passes them to the ranks."""


def _dispositions(pid: int) -> tuple[int, int] | None:
    """(ignored, caught) signal masks of ``pid`` from /proc, or None where it has gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as handle:
            text = handle.read(8192).decode("ascii", "replace")
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["SigIgn"].strip(), 16), int(fields["SigCgt"].strip(), 16)
    except (KeyError, ValueError):
        return None


def deliver(signo: int, roots: Iterable[int],
            children: Callable[[int], Iterable[int]] | None = None) -> list[int]:
    """Send ``signo`` once to each rank in ``roots`` that handles it; the pids signalled.

    A rank that does not handle it (a wrapper shell, ``sh -c 'python train.py'``, or a command
    that never asked) is passed over for the first processes below it that do, so the signal
    reaches the Python that asked for it, never kills one that did not, and never reaches the
    DataLoader workers under a rank that handles it itself.
    """
    from devicekit.jobs.process_tree import children_of

    below = children or children_of
    bit = 1 << (signo - 1)
    sent: list[int] = []
    todo = list(roots)
    seen: set[int] = set()
    while todo:
        pid = todo.pop(0)
        if pid in seen:
            continue
        seen.add(pid)
        masks = _dispositions(pid)
        if masks is None:
            continue
        _ignored, caught = masks
        if not caught & bit:  # ignores it, or would die of it: not a process that asked
            todo.extend(below(pid))
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signo)
            sent.append(pid)
    return sent
