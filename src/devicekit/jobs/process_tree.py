"""``devicekit run`` owns its command's whole process tree, daemons included.

A command may leave processes behind that escape its process group and session (``setsid``, a
double fork, torchrun's ranks): they inherit the lease file descriptors, so they would keep the
GPUs held after ``run`` exits, under a holder that no longer exists. :class:`ProcessTree` makes
``devicekit run`` a child subreaper (``PR_SET_CHILD_SUBREAPER``) for the time the command runs:
every orphaned descendant is re-parented to ``run`` instead of init, so it stays findable.
When the command exits, :meth:`ProcessTree.end` sends SIGTERM to every descendant started since
(never to children the caller had before), SIGKILL after a grace period, and reaps them; the
lease is released only after that. The other direction, ``run`` killed (even SIGKILL), is the
parent-death signal every process started here gets (:func:`die_with_parent`).

Usage::

    from devicekit.jobs.process_tree import ProcessTree

    with ProcessTree() as tree:
        child = subprocess.Popen(argv, preexec_fn=die_with_parent)
        child.wait()
        left = tree.end(grace=3.0)      # pids that had to be stopped
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from types import TracebackType

__all__ = ["ProcessTree", "die_with_parent", "children_of", "GRACE_SECONDS", "TOKEN_ENV"]

#: how long descendants left behind get between SIGTERM and SIGKILL
GRACE_SECONDS = 3.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child before exec: get ``sig`` when the process that started it dies."""
    _prctl(_PR_SET_PDEATHSIG, int(sig))


def _subreaper() -> int:
    """This process's current subreaper flag (0 where it cannot be read)."""
    if not sys.platform.startswith("linux"):
        return 0
    flag = ctypes.c_int(0)
    try:
        ctypes.CDLL(None).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    except (OSError, AttributeError):
        return 0
    return flag.value


def _children(pid: int) -> set[int]:
    """Direct children of ``pid`` from /proc (every thread's ``children`` list)."""
    found: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid``, in pid order (from /proc; [] where it has gone)."""
    return sorted(_children(pid))


def _descendants(pid: int, skip: set[int]) -> set[int]:
    """Every descendant of ``pid``, leaving out the subtrees rooted at ``skip``."""
    seen: set[int] = set()
    todo = [c for c in _children(pid) if c not in skip]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        todo.extend(c for c in _children(current) if c not in seen)
    return seen


def _reap(pids: set[int]) -> set[int]:
    """Collect the exit status of every child among ``pids`` that ended; those still alive."""
    alive = set()
    for pid in pids:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not our child (a grandchild): is it still there?
            done = 0 if _exists(pid) else pid
        except OSError:
            done = pid
        if done == 0:
            alive.add(pid)
    return alive


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


#: the variable that marks every process of one ``devicekit run`` (for the guard)
TOKEN_ENV = "DEVICEKIT_RUN_TOKEN"

# The guard: a tiny process (no devicekit import) that waits for EOF on its stdin, the read end
# of a pipe only ``devicekit run`` holds. EOF means run has exited, normally or by SIGKILL; the
# guard then stops every process still marked with the run's token (normally none is left).
# It ignores the signals Slurm sends to every process of a step (SIGUSR1 warnings, scancel's
# SIGTERM): it must outlive the job's processes to stop those left behind.
_GUARD = """
import os, signal, sys, time
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
    signal.signal(sig, signal.SIG_IGN)  # Slurm signals every process: the guard outlives them
token = sys.argv[1].encode()
sys.stdin.buffer.read()
def marked():
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as f:
                if token in f.read().split(b"\\0"):
                    found.append(int(name))
        except OSError:
            pass
    return found
for sig, pause in ((signal.SIGTERM, float(sys.argv[2])), (signal.SIGKILL, 5.0)):
    pids = marked()
    if not pids:
        break
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    end = time.monotonic() + pause
    while time.monotonic() < end and marked():
        time.sleep(0.05)
"""


class ProcessTree:
    """Own every process started while it is active (see module doc)."""

    def __init__(self) -> None:
        self.me = os.getpid()
        self.before: set[int] = set()
        self.previous = 0
        self.active = False
        self.token = f"{os.getpid()}-{os.urandom(8).hex()}"
        self.guard: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The variable that marks the command's processes (add it to the command's env)."""
        return {TOKEN_ENV: self.token}

    def __enter__(self) -> ProcessTree:
        self.before = _children(self.me)  # the caller's own children are never touched
        self.previous = _subreaper()
        self.active = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
        self._start_guard()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.end()
        finally:
            if self.active and not self.previous:
                _prctl(_PR_SET_CHILD_SUBREAPER, 0)
            self._stop_guard()

    def _start_guard(self) -> None:
        """The guard that stops the command's processes if this process dies (even SIGKILL)."""
        if not sys.platform.startswith("linux"):
            return
        try:
            self.guard = subprocess.Popen(
                [sys.executable, "-S", "-c", _GUARD, f"{TOKEN_ENV}={self.token}",
                 str(GRACE_SECONDS)],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)  # Ctrl-C on the terminal must not reach it
        except OSError:
            self.guard = None
        else:
            self.before.add(self.guard.pid)  # never stopped by end()

    def _stop_guard(self) -> None:
        if self.guard is None:
            return
        with contextlib.suppress(OSError):
            self.guard.stdin.close()  # type: ignore[union-attr]  # EOF: it finds nothing, exits
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.guard.wait(timeout=10)

    def left(self) -> set[int]:
        """Descendants started since :meth:`__enter__` that are still running."""
        return {p for p in _descendants(self.me, self.before) if _exists(p)}

    def end(self, grace: float = GRACE_SECONDS) -> list[int]:
        """SIGTERM every descendant left, SIGKILL after ``grace`` s, reap; the pids stopped."""
        stopped: set[int] = set()
        for sig, pause in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            left = self.left()
            if not left:
                break
            stopped |= left
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + pause
            while time.monotonic() < deadline:
                self._reap_children()
                if not self.left():
                    break
                time.sleep(0.02)
        self._reap_children()
        return sorted(stopped)

    def _reap_children(self) -> None:
        """Reap zombies re-parented to us (a subreaper must, or they stay as zombies)."""
        _reap(_children(self.me) - self.before)
