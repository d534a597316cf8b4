"""Reading the lease directory: who holds which device, as :class:`LeaseRecord` objects.

Two sources: the lease files (``<uuid>.<pid>.<token>.lease``, JSON, kept under an exclusive
``flock`` by their holder, so a file whose lock is gone is stale) and, for a device whose lock
file is held without any lease file (a process that took it by hand, or one caught between
locking and writing), the holder ``/proc/locks`` names (``kind="lock"``). The user is always
the owner of the file or of the process, never what a file claims.

Every lease also carries a job id (``job``): ``devicekit run --name NAME``'s name, handed to
the job's processes as ``DEVICEKIT_JOB_ID``, else one generated per process (six hex digits),
so a person can be told which job to stop. Every field of a lease file is its writer's word:
:mod:`~devicekit.sharing.lease_document` decodes it against one schema; a file that fails is
left out (``ignored=`` collects it, with its owner and why), never a crash.

Usage::

    from devicekit.sharing.lease_records import read_leases

    for record in read_leases():
        print(record.gpu_uuid, record.job, record.describe())   # leased by bob (pid 812, ...)
"""

from __future__ import annotations

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
from dataclasses import asdict, dataclass
from pathlib import Path

from devicekit.errors import InvalidValueError, LeaseError
from devicekit.hardware.document_fields import (
    JOB_PATTERN,
    PID_MAX,
    UUID_PATTERN,
    BadDocument,
    IgnoredFile,
    cut,
    decode,
)
from devicekit.hardware.printable import printable
from devicekit.sharing.device_locks import BUDGET, holders, safe_name
from devicekit.sharing.lease_directory import OPEN_FLAGS, resolve_directory, user_name
from devicekit.sharing.lease_document import (
    MAX_COMMAND_SHOWN,
    MAX_LEASE_BYTES,
    SUFFIX,
    LeaseDocument,
    decode_lease,
)

__all__ = ["LeaseRecord", "read_leases", "file_records", "current_command", "current_job",
           "check_job_name", "JOB_ENV", "MAX_JOB_CHARS", "SUFFIX", "TMP_PREFIX", "IgnoredFile"]

TMP_PREFIX = ".tmp-"
#: a temporary file is locked microseconds after it is made; one this old and unlocked is debris
_TMP_GRACE = 60.0
#: the job id a process's leases carry (``devicekit run`` sets it for its command)
JOB_ENV = "DEVICEKIT_JOB_ID"
#: the longest job id kept (a name, not a command line)
MAX_JOB_CHARS = 64
_JOB_NAME = re.compile(JOB_PATTERN)


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds one GPU: the content of one lease file."""

    gpu_uuid: str
    pid: int
    user: str
    host: str
    command: str
    #: when the lease was taken (seconds since the epoch); read from a lease file, its inode
    #: change time (when it got its name), which its writer cannot set back
    since: float
    #: memory the holder asked for, in bytes (None: the whole GPU)
    memory: int | None
    #: True when other ``share`` leases may use the same GPU within its memory budget
    share: bool
    #: ``"lease"`` (a lease file) or ``"lock"`` (a process holding the device's lock file
    #: without a lease file: shown so that nobody holds a GPU unseen)
    kind: str = "lease"
    #: the job this lease belongs to (``devicekit run --name``, else generated); None for a bare
    #: lock holder or a lease file written by a devicekit without job ids
    job: str | None = None

    def describe(self) -> str:
        """``leased by bob (pid 812, python train.py) since 14:02`` (``shared`` for share leases)."""
        when = time.strftime("%H:%M", time.localtime(self.since))
        if time.time() - self.since > 86400:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(self.since))
        command = self.command if len(self.command) <= 40 else self.command[:37] + "..."
        if self.kind == "lock":
            return (f"held by {self.user} (pid {self.pid}, {command}) through its lock file"
                    f"{' (shared)' if self.share else ''} since {when}, without a lease")
        verb = "shared" if self.share else "leased"
        what = f", {_format_bytes(self.memory)} asked" if self.share and self.memory else ""
        return f"{verb} by {self.user} (pid {self.pid}, {command}{what}) since {when}"

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("kind")  # a lease file is always kind "lease"; the format stays what it was
        data["command"] = cut(data["command"], MAX_COMMAND_SHOWN)  # what any reader keeps
        if data["job"] is None:
            data.pop("job")
        text = json.dumps(data, sort_keys=True)
        try:  # a lease every reader would ignore is refused here, naming the field
            decode(text.encode(), LeaseDocument, limit=MAX_LEASE_BYTES)
        except BadDocument as exc:
            raise LeaseError(f"cannot lease GPU {printable(cut(self.gpu_uuid, 100))!r}: {exc}"
                             ) from None
        return text


def _format_bytes(n: int) -> str:
    from devicekit.units import format_size

    return format_size(n)


def check_job_name(name: str) -> str:
    """``name`` as a job id, or :class:`InvalidValueError`: 1-64 letters, digits and ``._:@+=-``,
    starting with a letter or digit (it becomes a metrics label and a word in a table)."""
    if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
        from devicekit.hardware.printable import printable

        raise InvalidValueError(
            f"job name {printable(str(name))[:80]!r} must be 1-{MAX_JOB_CHARS} letters, digits or"
            " ._:@+=- starting with a letter or digit, e.g. --name bert-lr3e-4")
    return name


_generated: str | None = None


def current_job() -> str:
    """This process's job id: ``DEVICEKIT_JOB_ID`` when it holds a valid one (``devicekit run``
    sets it for its command), else six hex digits generated once per process (a forked child
    keeps its parent's)."""
    global _generated
    named = os.environ.get(JOB_ENV, "")
    if named and _JOB_NAME.fullmatch(named):
        return named
    if _generated is None:
        _generated = os.urandom(3).hex()
    return _generated


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
    parts = path.name[: -len(SUFFIX)].rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or len(parts[1]) > 7 \
            or not 1 <= int(parts[1]) <= PID_MAX or not re.fullmatch(UUID_PATTERN, parts[0]):
        return None
    return LeaseRecord(gpu_uuid=parts[0], pid=int(parts[1]), user=user_name(info.st_uid),
                       host="", command="(unreadable lease file)", since=info.st_ctime,
                       memory=None, share=False)


def _read_record(path: Path, info: os.stat_result) -> LeaseRecord | None:
    """The lease file ``path`` as a record, None when it vanished meanwhile (released), or
    :class:`BadDocument` saying why it is ignored."""
    # O_NONBLOCK + a fresh fstat: the file's owner may have renamed a FIFO (which would block an
    # open for reading, with the directory lock held) or a huge file over it since the probe
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | OPEN_FLAGS)
    except PermissionError:  # live but unreadable: still counts, as an exclusive lease
        record = _from_name(path, info)
        if record is None:
            raise BadDocument("unreadable, and its name is no lease's") from None
        return record
    except FileNotFoundError:  # released since the probe
        return None
    except OSError as exc:
        raise BadDocument(f"cannot be opened ({exc.strerror})") from None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode):
            raise BadDocument("not a regular file")
        if now.st_size > MAX_LEASE_BYTES:
            raise BadDocument(f"larger than {MAX_LEASE_BYTES} bytes")
        data = os.read(fd, MAX_LEASE_BYTES + 1)
    except OSError as exc:
        raise BadDocument(f"cannot be read ({exc.strerror})") from None
    finally:
        os.close(fd)
    doc = decode_lease(path.name, data)
    return LeaseRecord(
        gpu_uuid=doc.gpu_uuid, pid=doc.pid,
        user=user_name(info.st_uid),  # the file owner, not what the file claims
        host=doc.host, command=doc.command,
        since=now.st_ctime,  # when it got its name, which no plain user can set back
        memory=doc.memory, share=doc.share, job=doc.job)


def file_records(path: Path, *, cleanup: bool = False,
                 ignored: list[IgnoredFile] | None = None) -> list[LeaseRecord]:
    """The live lease files of the (checked) directory ``path``, oldest first; live files that
    fail :class:`~devicekit.sharing.lease_document.LeaseDocument` are left out and, when
    ``ignored`` is a list, added to it with their owner and why.

    ``cleanup=True`` also deletes stale lease files (holder gone) and temporary files left by a
    writer that died, where this user may delete them. Safe at any time: a lease file is locked
    before it gets its name, and a temporary file is only removed when it is old and unlocked.
    """
    records: list[LeaseRecord] = []
    for name in _lease_files(path):
        file = path / name
        is_tmp = name.startswith(TMP_PREFIX)
        if not (name.endswith(SUFFIX) or (cleanup and is_tmp)):
            continue
        probe = _probe(file)
        if probe is None:
            continue
        live, info = probe
        if not live:
            if cleanup and (not is_tmp or time.time() - info.st_mtime > _TMP_GRACE):
                with contextlib.suppress(OSError):  # another user's stale file: theirs to remove
                    os.unlink(file)
            continue
        if is_tmp:
            continue
        try:
            record = _read_record(file, info)
        except BadDocument as exc:
            if ignored is not None:
                ignored.append(IgnoredFile(printable(cut(name, 120)), user_name(info.st_uid),
                                           str(exc)))
            continue
        if record is not None:
            records.append(_live(record, info))
    records.sort(key=lambda r: (r.since, r.gpu_uuid))
    return records


def _live(record: LeaseRecord, info: os.stat_result) -> LeaseRecord:
    """``record`` naming a live holder: when its pid died but a process that inherited the
    locked lease file (a job's leftover) still holds it, that process is the holder."""
    from devicekit.sharing.live_holder import live_holder, pid_alive

    if record.host != os.uname().nodename or pid_alive(record.pid):
        return record
    pid = live_holder(info)
    if pid is None:
        return record
    from dataclasses import replace

    from devicekit.sharing.device_locks import process_facts

    _, command, _ = process_facts(pid)
    return replace(record, pid=pid, command=command)


def lock_records(path: Path, covered: set[str]) -> list[LeaseRecord]:
    """Holders of a device lock file whose device has no live lease file (``kind="lock"``)."""
    safe_covered = {safe_name(u) for u in covered}
    host = os.uname().nodename
    out = []
    for h in holders(path):
        if h.kind == BUDGET or h.uuid in safe_covered:
            continue
        out.append(LeaseRecord(gpu_uuid=h.uuid, pid=h.pid, user=h.user, host=host,
                               command=h.command, since=h.since, memory=None,
                               share=not h.exclusive, kind="lock"))
    return out


def read_leases(directory: str | os.PathLike[str] | None = None, *,
                cleanup: bool = False, ignored: list[IgnoredFile] | None = None
                ) -> list[LeaseRecord]:
    """Every live lease in the lease directory, oldest first: lease files, then bare lock holders.

    ``cleanup=True`` also deletes stale files (see :func:`file_records`); ``ignored`` (a list)
    receives the live lease files that were not trusted, and why.
    """
    path = resolve_directory(directory)
    records = file_records(path, cleanup=cleanup, ignored=ignored)
    records += lock_records(path, {r.gpu_uuid for r in records})
    records.sort(key=lambda r: (r.since, r.gpu_uuid))
    return records
