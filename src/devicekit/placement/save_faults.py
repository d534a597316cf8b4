"""Faults during a checkpoint save, said plainly, and the debris of killed saves cleaned up.

torch reports a full disk during ``torch.save`` as ``RuntimeError: ... unexpected pos 704 vs
598``; :func:`disk_full` recognises it (``ENOSPC``/``EDQUOT`` anywhere in the error chain, or
less free space on the file system than the checkpoint needs) and says ``no space left on DIR
(needed ~8 MiB, 1.2 MiB free)``. A save holds an exclusive ``flock`` on its temporary file while
it writes (:func:`lock_while_writing`), so a later save can tell a killed save's temporary file
(unlocked) from one being written right now, and :func:`remove_stale_temporaries` deletes the
former: only this user's files, only this checkpoint's ``.NAME.*.tmp``.

Usage::

    from devicekit.placement.save_faults import disk_full, remove_stale_temporaries

    remove_stale_temporaries(Path("ckpt/last.pt"))
    message = disk_full(err, obj, Path("ckpt"))   # None when the error is something else
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["disk_full", "lock_while_writing", "remove_stale_temporaries", "tensor_bytes"]

_FULL = (errno.ENOSPC, errno.EDQUOT)
#: what torch.save writes besides the tensor data (the pickle, zip headers): a rough margin
_OVERHEAD = 64 * 1024


def lock_while_writing(fd: int) -> None:
    """Mark a temporary file as in use (released when it is closed)."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete this user's unlocked ``.NAME.*.tmp`` files next to ``path``; those removed."""
    removed: list[Path] = []
    prefix = f".{path.name}."
    try:
        names = os.listdir(path.parent)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        candidate = path.parent / name
        try:
            fd = os.open(candidate, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a save is writing it now
            with contextlib.suppress(OSError):
                now = os.lstat(candidate)
                if (now.st_ino, now.st_dev) == (info.st_ino, info.st_dev):
                    os.unlink(candidate)
                    removed.append(candidate)
        finally:
            os.close(fd)
    return removed


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor storage in ``obj`` (modules, dicts, lists, tuples), each storage once."""
    import torch

    seen: set[int] = set()
    total = 0
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.nn.Module):
            todo.append(item.state_dict())
        elif isinstance(item, torch.Tensor):
            with contextlib.suppress(Exception):
                storage = item.untyped_storage()
                key = storage.data_ptr() or id(storage)
                if key not in seen:
                    seen.add(key)
                    total += storage.nbytes()
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    return total


def _errnos(err: BaseException) -> set[int]:
    found: set[int] = set()
    seen: BaseException | None = err
    while seen is not None and len(found) < 16:
        if isinstance(seen, OSError) and seen.errno is not None:
            found.add(seen.errno)
        seen = seen.__cause__ or seen.__context__
    return found


def disk_full(err: BaseException, obj: Any, directory: Path) -> str | None:
    """``no space left on DIR (needed ~N, M free)`` when ``err`` came from a full disk, else None."""
    from devicekit.units import format_size

    if not isinstance(err, (OSError, RuntimeError)):
        return None
    needed = tensor_bytes(obj) + _OVERHEAD
    try:
        info = os.statvfs(directory)
        free = info.f_bavail * info.f_frsize
    except OSError:
        free = None
    full = bool(_errnos(err) & set(_FULL)) or (free is not None and free < needed)
    if not full:
        return None
    left = f", {format_size(free)} free" if free is not None else ""
    return f"no space left on {str(directory)!r} (needed ~{format_size(needed)}{left})"
