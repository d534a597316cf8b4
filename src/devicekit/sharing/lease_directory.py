"""The lease directory: where leases live, whether it is safe, and its directory-wide lock.

``DEVICEKIT_LEASE_DIR`` (default ``/tmp/devicekit-leases``) is created sticky and world-writable
(mode 1777, like ``/tmp``) so every user of the machine can lease but nobody can delete another
user's lease files. A symlinked directory, a non-directory, one writable by others without the
sticky bit, or one owned by another user who is not root (even shared, mode 1777: its owner
could delete everyone's lease files and take their GPUs) is refused with
:class:`~devicekit.errors.LeaseError` naming it, its owner and the fix. The lock file ``.lock`` is what
devicekit before per-device locks serialised choose-and-reserve with; reservations now lock one
device at a time (:mod:`~devicekit.sharing.device_locks`) and hold ``.lock`` only shared, for a
moment, to keep such old versions out; :func:`directory_lock` still takes it exclusively.

The first user to lease creates the default directory and so owns it; every other user is then
refused (and ``devicekit doctor`` fails the check) until an admin creates the directory as root
(``sudo install -d -m 1777 /tmp/devicekit-leases``) or they set ``DEVICEKIT_LEASE_DIR``.

Usage::

    from devicekit.sharing.lease_directory import directory_lock, lease_dir

    print(lease_dir())                  # /tmp/devicekit-leases
    with directory_lock() as path:      # no devicekit reserves GPUs meanwhile (waits, 30 s at most)
        ...
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pwd
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from devicekit.errors import LeaseError

__all__ = ["LEASE_DIR_ENV", "DEFAULT_LEASE_DIR", "OPEN_FLAGS", "lease_dir", "check_directory",
           "resolve_directory", "directory_lock", "user_name"]

LEASE_DIR_ENV = "DEVICEKIT_LEASE_DIR"
DEFAULT_LEASE_DIR = "/tmp/devicekit-leases"
#: every lease-related open: never follow a symlink, never leak into an exec'd child
OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_NAME = ".lock"


def user_name(uid: int) -> str:
    """The login name of ``uid`` (the number as text when it has none)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def lease_dir() -> Path:
    """The lease directory, created (mode 1777) if missing and checked for safety.

    Raises :class:`~devicekit.errors.LeaseError` when it is a symlink, not a directory, owned by
    another user who is not root, or writable by others without the sticky bit.
    """
    raw = os.environ.get(LEASE_DIR_ENV) or DEFAULT_LEASE_DIR
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise LeaseError(
            f"lease directory {str(path)!r} cannot be created ({exc.strerror}); "
            f"set {LEASE_DIR_ENV} to a writable directory"
        ) from None
    else:
        # chmod after mkdir so the umask cannot narrow it; the sticky bit keeps files private
        os.chmod(path, 0o1777)
    check_directory(path)
    return path


def check_directory(path: Path) -> None:
    """Raise :class:`LeaseError` unless ``path`` is a safe lease directory (see module doc)."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise LeaseError(f"lease directory {str(path)!r} cannot be read ({exc.strerror})") from None
    fix = f"set {LEASE_DIR_ENV} to a directory of your own, or ask an admin to run 'sudo install -d -m 1777 {path}'"
    if stat.S_ISLNK(info.st_mode):
        raise LeaseError(f"lease directory {str(path)!r} is a symlink, which devicekit never follows; {fix}")
    if not stat.S_ISDIR(info.st_mode):
        raise LeaseError(f"lease directory {str(path)!r} is not a directory; {fix}")
    if info.st_uid not in (0, os.geteuid()):
        # even mode 1777: its owner may delete anyone's lease files and take their GPUs
        raise LeaseError(
            f"lease directory {str(path)!r} is owned by {user_name(info.st_uid)}, who could delete "
            f"your lease files and take your GPUs while your job runs; ask an admin to create it "
            f"as root ('sudo install -d -m 1777 {path}'), or set {LEASE_DIR_ENV} to a directory "
            "of your own"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise LeaseError(
            f"lease directory {str(path)!r} is writable by others without the sticky bit, so "
            f"anyone could delete leases; run 'chmod +t {path}' or {fix}"
        )


def resolve_directory(directory: str | os.PathLike[str] | None) -> Path:
    """``directory`` checked for safety, or the configured lease directory when None."""
    if directory is None:
        return lease_dir()
    path = Path(directory)
    check_directory(path)
    return path


@contextlib.contextmanager
def directory_lock(directory: str | os.PathLike[str] | None = None, *,
                   timeout: float = 30.0) -> Iterator[Path]:
    """Hold the directory-wide ``.lock`` exclusively: no devicekit reserves meanwhile.

    Selection no longer needs it (per-device locks keep choose-and-reserve atomic); a
    reservation waits for it half a second at most, so holding it stops nobody's leasing.
    Yields the lease directory. Raises :class:`LeaseError` if the lock cannot be had within
    ``timeout`` seconds (a process is stuck holding it).
    """
    path = resolve_directory(directory)
    lock_path = path / _LOCK_NAME
    try:
        fd = _open_lock(lock_path)
    except OSError as exc:
        raise LeaseError(
            f"lease lock {str(lock_path)!r} cannot be opened ({exc.strerror}); it must be a "
            f"regular readable file (not a symlink); remove it or set {LEASE_DIR_ENV}"
        ) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LeaseError(f"lease lock {str(lock_path)!r} is not a regular file; remove it")
        if info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) != 0o644:
            os.fchmod(fd, 0o644)  # readable by every user, so all of them can lock it
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LeaseError(
                        f"lease lock {str(lock_path)!r} is held by another process for more than "
                        f"{timeout:g} s; find it with 'fuser {lock_path}'"
                    ) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.02)
        try:
            yield path
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock(lock_path: Path) -> int:
    """Open (creating if missing) the lock file without ``O_CREAT`` on an existing file.

    Linux's ``fs.protected_regular`` refuses ``O_CREAT`` on another user's file in a sticky
    world-writable directory even when it exists, so open first and create only if absent.
    """
    while True:
        try:
            return os.open(lock_path, os.O_RDONLY | OPEN_FLAGS)
        except FileNotFoundError:
            pass
        try:
            return os.open(lock_path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644)
        except FileExistsError:
            continue  # another process created it between our two calls


def write_locked(directory: Path, final: Path, payload: bytes, what: str) -> int:
    """Write ``payload`` to ``final`` atomically, locked from before it has that name; the fd.

    The temp file is private (0600) until locked, so nobody else can open it and hold a lock
    that blocks ours; then it becomes readable by all (others read leases and tickets) and is
    renamed into place. No fsync: a lease or ticket matters only while its holder runs, and a
    machine crash ends every holder. The caller keeps the fd open: the lock is the holding.
    """
    tmp = directory / f".tmp-{os.urandom(6).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o600)
    except OSError as exc:
        raise LeaseError(f"cannot write {what} in {str(directory)!r} ({exc.strerror}); "
                         f"set {LEASE_DIR_ENV} to a writable directory") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.fchmod(fd, 0o644)
        if os.write(fd, payload) != len(payload):  # a short write: the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.rename(tmp, final)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        os.close(fd)
        if isinstance(exc, OSError):  # a full disk, a quota, a directory gone: one line
            raise LeaseError(f"cannot write {what} in {str(directory)!r} ({exc.strerror or exc});"
                             f" free space there or set {LEASE_DIR_ENV} to another directory"
                             ) from None
        raise
    return fd
