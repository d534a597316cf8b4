"""Queue tickets: one small file per waiting (or time-limited running) job in the lease directory.

A ticket is ``q.<seq>.<pid>.<token>.ticket`` (JSON) kept under an exclusive ``flock`` by the
process that took it, exactly like a lease file: a killed waiter's ticket is dead at once (its
lock is gone) and is ignored by everyone, then removed by its owner's next look. ``seq`` is the
arrival order: taken under the directory's ``queue.lock`` as one more than every ticket file
present, so ordering never depends on the wall clock. The owner is the file's owner, never
what the file says; a ticket is at most 64 KiB and read as inert data (JSON, never unpickled).
A waiter whose ticket file was removed (``devicekit queue cancel``: the sticky directory lets
only its owner or root remove it) stops waiting.

A ticket is ``waiting`` until its job gets its GPUs; a job with a time limit keeps it as
``running`` (its GPUs and the monotonic time by which the limit frees them) so that later
tickets can be backfilled before it ends.

Usage::

    from devicekit.sharing.tickets import Ticket, read_tickets

    ticket = Ticket.take(directory, {"count": 2, "candidates": uuids, "command": "python t.py"})
    print([t.ticket for t in read_tickets(directory)])    # ["1", ...] in arrival order
    ticket.close()
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devicekit.errors import LeaseError
from devicekit.sharing.device_locks import lock_device
from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name, write_locked

__all__ = ["Ticket", "TicketRecord", "read_tickets", "cancel_ticket", "SUFFIX"]

SUFFIX = ".ticket"
_PREFIX = "q."
_MAX_TICKET = 64 * 1024
#: how long taking a ticket waits for another one being numbered (milliseconds of work)
_ORDER_PATIENCE = 10.0


@dataclass(frozen=True)
class TicketRecord:
    """One live ticket as any user reads it."""

    ticket: str
    seq: int
    user: str
    pid: int
    host: str
    command: str
    #: GPUs asked
    count: int
    #: GPUs (uuids) the request could ever use (its lasting filters applied)
    candidates: tuple[str, ...]
    min_free: int | None
    max_util: float | None
    #: the filters in words (``--min-free 40GiB --exclude 3``), for ``devicekit queue``
    filters: str
    #: wall-clock time it was taken (display only)
    since: float
    #: declared time limit in seconds (None: none)
    time_limit: float | None
    #: seconds between SIGTERM and SIGKILL at the limit
    grace: float
    #: "waiting" or "running"
    state: str
    #: the GPUs a running ticket's job holds
    gpus: tuple[str, ...] = ()
    #: monotonic time by which a running job's limit frees its GPUs (None: unknown)
    ends: float | None = None
    path: str = ""

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data.pop("path")
        data["candidates"] = list(self.candidates)
        data["gpus"] = list(self.gpus)
        return data


class Ticket:
    """A ticket held by this process (its file stays locked until :meth:`close`)."""

    def __init__(self, directory: Path, path: Path, fd: int, data: dict[str, Any]) -> None:
        self.directory, self.path, self._fd, self.data = directory, path, fd, data
        self._owner_pid = os.getpid()
        self.closed = False

    @property
    def ticket(self) -> str:
        return str(self.data["seq"])

    @classmethod
    def take(cls, directory: Path, fields: dict[str, Any]) -> Ticket:
        """Number a new ticket after every present one and write it, locked, into ``directory``."""
        order = lock_device(directory, "queue", exclusive=True, kind=".lock",
                            patience=_ORDER_PATIENCE)
        if isinstance(order, str):
            raise LeaseError(f"cannot join the GPU queue in {str(directory)!r}: queue.lock {order}")
        try:
            seq = 1 + max((_seq_of(n) for n in _names(directory)), default=0)
            data = {"version": 1, "seq": seq, "pid": os.getpid(), "host": os.uname().nodename,
                    "since": time.time(), "state": "waiting", **fields}
            name = f"{_PREFIX}{seq:09d}.{os.getpid()}.{os.urandom(4).hex()}{SUFFIX}"
            fd = _write_locked(directory, directory / name, data)
        finally:
            os.close(order)
        return cls(directory, directory / name, fd, data)

    def cancelled(self) -> bool:
        """Whether the ticket file was removed (cancelled) or replaced by someone else."""
        try:
            return os.lstat(self.path).st_ino != os.fstat(self._fd).st_ino
        except OSError:
            return True

    def update(self, **changes: Any) -> None:
        """Rewrite the ticket (atomically, still locked) with ``changes``."""
        data = {**self.data, **changes}
        fd = _write_locked(self.directory, self.path, data)
        os.close(self._fd)
        self._fd, self.data = fd, data

    def close(self) -> None:
        """Leave the queue: delete the file, drop the lock. Safe to call twice."""
        if self.closed or os.getpid() != self._owner_pid:
            return
        self.closed = True
        with contextlib.suppress(OSError):
            if os.lstat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self._fd)

    def __repr__(self) -> str:
        return f"Ticket({self.ticket}, {self.data.get('state')})"


def _names(directory: Path) -> list[str]:
    try:
        return sorted(n for n in os.listdir(directory) if n.startswith(_PREFIX) and n.endswith(SUFFIX))
    except OSError as exc:
        raise LeaseError(f"lease directory {str(directory)!r} cannot be listed ({exc.strerror})") from None


def _seq_of(name: str) -> int:
    part = name[len(_PREFIX):].split(".", 1)[0]
    return int(part) if part.isdigit() and len(part) < 12 else 0


def _write_locked(directory: Path, final: Path, data: dict[str, Any]) -> int:
    """Write ``data`` as the ticket ``final``, locked; the locked fd (held while waiting)."""
    return write_locked(directory, final, json.dumps(data, sort_keys=True).encode(), "a queue ticket")


def read_tickets(directory: Path, *, cleanup: bool = True) -> list[TicketRecord]:
    """Every live ticket, in arrival order; dead ones (holder gone) are skipped (and removed
    where this user may). Unreadable or malformed files are skipped, never trusted."""
    out: list[TicketRecord] = []
    for name in _names(directory):
        path = directory / name
        got = _read_live(path)
        if got is None:
            continue
        live, info, data = got
        if not live:
            if cleanup:
                with contextlib.suppress(OSError):  # another user's: theirs to remove
                    os.unlink(path)
            continue
        record = _record(path, info, data)
        if record is not None:
            out.append(record)
    out.sort(key=lambda r: (r.seq, r.path))
    return out


def _read_live(path: Path) -> tuple[bool, os.stat_result, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EACCES):
            return None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_TICKET:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            live = True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False, info, None
        try:
            data = json.loads(os.read(fd, _MAX_TICKET + 1))
        except (OSError, ValueError):
            return None
        return live, info, data
    finally:
        os.close(fd)


def _record(path: Path, info: os.stat_result, data: Any) -> TicketRecord | None:
    def number(key: str) -> float | None:
        value = data.get(key)
        return float(value) if value is not None else None

    try:
        min_free = data.get("min_free")
        return TicketRecord(
            ticket=str(int(data["seq"])), seq=int(data["seq"]), user=user_name(info.st_uid),
            pid=int(data["pid"]), host=str(data.get("host", ""))[:200],
            command=str(data.get("command", ""))[:200], count=int(data["count"]),
            candidates=tuple(str(u)[:200] for u in data.get("candidates", [])[:1024]),
            min_free=int(min_free) if min_free is not None else None,
            max_util=number("max_util"), filters=str(data.get("filters", ""))[:200],
            since=float(data.get("since", info.st_mtime)), time_limit=number("time_limit"),
            grace=float(data.get("grace", 0.0)), state=str(data.get("state", "waiting")),
            gpus=tuple(str(u)[:200] for u in data.get("gpus", [])[:1024]), ends=number("ends"),
            path=str(path),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def cancel_ticket(directory: Path, ticket: str) -> TicketRecord:
    """Remove waiting ticket ``ticket`` (yours; root: any): its waiter stops waiting.

    Raises :class:`LeaseError` naming the ticket when there is none, it runs, or it is not yours.
    """
    from devicekit.errors import InvalidValueError

    text = str(ticket).strip()
    if not text.isdigit():
        raise InvalidValueError(f"ticket {ticket!r} is not a ticket number (see 'devicekit queue')")
    found = [t for t in read_tickets(directory) if t.ticket == str(int(text))]
    if not found:
        raise LeaseError(f"no ticket {text} in the queue (see 'devicekit queue')")
    record = found[0]
    if record.state != "waiting":
        raise LeaseError(f"ticket {text} is running (pid {record.pid}); stop the job itself to"
                         " end it")
    try:
        os.unlink(record.path)
    except PermissionError:
        raise LeaseError(f"ticket {text} belongs to {record.user}; only {record.user} or root can"
                         " cancel it") from None
    except FileNotFoundError:
        raise LeaseError(f"ticket {text} left the queue meanwhile") from None
    return record
