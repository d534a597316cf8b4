"""Stopped jobs (Ctrl-Z, SIGSTOP) that hold GPUs: found from /proc, and since when.

Ctrl-Z stops the command's process group, not ``devicekit run`` (which keeps its leases), so a
lease's job is *stopped* when a process under the lease's holder is stopped (state ``T`` or
``t`` in ``/proc/<pid>/stat``). ``devicekit run`` notes the moment it first sees its
command stopped in a small marker file in the lease directory (``.stopped.<run pid>``, removed
when the command resumes or ends), which ``devicekit status`` reads to say since when.

Usage::

    from devicekit.sharing.stopped_jobs import StopMarker, stopped_since

    marker = StopMarker(directory)          # in devicekit run, every supervision tick:
    marker.update(child_pid)
    stopped_since(directory, record.pid, record_uid)    # in status: a time, or None (running)
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from pathlib import Path

from devicekit.sharing.lease_directory import OPEN_FLAGS

__all__ = ["process_state", "job_stopped", "StopMarker", "stopped_since", "marker_path"]

_STOPPED = {"T", "t"}
_MARKER_MAX = 64


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T``, ...), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError, UnicodeDecodeError):
        return None


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        with contextlib.suppress(OSError, ValueError):
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(p) for p in f.read().split())
    return out


def job_stopped(holder: int) -> bool:
    """Whether the job under ``holder`` (its descendants, or itself if it has none) is stopped.

    One stopped process is enough: a job with a stopped process (a rank, the command) makes no
    progress while it holds its GPUs.
    """
    todo, seen = _children(holder), set()
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.add(pid)
            todo.extend(_children(pid))
    states = [process_state(p) for p in (seen or {holder})]
    states = [s for s in states if s is not None and s not in ("Z", "X")]
    return any(s in _STOPPED for s in states)


def marker_path(directory: Path, holder: int) -> Path:
    """The marker file that says since when ``holder``'s job is stopped."""
    return directory / f".stopped.{holder}"


def stopped_since(directory: Path, holder: int, owner_uid: int | None = None) -> float | None:
    """When ``holder``'s job stopped (from its marker, else now), or None when it is not stopped.

    The marker counts only when it is a small regular file owned by ``owner_uid`` (the lease
    file's owner): another user cannot forge the time, and its owner cannot either (the time is
    the file's change time, not its content).
    """
    if not job_stopped(holder):
        return None
    path = marker_path(directory, holder)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except OSError:
        return time.time()
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_size > _MARKER_MAX
                or (owner_uid is not None and info.st_uid != owner_uid)):
            return time.time()
    except OSError:
        return time.time()
    finally:
        os.close(fd)
    # when the marker was made (it is made once, O_EXCL): its change time, which its owner
    # cannot set; never the text in it (a "nan" or "1e300" there crashed everyone's status)
    return min(info.st_ctime, time.time())


class StopMarker:
    """In ``devicekit run``: keep the marker file in step with the command's state."""

    def __init__(self, directory: Path | None, holder: int | None = None) -> None:
        self.path = marker_path(directory, holder or os.getpid()) if directory else None
        self.marked = False

    def update(self, child: int) -> None:
        """Write the marker when ``child``'s job is first seen stopped; remove it on resume."""
        if self.path is None:
            return
        stopped = process_state(child) in _STOPPED
        if stopped and not self.marked:
            self._remove_own_stale()  # an earlier run with this pid that was killed
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644)
                with os.fdopen(fd, "w") as f:
                    f.write(f"{time.time():.3f}\n")
                self.marked = True
        elif not stopped and self.marked:
            self.clear()

    def _remove_own_stale(self) -> None:
        with contextlib.suppress(OSError):
            if self.path is not None and os.lstat(self.path).st_uid == os.geteuid():
                os.unlink(self.path)

    def clear(self) -> None:
        if self.path is not None and self.marked:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            self.marked = False
