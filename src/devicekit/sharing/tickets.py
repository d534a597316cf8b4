"""Queue tickets: one small file per waiting (or time-limited running) job in the lease directory.

A ticket is ``q.<seq>.<pid>.<token>.ticket`` (JSON) kept under an exclusive ``flock`` by the
process that took it, exactly like a lease file: a killed waiter's ticket is dead at once (its
lock is gone) and is ignored by everyone, then removed by its owner's next look. The owner is
the file's owner, never what the file says; a ticket is at most 64 KiB and read as inert data
(JSON, never unpickled). A waiter whose ticket file was removed (``devicekit queue cancel``: the
sticky directory lets only its owner or root remove it) stops waiting.

A ticket's place and age come from what its owner cannot rewrite: the file's inode change time
(``st_ctime``), which no plain user can set back (any rename or write moves it to now, so
rewriting a ticket can only move it to the back). Its number, the one in its *file name* (one
more than every ticket present when it joined), is a label for ``devicekit queue cancel``: a
second live ticket with a number already taken, a JSON that contradicts its name, or values
outside :class:`TicketDocument`'s bounds (``count`` of ``1e999``, a negative or infinite
limit, ``since`` of ``1e300``) make a ticket *ignored*: it never
crashes a reader and never takes another ticket's row; :func:`read_ticket_files` says which and
why (``devicekit queue`` shows them). Numbering needs no lock another user could hold: two
tickets that picked the same number in the same instant are told apart by their change time,
and the later one renumbers itself at once.

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
from typing import Annotated, Any, Literal

import msgspec

from devicekit.errors import InvalidValueError, LeaseError
from devicekit.hardware.document_fields import (
    MAX_COUNT,
    BadDocument,
    ByteCount,
    Count,
    EpochSeconds,
    GpuUuid,
    IgnoredFile,
    Percent,
    Pid,
    Text,
    cut,
    decode,
)
from devicekit.sharing.lease_directory import OPEN_FLAGS, user_name, write_locked

__all__ = ["Ticket", "TicketRecord", "IgnoredTicket", "TicketFiles", "read_tickets",
           "read_ticket_files", "cancel_ticket", "SUFFIX", "TicketDocument"]

SUFFIX = ".ticket"
_PREFIX = "q."
_MAX_TICKET = 64 * 1024
#: ticket numbers above this are not numbers devicekit gives (a renamed file): ignored; past
#: it, a new ticket takes the smallest free number instead
_MAX_SEQ = 10**9
#: characters of a ticket's command and filters that readers keep
_KEPT = 200
#: the longest time limit a ticket may declare (ten years)
_MAX_LIMIT = 10 * 366 * 86400.0
#: attempts at a number of one's own when others joined in the same instant
_NUMBERING_TRIES = 20


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
    #: when it joined (the file's change time, seconds since the epoch), never its own word
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
    #: the file's inode change time (ns): when it joined, as no plain user can forge it
    joined_ns: int = 0

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        data = asdict(self)
        data.pop("path")
        data.pop("joined_ns")
        data["candidates"] = list(self.candidates)
        data["gpus"] = list(self.gpus)
        return data


class Ticket:
    """A ticket held by this process (its file stays locked until :meth:`close`)."""

    def __init__(self, directory: Path, path: Path, fd: int, data: dict[str, Any]) -> None:
        self.directory, self.path, self._fd, self.data = directory, path, fd, data
        self._owner_pid = os.getpid()
        self.closed = False
        try:
            self._directory_ino: int | None = os.stat(directory).st_ino
        except OSError:
            self._directory_ino = None

    @property
    def ticket(self) -> str:
        return str(self.data["seq"])

    @classmethod
    def take(cls, directory: Path, fields: dict[str, Any]) -> Ticket:
        """Number a new ticket after every present one and write it, locked, into ``directory``.

        No lock is taken (one any user could hold would stop everyone joining): the number is
        one more than every present ticket's; should another ticket have taken the same number
        (or a higher one) a moment before ours, ours is renumbered after it.
        """
        seq = _next_seq(directory)
        data = {"version": 1, "seq": seq, "pid": os.getpid(), "host": os.uname().nodename,
                "since": time.time(), "state": "waiting", **fields}
        for key in ("command", "filters"):  # at most what a reader keeps
            if isinstance(data.get(key), str):
                data[key] = cut(data[key], _KEPT)
        token = os.urandom(4).hex()
        path = directory / _name(seq, token)
        fd = _write_locked(directory, path, data)
        ticket = cls(directory, path, fd, data)
        try:
            for _ in range(_NUMBERING_TRIES):
                if not _overtaken(directory, path, seq, os.fstat(fd).st_ctime_ns):
                    return ticket
                seq = _next_seq(directory)
                ticket._renumber(seq, token)
                fd = ticket._fd
        except BaseException:
            ticket.close()
            raise
        ticket.close()
        raise LeaseError(f"cannot join the GPU queue in {str(directory)!r}: {_NUMBERING_TRIES}"
                         " other tickets joined in the same instant; try again")

    def _renumber(self, seq: int, token: str) -> None:
        """Give this ticket ``seq`` (its file renamed, its JSON rewritten to match)."""
        old = self.path
        self.path = self.directory / _name(seq, token)
        self.update(seq=seq)
        with contextlib.suppress(OSError):
            os.unlink(old)

    def cancelled(self) -> bool:
        """Whether the ticket file was removed (cancelled) or replaced by someone else."""
        try:
            return os.lstat(self.path).st_ino != os.fstat(self._fd).st_ino
        except OSError:
            return True

    def directory_gone(self) -> bool:
        """Whether the lease directory itself was removed or replaced since the ticket was taken
        (then a missing ticket file is no cancellation)."""
        try:
            return os.stat(self.directory).st_ino != self._directory_ino
        except OSError:
            return True

    def time_limit_on_file(self) -> float | None:
        """The time limit the queue reads for this ticket now (its file may have been rewritten
        by its owner): what the job must be held to, since the queue planned with it."""
        got = _read_live(self.path)
        if got is None or got[2] is None:  # our own data, as we wrote it
            limit = self.data.get("time_limit")
            return None if limit is None else float(limit)
        try:
            return decode(got[2], TicketDocument, limit=_MAX_TICKET).time_limit
        except BadDocument:
            return None

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


def _name(seq: int, token: str) -> str:
    return f"{_PREFIX}{seq:09d}.{os.getpid()}.{token}{SUFFIX}"


def _seq_of(name: str) -> int:
    """The number in a ticket's file name (0: not a number devicekit gives)."""
    part = name[len(_PREFIX):].split(".", 1)[0]
    return int(part) if part.isdigit() and len(part) <= 10 and int(part) <= _MAX_SEQ else 0


def _pid_of(name: str) -> int | None:
    parts = name[len(_PREFIX):].split(".")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() and len(parts[1]) < 12 else None


def _next_seq(directory: Path) -> int:
    """One more than every ticket number present; the smallest free one past :data:`_MAX_SEQ`
    (a renamed ticket can make numbers jump, never run out)."""
    taken = {_seq_of(n) for n in _names(directory)} - {0}
    following = 1 + max(taken, default=0)
    if following <= _MAX_SEQ:
        return following
    return next(n for n in range(1, len(taken) + 2) if n not in taken)


def _overtaken(directory: Path, path: Path, seq: int, ctime_ns: int) -> bool:
    """Whether another ticket file with our number changed before ours: a ticket that joined in
    the same instant and took the same number (ours must then take another)."""
    for name in _names(directory):
        other = directory / name
        if other == path or _seq_of(name) != seq:
            continue
        try:
            info = os.lstat(other)
        except OSError:
            continue
        if (info.st_ctime_ns, name) < (ctime_ns, path.name):
            return True
    return False


def _write_locked(directory: Path, final: Path, data: dict[str, Any]) -> int:
    """Write ``data`` as the ticket ``final``, locked; the locked fd (held while waiting).

    A ticket every reader would ignore (its waiter would wait unseen) is refused instead, in
    one line naming the bad field."""
    body = json.dumps(data, sort_keys=True).encode()
    try:
        decode(body, TicketDocument, limit=_MAX_TICKET)
    except BadDocument as exc:
        raise InvalidValueError(f"cannot join the GPU queue with this request: {exc}") from None
    return write_locked(directory, final, body, "a queue ticket")


#: a live ticket file the queue does not trust, and why (shown by ``devicekit queue``)
IgnoredTicket = IgnoredFile


@dataclass(frozen=True)
class TicketFiles:
    """What the lease directory's ticket files say: the trusted tickets in queue order, and
    the ignored ones."""

    tickets: tuple[TicketRecord, ...]
    ignored: tuple[IgnoredTicket, ...] = ()


def read_tickets(directory: Path, *, cleanup: bool = True) -> list[TicketRecord]:
    """Every live, trusted ticket, in arrival order (see :func:`read_ticket_files`)."""
    return list(read_ticket_files(directory, cleanup=cleanup).tickets)


def read_ticket_files(directory: Path, *, cleanup: bool = True) -> TicketFiles:
    """Every live ticket, in arrival order, and those ignored (malformed or out of order) with
    why; dead ones (holder gone) are skipped (and removed where this user may). Files are read
    as inert data, never trusted beyond what is checked here."""
    found: list[TicketRecord] = []
    ignored: list[IgnoredTicket] = []
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
        record, why = _record(path, info, data)
        if record is None:
            ignored.append(IgnoredTicket(name[:200], user_name(info.st_uid), why))
        else:
            found.append(record)
    return _in_order(found, ignored)


def _in_order(found: list[TicketRecord], ignored: list[IgnoredTicket]) -> TicketFiles:
    """Tickets in the order they joined (inode change time, which no plain user can set back),
    waiting ones first; a second live ticket with a number already taken is ignored."""
    trusted: list[TicketRecord] = []
    first: dict[int, TicketRecord] = {}
    for t in sorted(found, key=lambda t: (t.state != "waiting", t.joined_ns, t.path)):
        if t.seq in first:
            ignored.append(IgnoredTicket(
                Path(t.path).name[:200], t.user,
                f"a second ticket numbered {t.seq} ({first[t.seq].user}'s joined first)"))
            continue
        first[t.seq] = t
        trusted.append(t)
    return TicketFiles(tuple(trusted), tuple(ignored))


def _read_live(path: Path) -> tuple[bool, os.stat_result, bytes | None] | None:
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
            data = os.read(fd, _MAX_TICKET + 1)
        except OSError:
            return None
        return live, info, data
    finally:
        os.close(fd)


class TicketDocument(msgspec.Struct, frozen=True):
    """What a ticket file may say: every field bounded (unknown keys are skipped; the user is
    the file's owner and the ticket's age its change time, never the document's word)."""

    seq: Annotated[int, msgspec.Meta(ge=1, le=_MAX_SEQ)]
    pid: Pid
    count: Count
    host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    command: Text = ""
    state: Literal["waiting", "running"] = "waiting"
    candidates: Annotated[list[GpuUuid], msgspec.Meta(max_length=MAX_COUNT)] = []
    gpus: Annotated[list[GpuUuid], msgspec.Meta(max_length=MAX_COUNT)] = []
    min_free: ByteCount | None = None
    max_util: Percent | None = None
    filters: Text = ""
    since: EpochSeconds | None = None
    time_limit: Annotated[float, msgspec.Meta(gt=0, le=_MAX_LIMIT)] | None = None
    grace: Annotated[float, msgspec.Meta(ge=0, le=86400.0 * 365)] = 0.0
    #: a running job's monotonic end (seconds since boot: a limit after years of uptime)
    ends: Annotated[float, msgspec.Meta(ge=0, le=100 * 366 * 86400.0)] | None = None


def _record(path: Path, info: os.stat_result, data: bytes) -> tuple[TicketRecord | None, str]:
    """The ticket ``data`` (its file ``path``) as a record, or None and why it is not trusted."""
    try:
        doc = decode(data, TicketDocument, limit=_MAX_TICKET)
        seq = _seq_of(path.name)
        if not seq:
            raise BadDocument("its name carries no ticket number")
        if doc.seq != seq:
            raise BadDocument(f"its JSON says ticket {doc.seq} but its name {seq}")
        if _pid_of(path.name) != doc.pid:
            raise BadDocument(f"its JSON says pid {doc.pid} but its name does not")
    except BadDocument as exc:
        return None, f"malformed: {exc}"
    return TicketRecord(
        ticket=str(seq), seq=seq, user=user_name(info.st_uid), pid=doc.pid,
        host=cut(doc.host, _KEPT), command=cut(doc.command, _KEPT), count=doc.count,
        candidates=tuple(doc.candidates), min_free=doc.min_free, max_util=doc.max_util,
        filters=cut(doc.filters, _KEPT),
        since=info.st_ctime_ns / 1e9,  # when it joined: its owner cannot set this back
        time_limit=doc.time_limit, grace=doc.grace, state=doc.state, gpus=tuple(doc.gpus),
        ends=doc.ends, path=str(path), joined_ns=info.st_ctime_ns,
    ), ""


def cancel_ticket(directory: Path, ticket: str) -> TicketRecord:
    """Remove waiting ticket ``ticket`` (yours; root: any): its waiter stops waiting.

    Raises :class:`LeaseError` naming the ticket when there is none, it runs, or it is not yours.
    """
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
