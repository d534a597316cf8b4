"""GPU leases: who holds which GPU, alive exactly as long as the holder process.

A lease is one small JSON file per leased GPU in the lease directory (``DEVICEKIT_LEASE_DIR``,
default ``/tmp/devicekit-leases``). Its holder keeps an exclusive ``flock`` on the file for as
long as the lease lives, so a lease is *live* while that lock is held: a SIGKILLed holder's
kernel locks vanish with it and its GPU is free at once. Stale files (lock gone) are ignored by
readers and removed by the next selection. Choosing a GPU and writing its lease happen under
one directory-wide ``flock`` (:func:`directory_lock`), so two processes selecting at the same
instant never get the same GPU.

The directory is sticky and world-writable like ``/tmp`` (mode 1777) so that every user of the
machine can lease but nobody can delete another user's lease files; a symlinked directory, or
one owned by another non-root user (who could delete or replace anyone's files), is refused.
Files are opened with ``O_NOFOLLOW | O_CLOEXEC``; lease fds are inherited by a child only when
passed explicitly (``subprocess.Popen(..., pass_fds=lease.fds)``), which keeps the lease alive
for the child's lifetime. The holder's user name is taken from the file's owner, not from its
content, so a lease cannot claim to be someone else's.

Usage::

    from devicekit.hardware.leases import Lease, read_leases

    with Lease.acquire(["GPU-5d9b..."], memory=20 * 2**30) as lease:
        print([r.gpu_uuid for r in read_leases()])   # includes ours
    # released: the file is gone

Most code never calls this directly: ``dk.select_gpus`` chooses and leases in one step.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import os
import re
import shlex
import stat
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from devicekit.errors import LeaseError
from devicekit.hardware.lease_directory import (
    DEFAULT_LEASE_DIR,
    LEASE_DIR_ENV,
    OPEN_FLAGS,
    directory_lock,
    lease_dir,
    resolve_directory,
    user_name,
)

__all__ = [
    "LEASE_DIR_ENV",
    "DEFAULT_LEASE_DIR",
    "LeaseRecord",
    "Lease",
    "lease_dir",
    "read_leases",
    "directory_lock",
    "current_command",
]

_SUFFIX = ".lease"
_TMP_PREFIX = ".tmp-"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
_MAX_RECORD = 64 * 1024  # a real record is a few hundred bytes


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds one GPU: the content of one lease file."""

    gpu_uuid: str
    pid: int
    user: str
    host: str
    command: str
    #: when the lease was taken (seconds since the epoch)
    since: float
    #: memory the holder asked for, in bytes (None: the whole GPU)
    memory: int | None
    #: True when other ``share`` leases may use the same GPU within its memory budget
    share: bool

    def describe(self) -> str:
        """``leased by bob (pid 812, python train.py) since 14:02`` (``shared`` for share leases)."""
        when = time.strftime("%H:%M", time.localtime(self.since))
        if time.time() - self.since > 86400:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.since))
        verb = "shared" if self.share else "leased"
        what = f", {_format_bytes(self.memory)} asked" if self.share and self.memory else ""
        command = self.command if len(self.command) <= 40 else self.command[:37] + "..."
        return f"{verb} by {self.user} (pid {self.pid}, {command}{what}) since {when}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def _format_bytes(n: int) -> str:
    from devicekit.units import format_size

    return format_size(n)


def current_command() -> str:
    """This process's command line, e.g. ``python train.py --lr 3e-4`` (shortened to 200 chars)."""
    argv = list(sys.argv) if sys.argv and sys.argv[0] else ["-c"]
    text = shlex.join([Path(sys.executable).name or "python", *argv])
    return text if len(text) <= 200 else text[:197] + "..."


def _lease_files(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError as exc:
        raise LeaseError(f"lease directory {str(path)!r} cannot be listed ({exc.strerror})") from None


def _probe(path: Path) -> tuple[bool, os.stat_result] | None:
    """Open ``path`` safely; return (live, stat) or None when it vanished or is not a lease."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP):
            return None
        if exc.errno == errno.EACCES:  # unreadable: assume live, we cannot tell
            try:
                return True, os.lstat(path)
            except OSError:
                return None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True, info
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False, info
    finally:
        os.close(fd)


def _from_name(path: Path, info: os.stat_result) -> LeaseRecord | None:
    """A record from the file name alone (``<uuid>.<pid>.<token>.lease``) for an unreadable file."""
    parts = path.name[: -len(_SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return LeaseRecord(gpu_uuid=parts[0], pid=int(parts[1]), user=user_name(info.st_uid),
                       host="", command="(unreadable lease file)", since=info.st_mtime,
                       memory=None, share=False)


def _read_record(path: Path, info: os.stat_result) -> LeaseRecord | None:
    # O_NONBLOCK + a fresh fstat: the file's owner may have renamed a FIFO (which would block an
    # open for reading, with the directory lock held) or a huge file over it since the probe
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except PermissionError:  # live but unreadable: still counts, as an exclusive lease
        return _from_name(path, info)
    except OSError:
        return None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or now.st_size > _MAX_RECORD:
            return None
        data: Any = json.loads(os.read(fd, _MAX_RECORD + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    try:
        memory = data.get("memory")
        return LeaseRecord(
            gpu_uuid=str(data["gpu_uuid"]),
            pid=int(data["pid"]),
            user=user_name(info.st_uid),  # the file owner, not what the file claims
            host=str(data.get("host", "")),
            command=str(data.get("command", "")),
            since=float(data.get("since", info.st_mtime)),
            memory=int(memory) if memory is not None else None,
            share=bool(data.get("share", False)),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def read_leases(directory: str | os.PathLike[str] | None = None, *,
                cleanup: bool = False) -> list[LeaseRecord]:
    """Every live lease in the lease directory, oldest first.

    ``cleanup=True`` also deletes stale files (whose holder died) that this user may delete;
    call it only while holding :func:`directory_lock` (selection does), so that a file still
    being written by a live process is never taken for stale.
    """
    path = resolve_directory(directory)
    records: list[LeaseRecord] = []
    for name in _lease_files(path):
        file = path / name
        is_tmp = name.startswith(_TMP_PREFIX)
        if not (name.endswith(_SUFFIX) or (cleanup and is_tmp)):
            continue
        probe = _probe(file)
        if probe is None:
            continue
        live, info = probe
        if not live:
            if cleanup:
                with contextlib.suppress(OSError):  # another user's stale file: theirs to remove
                    os.unlink(file)
            continue
        if is_tmp:
            continue
        record = _read_record(file, info)
        if record is not None:
            records.append(record)
    records.sort(key=lambda r: (r.since, r.gpu_uuid))
    return records


class Lease:
    """Leases on one or more GPUs, held by this process until :meth:`release` or exit.

    ``records`` says what is held; ``fds`` are the locked file descriptors (pass them to a child
    with ``pass_fds`` to keep the lease alive while the child runs). Usable as a context manager.
    """

    def __init__(self, records: list[LeaseRecord], fds: list[int], paths: list[Path]) -> None:
        self.records = list(records)
        self.fds = list(fds)
        self._paths = list(paths)
        self._owner_pid = os.getpid()
        self.released = False
        _LIVE.add(self)

    @classmethod
    def acquire(cls, gpu_uuids: Iterable[str], *, memory: int | None = None, share: bool = False,
                command: str | None = None, directory: str | os.PathLike[str] | None = None,
                ) -> Lease:
        """Lease the GPUs named by uuid, checking under the directory lock that none is taken.

        An exclusive lease conflicts with any live lease on the GPU; a ``share`` lease conflicts
        only with exclusive ones (memory budgets are checked by ``select_gpus``).
        """
        uuids = list(gpu_uuids)
        with directory_lock(directory) as path:
            taken = read_leases(path, cleanup=True)
            for uuid in uuids:
                for record in taken:
                    if record.gpu_uuid == uuid and (not share or not record.share):
                        raise LeaseError(f"GPU {uuid} is already {record.describe()}; choose another GPU")
            return cls.reserve(path, uuids, memory=memory, share=share, command=command)

    @classmethod
    def reserve(cls, directory: Path, gpu_uuids: Iterable[str], *, memory: int | None = None,
                share: bool = False, command: str | None = None) -> Lease:
        """Write and lock the lease files. The caller holds :func:`directory_lock`."""
        records: list[LeaseRecord] = []
        fds: list[int] = []
        paths: list[Path] = []
        user = user_name(os.geteuid())
        host = os.uname().nodename
        cmd = command if command is not None else current_command()
        now = time.time()
        try:
            for uuid in gpu_uuids:
                record = LeaseRecord(gpu_uuid=uuid, pid=os.getpid(), user=user, host=host,
                                     command=cmd, since=now, memory=memory, share=share)
                fd, final = _write_locked(directory, record)
                records.append(record)
                fds.append(fd)
                paths.append(final)
        except BaseException:
            Lease(records, fds, paths).release()
            raise
        return cls(records, fds, paths)

    @property
    def gpu_uuids(self) -> list[str]:
        return [r.gpu_uuid for r in self.records]

    def release(self) -> None:
        """Give the GPUs back: delete the files and drop the locks. Safe to call twice."""
        if self.released:
            return
        self.released = True
        _LIVE.discard(self)
        if os.getpid() != self._owner_pid:  # a forked child must not drop its parent's lease
            return
        for fd, path in zip(self.fds, self._paths, strict=True):
            with contextlib.suppress(OSError):
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"Lease({self.gpu_uuids!r}, {state})"


def _write_locked(directory: Path, record: LeaseRecord) -> tuple[int, Path]:
    """Write ``record`` atomically: a locked temp file renamed into place; return (fd, path)."""
    token = os.urandom(6).hex()
    name = f"{_SAFE.sub('_', record.gpu_uuid)}.{record.pid}.{token}{_SUFFIX}"
    tmp = directory / f"{_TMP_PREFIX}{token}"
    final = directory / name
    try:
        # private until locked: nobody else can open it and hold a lock that blocks ours
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
    except OSError as exc:
        raise LeaseError(
            f"cannot write a lease in {str(directory)!r} ({exc.strerror}); "
            f"set {LEASE_DIR_ENV} to a writable directory"
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # locked before it has its final name: never seen stale
        os.fchmod(fd, 0o644)  # readable by all users so they can see (and test) the lease
        os.write(fd, record.to_json().encode())
        # no fsync: a lease only matters while its holder runs, and a crash of the machine ends
        # every holder; rename alone makes the complete file appear at once to other processes
        os.rename(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        raise
    return fd, final


_LIVE: set[Lease] = set()


@atexit.register
def _release_all() -> None:
    """At a clean exit, delete our files (the locks would vanish anyway; this removes clutter)."""
    for lease in list(_LIVE):
        lease.release()
