"""The queue's policy, set by an admin in ``policy.toml`` in the lease directory.

Honoured only when owned by root or by the lease directory's owner and writable by nobody else
(any user can create files in the shared directory; a policy anyone could write would be
anyone's). Otherwise, or when it fails its schema (:class:`PolicyDocument`: every key known,
counts whole numbers up to 4,096, priorities and weights finite and bounded, durations with a
unit and at most a year, user names as ``useradd`` takes them), the queue runs without a
policy and ``note`` says why (``devicekit queue`` shows it). At most 64 KiB, parsed as TOML
data only.

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

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from devicekit.errors import InvalidValueError
from devicekit.hardware.document_fields import MAX_COUNT, BadDocument, convert
from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name

__all__ = ["Policy", "PolicyDocument", "load_policy", "parse_duration", "POLICY_NAME",
           "DEFAULT_GRACE"]

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


#: a user's name as a policy table key: what useradd accepts, and a uid
_UserName = Annotated[str, msgspec.Meta(pattern=r"\A[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}\$?\Z")]
#: a duration as written: ``"4h"``, ``"30s"``, ``"1:30:00"`` (a bare number is refused below)
_Duration = Annotated[str, msgspec.Meta(max_length=32)] | float
_GpuCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_COUNT)]
#: the longest duration a policy may set (a year)
_MAX_DURATION = 366 * 86400.0


class UserPolicy(msgspec.Struct, forbid_unknown_fields=True):
    """``[users.NAME]``: the user's own quota and priority."""

    max_gpus: _GpuCount | None = None
    priority: Annotated[float, msgspec.Meta(ge=-1e6, le=1e6)] | None = None


class PolicyDocument(msgspec.Struct, forbid_unknown_fields=True):
    """What ``policy.toml`` may say: every key known and bounded."""

    max_gpus_per_user: _GpuCount | None = None
    default_time_limit: _Duration | None = None
    time_limit_grace: _Duration | None = None
    fair_share_half_life: _Duration | None = None
    fair_share_weight: Annotated[float, msgspec.Meta(ge=0, le=1e6)] = 10.0
    users: Annotated[dict[_UserName, UserPolicy], msgspec.Meta(max_length=10_000)] = {}


def _duration(value: str | float | None, name: str) -> float | None:
    if value is None:
        return None
    seconds = parse_duration(value, name=name)
    if seconds > _MAX_DURATION:
        raise ValueError(f"{name} {value!r} is longer than a year")
    return seconds


def _parse(text: str, path: str) -> Policy:
    try:
        import tomllib
    except ImportError:  # python 3.10: pyproject installs tomli there
        import tomli as tomllib  # type: ignore[no-redef]

    return policy_from_data(tomllib.loads(text), path)


def policy_from_data(data: Any, path: str = "") -> Policy:
    """The parsed TOML ``data`` as a :class:`Policy`, or ValueError / InvalidValueError why."""
    try:
        doc = convert(data, PolicyDocument)
    except BadDocument as exc:
        raise ValueError(str(exc)) from None
    grace = _duration(doc.time_limit_grace, "time_limit_grace")
    return Policy(
        max_gpus_per_user=doc.max_gpus_per_user,
        default_time_limit=_duration(doc.default_time_limit, "default_time_limit"),
        time_limit_grace=DEFAULT_GRACE if grace is None else grace,
        user_limits={u: e.max_gpus for u, e in doc.users.items() if e.max_gpus is not None},
        priorities={u: float(e.priority) for u, e in doc.users.items() if e.priority is not None},
        path=path,
        fair_share_half_life=_duration(doc.fair_share_half_life, "fair_share_half_life"),
        fair_share_weight=float(doc.fair_share_weight),
    )
