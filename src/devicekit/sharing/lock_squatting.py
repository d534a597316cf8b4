"""Lock files another user has made unusable: a GPU blocked by squatting, made visible.

A device's lock file (``<uuid>.hold``, :mod:`~devicekit.sharing.device_locks`) that someone
pre-created as a directory, a FIFO or a symlink, or as a file this user cannot open, makes
``devicekit run`` refuse that device. This module finds such files *without* locking anything,
so that ``status`` marks the GPU blocked (naming the owner), ``doctor`` warns with the path,
and ``select`` never offers a GPU that ``run`` would refuse.

Usage::

    from devicekit.sharing.lock_squatting import blocked_devices, squatted_files

    blocked_devices(directory, ["GPU-5d9b..."])   # {"GPU-5d9b...": "blocked: its lock file ..."}
    squatted_files(directory)                      # every unusable lock file, with its owner
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from devicekit.hardware.printable import printable
from devicekit.sharing.device_locks import BUDGET, HOLD, lock_path
from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name

__all__ = ["unusable_lock", "blocked_devices", "squatted_files"]

_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFLNK: "a symlink",
          stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device"}


def unusable_lock(path: Path) -> str | None:
    """Why the lock file ``path`` cannot be used (``"is a directory; it belongs to bob"``), or None.

    A missing file is usable (it is created on first use). Nothing is locked or created.
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be looked at ({exc.strerror})"
    owner = printable(user_name(info.st_uid))
    kind = stat.S_IFMT(info.st_mode)
    if kind != stat.S_IFREG:
        return f"is {_KINDS.get(kind, 'not a regular file')}; it belongs to {owner}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return None
        return f"cannot be opened ({exc.strerror}); it belongs to {owner}"
    os.close(fd)
    return None


def blocked_devices(directory: Path, uuids: Iterable[str]) -> dict[str, str]:
    """Devices among ``uuids`` whose lock file is unusable: uuid -> a reason for ``GPU N: ...``."""
    out: dict[str, str] = {}
    for uuid in uuids:
        path = lock_path(directory, uuid, HOLD)
        why = unusable_lock(path)
        if why is not None:
            out[uuid] = (f"blocked: its lock file {str(path)!r} {why}: ask them or an admin to "
                         "remove it")
    return out


def squatted_files(directory: Path) -> list[str]:
    """Every unusable ``.hold``/``.budget`` file in ``directory``: ``'PATH' is a FIFO; it belongs to X``."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        if not name.endswith((HOLD, BUDGET)):
            continue
        why = unusable_lock(directory / name)
        if why is not None:
            found.append(f"{printable(str(directory / name))!r} {why}")
    return found
