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
handlers. ``devicekit run`` passes the warning only to ranks that handle it, and leaves a
marker file (``DEVICEKIT_PREEMPT_DIR``) that :func:`preempted` checks, so a warning that came
before the handlers were in place is not lost. In a job with a process group, :func:`preempted` is one
small all_reduce, so that every rank stops at the same step (call it at the same points on
every rank). A checkpoint saved with ``dk.save_checkpoint`` after the flag is set is noted
there too: ``devicekit run --requeue`` requeues the job only once rank 0 has saved one.
Standard library only, and torch where a process group exists.

Usage::

    import devicekit as dk

    dk.on_preempt(lambda name: print(f"got {name}, saving"))
    for step in range(start, steps):
        train_step()
        if dk.preempted():        # a flag; with a process group, one all_reduce of one number
            dk.save_checkpoint(state, f"ckpt/step{step:06d}.pt")
            break
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
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


def _agreed(name: str | None) -> str | None:
    """Every rank's answer, the same on all: the highest signal any rank got (one all_reduce of
    one number), where a process group of several ranks exists; else this process's own."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() \
            or dist.get_world_size() < 2:
        return name
    import torch

    mine = int(signal.Signals[name]) if name else 0
    device = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([mine], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    agreed = int(flag.item())
    if agreed and _state["signal"] is None:
        _state["signal"] = signal.Signals(agreed).name  # another rank got it: so do we, now
    return signal.Signals(agreed).name if agreed else None


def preempted(sync: bool = True) -> bool:
    """True once a preemption signal reached this rank (with ``sync``, any rank of the process
    group); runs :func:`on_preempt` functions once.

    Call it from the training loop (each step, or every few). With a process group of several
    ranks it is a collective: every rank must call it at the same points, and all get the same
    answer (one all_reduce of one number), so all save and stop at the same step even if the
    signal reached them between two steps. ``sync=False``: this process's own flag only, no
    collective. Besides that, a flag check plus one ``open`` of ``devicekit run``'s marker
    file while no signal has come.
    """
    name = preempt_signal()
    if sync:
        name = _agreed(name)
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
