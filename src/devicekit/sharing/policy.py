"""The queue's policy, set by an admin in ``policy.toml`` in the lease directory.

Honoured only when owned by root or by the lease directory's owner and writable by nobody else
(any user can create files in the shared directory; a policy anyone could write would be
anyone's). Otherwise, or when malformed, the queue runs without a policy and ``note`` says why
(``devicekit queue`` shows it). At most 64 KiB, parsed as TOML data only.

::

    # /tmp/devicekit-leases/policy.toml
    max_gpus_per_user = 2          # GPUs one user may hold at once (held + asked)
    default_time_limit = "4h"      # for jobs that declare none (run --time); enforced by run
    time_limit_grace = "30s"       # between SIGTERM and SIGKILL at a time limit
    fair_share_half_life = "7d"    # order by recent GPU-hours, decayed (off when absent)
    fair_share_weight = 10         # priority points a user without recent usage gets

    [users.alice]
    max_gpus = 4                   # alice's own quota
    priority = 10                  # higher goes first; equal priorities keep arrival order

Usage::

    from devicekit.sharing.policy import load_policy

    policy = load_policy(directory)
    print(policy.max_gpus_per_user, policy.note)
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devicekit.errors import InvalidValueError
from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name

__all__ = ["Policy", "load_policy", "parse_duration", "POLICY_NAME", "DEFAULT_GRACE"]

POLICY_NAME = "policy.toml"
#: seconds between SIGTERM and SIGKILL when a time limit is reached (policy: time_limit_grace)
DEFAULT_GRACE = 10.0
_MAX_POLICY = 64 * 1024
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True)
class Policy:
    """What the admin set (all optional); ``note`` says why a file was not used."""

    max_gpus_per_user: int | None = None
    default_time_limit: float | None = None
    time_limit_grace: float = DEFAULT_GRACE
    #: user -> own GPU quota
    user_limits: dict[str, int] = field(default_factory=dict)
    #: user -> priority (higher first)
    priorities: dict[str, float] = field(default_factory=dict)
    #: seconds; fair share is on when set (see :mod:`~devicekit.sharing.fair_share`)
    fair_share_half_life: float | None = None
    fair_share_weight: float = 10.0
    note: str = ""
    path: str = ""


def parse_duration(value: Any, *, name: str = "--time") -> float:
    """``"30m"``, ``"90s"``, ``"2h"``, ``"1d"``, ``"1:30:00"`` (H:MM:SS) or ``"5:00"`` (M:SS) -> s.

    A bare number is refused (Slurm reads it as minutes, most tools as seconds): say which.
    """
    bare = False
    seconds = 0.0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        text = str(value).strip().lower()
        try:
            if ":" in text:
                parts = [float(p) for p in text.split(":")]
                if len(parts) > 3 or any(p < 0 for p in parts):
                    raise ValueError
                seconds = 0.0
                for part in parts:
                    seconds = seconds * 60 + part
            elif text[-1:] in _UNITS:
                seconds = float(text[:-1]) * _UNITS[text[-1]]
            else:
                float(text)  # a bare number: said below, with the units to choose
                bare = True
        except (ValueError, IndexError):
            raise InvalidValueError(f"{name} {value!r} is not a duration like 90s, 30m, 2h or"
                                    " 1:30:00") from None
    if bare:
        text = str(value).strip()
        raise InvalidValueError(f"{name} {value!r} needs a unit: {text}s, {text}m or {text}h")
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise InvalidValueError(f"{name} {value!r} must be a duration > 0")
    return seconds


def load_policy(directory: Path) -> Policy:
    """The policy of lease directory ``directory`` (an empty one when there is no usable file)."""
    path = directory / POLICY_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except FileNotFoundError:
        return Policy()
    except OSError as exc:
        return Policy(note=f"{path} ignored: cannot be opened ({exc.strerror})")
    try:
        info = os.fstat(fd)
        owner_ok = info.st_uid in (0, os.stat(directory).st_uid)
        if not stat.S_ISREG(info.st_mode):
            return Policy(note=f"{path} ignored: not a regular file")
        if not owner_ok:
            return Policy(note=f"{path} ignored: owned by {user_name(info.st_uid)}, not by root or"
                               " the lease directory's owner")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return Policy(note=f"{path} ignored: writable by others (chmod go-w it)")
        if info.st_size > _MAX_POLICY:
            return Policy(note=f"{path} ignored: larger than {_MAX_POLICY // 1024} KiB")
        raw = os.read(fd, _MAX_POLICY + 1)
    finally:
        os.close(fd)
    try:
        return _parse(raw.decode("utf-8"), str(path))
    except (UnicodeDecodeError, ValueError, InvalidValueError) as exc:
        return Policy(note=f"{path} ignored: {str(exc).splitlines()[0][:200]}")


def _parse(text: str, path: str) -> Policy:
    try:
        import tomllib
    except ImportError:  # python 3.10: pyproject installs tomli there
        import tomli as tomllib  # type: ignore[no-redef]

    data = tomllib.loads(text)
    known = {"max_gpus_per_user", "default_time_limit", "time_limit_grace", "users",
             "fair_share_half_life", "fair_share_weight"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
    limits: dict[str, int] = {}
    priorities: dict[str, float] = {}
    users = data.get("users", {})
    if not isinstance(users, dict):
        raise ValueError("[users] must be a table of users")
    for user, entry in users.items():
        if not isinstance(entry, dict) or set(entry) - {"max_gpus", "priority"}:
            raise ValueError(f"[users.{user}] may set only max_gpus and priority")
        if "max_gpus" in entry:
            limits[str(user)] = _count(entry["max_gpus"], f"users.{user}.max_gpus")
        if "priority" in entry:
            value = entry["priority"]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value):
                raise ValueError(f"users.{user}.priority {value!r} must be a finite number")
            priorities[str(user)] = float(value)
    quota = data.get("max_gpus_per_user")
    limit = data.get("default_time_limit")
    grace = data.get("time_limit_grace")
    half_life = data.get("fair_share_half_life")
    weight = data.get("fair_share_weight", 10.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) \
            or not math.isfinite(weight) or weight < 0:
        raise ValueError(f"fair_share_weight {weight!r} must be a finite number >= 0")
    return Policy(
        max_gpus_per_user=_count(quota, "max_gpus_per_user") if quota is not None else None,
        default_time_limit=parse_duration(limit, name="default_time_limit") if limit is not None else None,
        time_limit_grace=parse_duration(grace, name="time_limit_grace") if grace is not None else DEFAULT_GRACE,
        user_limits=limits, priorities=priorities, path=path,
        fair_share_half_life=(parse_duration(half_life, name="fair_share_half_life")
                              if half_life is not None else None),
        fair_share_weight=float(weight),
    )


def _count(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} {value!r} must be a whole number >= 0")
    return value
