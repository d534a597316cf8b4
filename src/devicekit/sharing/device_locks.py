"""Per-device lock files: holding a device's lock *is* holding the device.

Each GPU (or MIG instance) has two lock files in the lease directory, created on first use and
never deleted: ``<uuid>.hold`` and ``<uuid>.budget``. An exclusive lease holds an exclusive
``flock`` on ``.hold``; a ``share`` lease holds a shared one (so exclusive and shared holders
exclude each other, and shared holders coexist). ``.budget`` is taken exclusively for the few
milliseconds in which a share lease checks the GPU's memory budget. Every lock is tried without
blocking: a lock someone holds makes *that* device busy and nothing else, so no single lock can
stop everyone's leasing. Holders are found (and named in ``devicekit status``) through
``/proc/locks``, which lists each ``flock`` with its pid, without taking any lock.

The old directory-wide lock ``.lock`` (devicekit before per-device locks) is still honoured for
a moment (:func:`legacy_handshake`): an old version choosing GPUs holds it for milliseconds, so
a new one waits up to half a second for it, with a *shared* lock, then goes on without it.

Usage::

    from devicekit.sharing.device_locks import lock_device, holders

    got = lock_device(directory, "GPU-5d9b...", exclusive=True)
    if isinstance(got, int):      # the fd: close it to give the GPU back
        ...
    print(holders(directory))     # who holds which lock file, from /proc/locks
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shlex
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name
from devicekit.sharing.live_holder import live_holder, pid_alive

__all__ = ["HOLD", "BUDGET", "LockHolder", "lock_path", "lock_device", "holders",
           "legacy_handshake", "LEGACY_PATIENCE"]

HOLD = ".hold"
BUDGET = ".budget"
_LEGACY_NAME = ".lock"
#: seconds a reservation waits for an old devicekit holding the directory-wide ``.lock``
LEGACY_PATIENCE = 0.5
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


def safe_name(uuid: str) -> str:
    """``uuid`` as a file name part (``/`` of old ``MIG-GPU-.../1/0`` names become ``_``)."""
    return _SAFE.sub("_", uuid)


def lock_path(directory: Path, uuid: str, kind: str = HOLD) -> Path:
    """The lock file of device ``uuid`` (``kind``: :data:`HOLD` or :data:`BUDGET`)."""
    return directory / f"{safe_name(uuid)}{kind}"


@dataclass(frozen=True)
class LockHolder:
    """A process holding one of the lock files, as ``/proc/locks`` tells."""

    uuid: str
    kind: str
    pid: int
    exclusive: bool
    user: str
    command: str
    since: float


def _open(path: Path) -> int:
    """Open (creating if missing, readable by all) without following a symlink or blocking.

    ``O_CREAT`` only when absent: ``fs.protected_regular`` refuses it on another user's file in
    a sticky directory even when the file exists.
    """
    while True:
        try:
            return os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NONBLOCK | OPEN_FLAGS,
                         0o644)
        except FileExistsError:
            continue  # another process created it between our two calls
        os.fchmod(fd, 0o644)  # whatever the umask: every user must be able to lock it
        return fd


def _unusable(path: Path, why: str) -> str:
    try:
        owner = user_name(os.lstat(path).st_uid)
    except OSError:
        owner = "?"
    return (f"unusable: its lock file {str(path)!r} {why}; it belongs to {owner}: ask them or an"
            " admin to remove it")


def lock_device(directory: Path, uuid: str, *, exclusive: bool, kind: str = HOLD,
                patience: float = 0.0) -> int | str:
    """Lock ``uuid``'s ``kind`` file without blocking (retrying for ``patience`` seconds).

    Returns the locked fd, or why not: a phrase that reads after ``"GPU X is "`` (``"held by
    ..."``) or starts with ``"unusable:"`` for a lock file that cannot be used at all.
    """
    path = lock_path(directory, uuid, kind)
    deadline = time.monotonic() + patience
    while True:
        try:
            fd = _open(path)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return _unusable(path, "is a symlink")
            return _unusable(path, f"cannot be opened ({exc.strerror})")
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                os.close(fd)
                return _unusable(path, "is not a regular file")
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return _held(directory, uuid, kind)
            import random  # only a held lock needs it (it costs the CLI's cold start)

            time.sleep(random.uniform(0.002, 0.02))
            continue
        except BaseException:
            os.close(fd)
            raise
        try:  # its owner may have replaced the file: a lock on an unlinked inode holds nothing
            now = os.lstat(path)
        except OSError:
            now = None
        if now is not None and (now.st_ino, now.st_dev) == (info.st_ino, info.st_dev):
            return fd
        os.close(fd)


def _held(directory: Path, uuid: str, kind: str) -> str:
    found = [h for h in holders(directory) if h.uuid == safe_name(uuid) and h.kind == kind]
    what = "its share-budget lock" if kind == BUDGET else "its lock file"
    if not found:
        return f"held by another process ({what} is locked)"
    h = found[0]
    return describe_holder(h, what)


def describe_holder(h: LockHolder, what: str = "its lock file") -> str:
    """``held by bob (pid 5, python x.py) through its lock file since 14:02, without a lease``."""
    command = h.command if len(h.command) <= 40 else h.command[:37] + "..."
    when = time.strftime("%H:%M", time.localtime(h.since))
    mode = "" if h.exclusive else " (shared)"
    return f"held by {h.user} (pid {h.pid}, {command}) through {what}{mode} since {when}"


def holders(directory: Path) -> list[LockHolder]:
    """Every process holding a ``.hold``/``.budget`` file of ``directory`` (from ``/proc/locks``).

    Read-only: no lock is taken, so looking never makes a device look busy to a reservation.
    ``[]`` where ``/proc/locks`` cannot be read.
    """
    try:
        with open("/proc/locks", "rb") as f:  # bytes: no codec import (it may be unreadable)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2148689 0 EOF": pid, then major:minor (hex):inode
    locked: dict[tuple[int, int], list[tuple[int, bool]]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or "->" in parts or parts[1] != "FLOCK":
            continue
        try:
            major, minor, inode = parts[5].split(":")
            key = (os.makedev(int(major, 16), int(minor, 16)), int(inode))
            locked.setdefault(key, []).append((int(parts[4]), parts[3] == "WRITE"))
        except ValueError:
            continue
    if not locked:
        return []
    out: list[LockHolder] = []
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    for name in names:
        kind = HOLD if name.endswith(HOLD) else BUDGET if name.endswith(BUDGET) else None
        if kind is None:
            continue
        try:
            info = os.lstat(directory / name)
        except OSError:
            continue
        for pid, exclusive in locked.get((info.st_dev, info.st_ino), []):
            if not pid_alive(pid):  # the locker exited; a child that inherited the fd holds it
                pid = live_holder(info) or pid
            user, command, since = _process(pid)
            out.append(LockHolder(name[: -len(kind)], kind, pid, exclusive, user, command, since))
    return out


def process_facts(pid: int) -> tuple[str, str, float]:
    """(user, command line, start time) of ``pid``; placeholders when it cannot be seen."""
    return _process(pid)


def _process(pid: int) -> tuple[str, str, float]:
    """(user, command line, start time) of ``pid``; placeholders when it cannot be seen."""
    try:
        user = user_name(os.stat(f"/proc/{pid}").st_uid)
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        command = shlex.join([Path(argv[0]).name, *argv[1:]]) if argv else "?"
    except OSError:
        return "?", "(not visible here)", time.time()
    try:
        import psutil

        since = psutil.Process(pid).create_time()
    except Exception:  # gone, or psutil cannot tell: now is the honest lower bound
        since = time.time()
    return user, " ".join(command.split())[:200], since  # one line, even for python -c "..."


@contextlib.contextmanager
def legacy_handshake(directory: Path, patience: float | None = None) -> Iterator[bool]:
    """Keep out an old devicekit (directory-wide ``.lock``) while we reserve, for a moment.

    Takes ``.lock`` *shared* (new versions do not exclude one another) if it can within
    ``patience`` seconds (default :data:`LEGACY_PATIENCE`); yields whether it did. An old
    devicekit holds it exclusively for the milliseconds of its choice, so waiting a moment keeps
    it from choosing what we reserve; a process holding it longer is not choosing, and is not
    waited for.
    """
    try:
        fd = _open(directory / _LEGACY_NAME)
    except OSError:  # a symlink or unreadable: no old devicekit can use it either
        yield False
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            yield False
            return
        deadline = time.monotonic() + (LEGACY_PATIENCE if patience is None else patience)
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                got = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    got = False
                    break
                time.sleep(0.005)
        yield got
    finally:
        os.close(fd)
