"""Preemption in a rank: Slurm's warning signal as a flag the training loop polls.

Slurm warns a job before its time limit or a preemption with a signal (``#SBATCH
--signal=USR1@90``: SIGUSR1 90 s before the end); a preemption or ``scancel`` sends SIGTERM.
:func:`preempted` is True once this process got SIGUSR1, SIGUSR2 or SIGTERM (its first call
installs the handlers); :func:`on_preempt` registers a function to run once, in the thread that
next calls :func:`preempted` (the training loop), never inside the signal handler: the handler
only sets the flag, so a checkpoint is never written in the middle of a collective. SIGTERM
sets the flag instead of killing the process, so a loop that polls can finish its save (what
Lightning does after its USR1); ``devicekit run`` kills what is still running after its grace
period, as Slurm does after ``KillWait``.

Call :func:`preempted` (or :func:`on_preempt`) once before the loop: that installs the
handlers. Under ``devicekit run`` the ranks start with SIGUSR1/SIGUSR2 ignored (a rank that
does not poll is not killed by Slurm's warning), and ``devicekit run`` also leaves a marker file
(``DEVICEKIT_PREEMPT_DIR``) that :func:`preempted` checks, so a warning that came before the
handlers were in place is not lost.
A checkpoint saved with ``dk.save_checkpoint`` after the flag is set is noted there too:
``devicekit run --requeue`` requeues the job only once rank 0 has saved one.
Standard library only.

Usage::

    import devicekit as dk

    dk.on_preempt(lambda name: print(f"got {name}, saving"))
    for step in range(start, steps):
        train_step()
        if dk.preempted():                    # cheap: a flag (and one stat under devicekit run)
            dk.save_checkpoint(state, f"ckpt/step{step:06d}.pt")
            break
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["preempted", "on_preempt", "preempt_signal", "PREEMPT_SIGNALS", "PREEMPT_DIR_ENV",
           "SIGNAL_FILE", "saved_file", "note_saved", "install_handlers"]

#: the signals that mean "save now": Slurm's usual warnings and its SIGTERM
PREEMPT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
#: set by ``devicekit run``: its private directory for the preemption marker and saved notes
PREEMPT_DIR_ENV = "DEVICEKIT_PREEMPT_DIR"
#: the file ``devicekit run`` writes (the signal's name) when it got a preemption signal
SIGNAL_FILE = "signal"

_lock = threading.Lock()
_state: dict[str, Any] = {"signal": None, "installed": False, "previous": {}, "before": {}}
_callbacks: list[Callable[[str], Any]] = []


def _handler(signum: int, frame: Any) -> None:
    """Set the flag; chain a handler that was there before (no other work here)."""
    if _state["signal"] is None:
        _state["signal"] = signal.Signals(signum).name
    previous = _state["previous"].get(signum)
    if callable(previous):
        previous(signum, frame)


def install_handlers() -> bool:
    """Install the flag-setting handlers (main thread only); True if they are in place."""
    if _state["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _state["installed"]:
            return True
        for sig in PREEMPT_SIGNALS:
            try:
                previous = signal.getsignal(sig)
                if previous is _handler:
                    continue
                signal.signal(sig, _handler)
            except (ValueError, OSError):  # an embedded interpreter that owns its signals
                continue
            _state["before"][sig] = previous
            _state["previous"][sig] = previous if callable(previous) else None
        _state["installed"] = True
    return True


def _marker() -> str | None:
    """The signal ``devicekit run`` recorded for this job, or None."""
    directory = os.environ.get(PREEMPT_DIR_ENV)
    if not directory:
        return None
    try:
        with open(os.path.join(directory, SIGNAL_FILE), "rb") as handle:
            text = handle.read(16).decode("ascii", "replace").strip()
    except OSError:
        return None
    return text if text.isalnum() else "SIGUSR1"


def preempt_signal() -> str | None:
    """The name of the preemption signal this process got (``"SIGUSR1"``), or None."""
    install_handlers()
    if _state["signal"] is None:
        _state["signal"] = _marker()
    return _state["signal"]


def preempted() -> bool:
    """True once a preemption signal reached this rank; runs :func:`on_preempt` functions once.

    Call it from the training loop (each step or every few): it is a flag check, plus one
    ``stat`` of ``devicekit run``'s marker file while none has come.
    """
    name = preempt_signal()
    if name is None:
        return False
    while _callbacks:
        with _lock:
            if not _callbacks:
                break
            fn = _callbacks.pop(0)
        fn(name)
    return True


def on_preempt(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    """Run ``fn(signal_name)`` once after a preemption signal, at the next :func:`preempted`
    call (in that caller's thread, never in the signal handler); returns ``fn`` (a decorator)."""
    if not callable(fn):
        from devicekit.errors import InvalidValueError

        raise InvalidValueError(f"on_preempt needs a function, got {fn!r}")
    install_handlers()
    with _lock:
        _callbacks.append(fn)
    return fn


def saved_file(directory: str, rank: int) -> str:
    """The note a rank leaves in ``directory`` once it saved a checkpoint after the signal."""
    return os.path.join(directory, f"saved.{int(rank)}")


def note_saved(path: object) -> None:
    """After a checkpoint save: tell ``devicekit run`` (``--requeue``) that this rank saved one
    after a preemption signal. Does nothing before the signal or outside ``devicekit run``."""
    directory = os.environ.get(PREEMPT_DIR_ENV)
    if not directory or _state["signal"] is None and _marker() is None:
        return
    try:
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        rank = 0
    with contextlib.suppress(OSError):
        fd = os.open(saved_file(directory, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(str(path)[:4096])


def _reset() -> None:
    """Forget the flag and callbacks and put the previous handlers back (for tests)."""
    with _lock:
        if _state["installed"] and threading.current_thread() is threading.main_thread():
            for sig, before in _state["before"].items():
                with contextlib.suppress(ValueError, OSError, TypeError):
                    signal.signal(sig, before if before is not None else signal.SIG_DFL)
        _state.update(signal=None, installed=False, previous={}, before={})
        _callbacks.clear()
