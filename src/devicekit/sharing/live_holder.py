"""The live process behind a lock whose recorded holder has died.

A lease names the pid that took it (``devicekit run``), and ``/proc/locks`` the pid that took a
``flock``; a child that inherited the locked file descriptor keeps the lock after that pid has
exited. Naming the dead pid would send whoever investigates to a process that does not exist,
while the real holder lives on. :func:`live_holder` finds a live process that has the locked
file open, by looking through ``/proc/<pid>/fd`` (only when the recorded pid is dead, and only
the processes this user may look at).

Usage::

    from devicekit.sharing.live_holder import live_holder, pid_alive

    if not pid_alive(record.pid):
        pid = live_holder(os.stat(lease_file))     # None when no visible process has it open
"""

from __future__ import annotations

import os

__all__ = ["pid_alive", "live_holder"]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def live_holder(info: os.stat_result) -> int | None:
    """The lowest pid of a live process with the file ``info`` (dev, inode) open, or None."""
    try:
        pids = sorted(int(n) for n in os.listdir("/proc") if n.isdigit())
    except OSError:
        return None
    target = (info.st_dev, info.st_ino)
    for pid in pids:
        directory = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(directory)
        except OSError:
            continue  # gone, or another user's process
        for fd in fds:
            try:
                seen = os.stat(f"{directory}/{fd}")
            except OSError:
                continue
            if (seen.st_dev, seen.st_ino) == target and pid_alive(pid):
                return pid
    return None
