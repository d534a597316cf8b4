"""Fair share for the GPU queue: recent GPU-hours per user, decayed with a half-life (Slurm's).

When the policy sets ``fair_share_half_life``, every job that held GPUs through ``select_gpus``
(``devicekit run`` included) adds its GPU-hours to its user's usage file in the lease directory,
``usage.<uid>.json`` (one decayed total and when it was decayed; the user is the file's owner).
A waiting ticket's priority gains ``fair_share_weight * 2 ** (-U / S)`` (Slurm's classic
fair-share factor): ``U`` the user's share of all decayed usage, ``S`` the user's share of the
machine (equal shares among the users with usage or waiting tickets). Light users go first
among tickets of equal policy priority; arrival order breaks ties.

Usage is what each user's own jobs wrote, so a user could understate their own usage by editing
their file (there is no daemon to keep the books): fair share is cooperative; quotas are not.
A usage file is decoded by :class:`UsageDocument` (hours finite, at most a million; a time
no later than the file's own change), so no file can make the factors infinite or NaN.

Usage::

    from devicekit.sharing.fair_share import factors, record_usage

    record_usage(directory, gpu_hours=2.5, half_life=7 * 86400)
    print(factors(directory, ["alice", "bob"], half_life=7 * 86400))   # {"alice": 0.3, "bob": 1.0}
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import msgspec

from devicekit.hardware.document_fields import BadDocument, EpochSeconds, decode
from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name

__all__ = ["record_usage", "read_usage", "factors"]

_PREFIX = "usage."
_MAX = 4096


class UsageDocument(msgspec.Struct, frozen=True):
    """A usage file: decayed GPU-hours (at most a million) and when they were decayed."""

    gpu_hours: Annotated[float, msgspec.Meta(ge=0, le=1e6)]
    at: EpochSeconds


def _decayed(hours: float, at: float, now: float, half_life: float) -> float:
    return hours * 0.5 ** (max(now - at, 0.0) / half_life)


def read_usage(directory: Path, half_life: float, now: float | None = None) -> dict[str, float]:
    """Each user's decayed GPU-hours (files whose name and owner disagree are ignored)."""
    now = time.time() if now is None else now
    out: dict[str, float] = {}
    try:
        names = [n for n in os.listdir(directory) if n.startswith(_PREFIX) and n.endswith(".json")]
    except OSError:
        return out
    for name in names:
        uid = name[len(_PREFIX):-len(".json")]
        try:
            fd = os.open(directory / name, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
        except OSError:
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or str(info.st_uid) != uid or info.st_size > _MAX:
                continue
            usage = decode(os.read(fd, _MAX + 1), UsageDocument, limit=_MAX)
        except (OSError, BadDocument):
            continue
        finally:
            os.close(fd)
        at = min(usage.at, info.st_mtime)  # never fresher than the file: no decay dodged
        out[user_name(info.st_uid)] = _decayed(usage.gpu_hours, at, now, half_life)
    return out


def record_usage(directory: Path, gpu_hours: float, half_life: float) -> None:
    """Add ``gpu_hours`` to this user's decayed usage (atomically; errors are ignored: usage is
    bookkeeping, never a reason for a job to fail)."""
    me = os.geteuid()
    now = time.time()
    total = read_usage(directory, half_life, now).get(user_name(me), 0.0) + max(gpu_hours, 0.0)
    tmp = directory / f".tmp-{os.urandom(6).hex()}"
    with contextlib.suppress(OSError):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644)
        try:
            os.fchmod(fd, 0o644)
            os.write(fd, json.dumps({"gpu_hours": total, "at": now}).encode())
        finally:
            os.close(fd)
        try:
            os.rename(tmp, directory / f"{_PREFIX}{me}.json")
        except OSError:
            os.unlink(tmp)


def factors(directory: Path, users: Iterable[str], half_life: float,
            now: float | None = None) -> dict[str, float]:
    """``2 ** (-U / S)`` per user of ``users`` (1.0 for a user without usage)."""
    usage = read_usage(directory, half_life, now)
    everyone = set(usage) | set(users)
    total = sum(usage.values())
    if not everyone:
        return {}
    share = 1.0 / len(everyone)
    return {u: 2.0 ** (-(usage.get(u, 0.0) / total if total > 0 else 0.0) / share)
            for u in everyone}
