"""GPU leases: who holds which GPU, alive exactly as long as the holder process.

Holding a device's lock file (``<uuid>.hold`` in the lease directory, ``DEVICEKIT_LEASE_DIR``,
default ``/tmp/devicekit-leases``) *is* holding the device: exclusively for an exclusive lease,
shared for a ``share`` lease (:mod:`~devicekit.sharing.device_locks`). Beside it, one small
JSON lease file per device (also locked) says who holds it: pid, user, command, memory asked.
Both locks are the kernel's, so a SIGKILLed holder's devices are free at once. Locks are taken
one device at a time without blocking, in the caller's order of preference; a multi-device
request that cannot get them all gives back what it took, so no partial grant leaks and no two
requests wait for each other. Nothing one user can hold stops other users' leasing: a held lock
makes one device busy, attributed to its holder in ``devicekit status``.

Choosing-and-reserving stays atomic: after locking a device, the live lease files are read
again, so a device leased by an old devicekit (lease files only, under its directory-wide
``.lock``) or whose lock file its owner replaced is never granted twice; the old ``.lock`` is
held shared for the moment of the reservation, so an old devicekit cannot choose meanwhile.

The directory is sticky and world-writable like ``/tmp`` (mode 1777) so that every user of the
machine can lease but nobody can delete another user's files; a symlinked directory, or one
owned by another non-root user and not shared, is refused. Files are opened with
``O_NOFOLLOW | O_CLOEXEC``; lease fds are inherited by a child only when passed explicitly
(``subprocess.Popen(..., pass_fds=lease.fds)``), which keeps the lease alive for the child's
lifetime. The holder's user name is taken from the file's owner, not from its content.

Usage::

    from devicekit.sharing.leases import Lease, read_leases

    with Lease.acquire(["GPU-5d9b..."], memory=20 * 2**30) as lease:
        print([r.gpu_uuid for r in read_leases()])   # includes ours
    # released: the file is gone

Most code never calls this directly: ``dk.select_gpus`` chooses and leases in one step.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from devicekit.errors import LeaseError
from devicekit.hardware.launchers.slurm import slurm_job_id
from devicekit.sharing.device_locks import BUDGET, HOLD, legacy_handshake, lock_device, safe_name
from devicekit.sharing.lease_directory import (
    DEFAULT_LEASE_DIR,
    LEASE_DIR_ENV,
    directory_lock,
    lease_dir,
    resolve_directory,
    user_name,
    write_locked,
)
from devicekit.sharing.lease_records import (
    JOB_ENV,
    SUFFIX,
    LeaseRecord,
    current_command,
    current_job,
    file_records,
    read_leases,
)

__all__ = [
    "LEASE_DIR_ENV",
    "DEFAULT_LEASE_DIR",
    "LeaseRecord",
    "Lease",
    "Judge",
    "lease_dir",
    "read_leases",
    "directory_lock",
    "current_command",
    "default_job",
]


def default_job() -> str:
    """The job id a lease carries: ``DEVICEKIT_JOB_ID`` when it names one, else the Slurm job id
    (``12345``, ``12340_5`` for an array task) inside a Slurm job, else devicekit's own token."""
    slurm = slurm_job_id(os.environ)
    named = os.environ.get(JOB_ENV)
    if named is not None and named != slurm:
        return current_job()
    return slurm or current_job()

#: a share request's own check of one device: (uuid, its live lease records) -> why not, or None
Judge = Callable[[str, Sequence[LeaseRecord]], "str | None"]
#: how long a share request waits for another one's budget check on the same device
_BUDGET_PATIENCE = 0.3


class Lease:
    """Leases on one or more GPUs, held by this process until :meth:`release` or exit.

    ``records`` says what is held; ``fds`` are the locked file descriptors, lease files and
    device locks (pass them to a child with ``pass_fds`` to keep the lease alive while the
    child runs). Usable as a context manager.
    """

    def __init__(self, records: list[LeaseRecord], fds: list[int], paths: list[Path],
                 lock_fds: Sequence[int] = ()) -> None:
        self.records = list(records)
        self._file_fds = list(fds)
        self._lock_fds = list(lock_fds)
        self.fds = [*self._file_fds, *self._lock_fds]
        self._paths = list(paths)
        self._owner_pid = os.getpid()
        self.released = False
        _LIVE.add(self)

    @classmethod
    def acquire(cls, gpu_uuids: Iterable[str], *, memory: int | None = None, share: bool = False,
                command: str | None = None, directory: str | os.PathLike[str] | None = None,
                job: str | None = None) -> Lease:
        """Lease every GPU named by uuid, or none: :class:`LeaseError` naming a taken one.

        An exclusive lease conflicts with any live lease on the GPU; a ``share`` lease conflicts
        only with exclusive ones (memory budgets are checked by ``select_gpus``). ``job``: the
        job id the lease files carry (default :func:`~devicekit.sharing.lease_records.current_job`).
        """
        uuids = list(gpu_uuids)
        lease, refused = cls.take(uuids, count=len(uuids), memory=memory, share=share,
                                  command=command, directory=directory, job=job)
        if lease is None:
            uuid, why = next(iter(refused.items()))
            if why.startswith("unusable:"):
                raise LeaseError(f"GPU {uuid} cannot be leased, {why}")
            raise LeaseError(f"GPU {uuid} is already {why}; choose another GPU")
        return lease

    @classmethod
    def take(cls, gpu_uuids: Iterable[str], *, count: int | None = None,
             memory: int | None = None, share: bool = False, command: str | None = None,
             directory: str | os.PathLike[str] | None = None, judge: Judge | None = None,
             job: str | None = None) -> tuple[Lease | None, dict[str, str]]:
        """Lease the first ``count`` (None: every one) of ``gpu_uuids`` that can be had, in order.

        Each device is locked without waiting; one that cannot be had is skipped and its reason
        kept. Returns ``(lease, {uuid: why not})``; ``lease`` is None when fewer than ``count``
        (or, for None, not one) could be had, and then nothing stays held. ``judge`` decides,
        with the device locked and its lease files read afresh, whether it still qualifies
        (``select_gpus`` checks share budgets with it). ``job``: as for :meth:`acquire`.
        """
        path = resolve_directory(directory)
        me = _Identity(memory, share, command, job)
        refused: dict[str, str] = {}
        taken = Lease([], [], [])
        try:
            with legacy_handshake(path):
                for uuid in gpu_uuids:
                    if count is not None and len(taken.records) >= count:
                        break
                    why = _take_one(path, uuid, me, judge, taken)
                    if why is not None:
                        refused[uuid] = why
        except BaseException:
            taken.release()
            raise
        if not taken.records or (count is not None and len(taken.records) < count):
            taken.release()
            return None, refused
        return taken, refused

    def _add(self, record: LeaseRecord, fd: int, path: Path, lock_fd: int) -> None:
        self.records.append(record)
        self._file_fds.append(fd)
        self._paths.append(path)
        self._lock_fds.append(lock_fd)
        self.fds = [*self._file_fds, *self._lock_fds]

    @property
    def gpu_uuids(self) -> list[str]:
        return [r.gpu_uuid for r in self.records]

    def restore(self) -> list[str]:
        """Re-create the lease files (and their locks) that are gone from the lease directory:
        removed with the directory while the job runs, which would show its GPUs as free.

        The directory is made again where it is missing (as :func:`lease_dir` makes it); a
        device another process locked meanwhile cannot be taken back, and that is said. Returns
        one line per device restored or lost ([] when nothing was missing). Cheap when nothing
        is: one ``lstat`` per device.
        """
        if self.released or os.getpid() != self._owner_pid:
            return []
        missing = [i for i, (fd, path) in enumerate(zip(self._file_fds, self._paths, strict=True))
                   if not _same_file(path, fd)]
        if not missing:
            return []
        try:
            directory = lease_dir()
        except LeaseError as exc:
            return [f"leases on {len(missing)} GPU(s) are gone and cannot be re-created: {exc}"]
        notes = []
        for i in missing:
            record = self.records[i]
            hold = lock_device(directory, record.gpu_uuid, exclusive=not record.share, kind=HOLD)
            if isinstance(hold, str):
                notes.append(f"lease on {record.gpu_uuid} lost with the lease directory: it is"
                             f" {hold} now")
                continue
            try:
                fd, final = _write_locked(directory, record)
            except LeaseError as exc:
                os.close(hold)
                notes.append(f"lease on {record.gpu_uuid} lost with the lease directory: {exc}")
                continue
            for old in (self._file_fds[i], self._lock_fds[i] if i < len(self._lock_fds) else -1):
                with contextlib.suppress(OSError):
                    if old >= 0:
                        os.close(old)
            self._file_fds[i], self._paths[i] = fd, final
            if i < len(self._lock_fds):
                self._lock_fds[i] = hold
            else:
                self._lock_fds.append(hold)
            notes.append(f"lease on {record.gpu_uuid} re-created in {directory} (its file was"
                         " removed with the lease directory)")
        self.fds = [*self._file_fds, *self._lock_fds]
        return notes

    def release(self) -> None:
        """Give the GPUs back: delete the files and drop the locks. Safe to call twice."""
        if self.released:
            return
        self.released = True
        _LIVE.discard(self)
        if os.getpid() != self._owner_pid:  # a forked child must not drop its parent's lease
            return
        for fd, path in zip(self._file_fds, self._paths, strict=True):
            with contextlib.suppress(OSError):
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    os.unlink(path)
            with contextlib.suppress(OSError):
                os.close(fd)
        for fd in self._lock_fds:  # lock files stay: deleting one could let two holders in
            with contextlib.suppress(OSError):
                os.close(fd)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"Lease({self.gpu_uuids!r}, {state})"


class _Identity:
    """What every lease file of one request says."""

    def __init__(self, memory: int | None, share: bool, command: str | None,
                 job: str | None = None) -> None:
        self.memory, self.share = memory, share
        self.command = command if command is not None else current_command()
        self.job = job if job is not None else default_job()
        self.user, self.host, self.since = user_name(os.geteuid()), os.uname().nodename, time.time()

    def record(self, uuid: str) -> LeaseRecord:
        return LeaseRecord(gpu_uuid=uuid, pid=os.getpid(), user=self.user, host=self.host,
                           command=self.command, since=self.since, memory=self.memory,
                           share=self.share, job=self.job)


def _take_one(directory: Path, uuid: str, me: _Identity, judge: Judge | None,
              into: Lease) -> str | None:
    """Lock ``uuid``, check it afresh, write its lease file into ``into``; or why not."""
    budget: int | None = None
    if me.share:  # one budget check at a time per device: two shares never both fit in one gap
        got = lock_device(directory, uuid, exclusive=True, kind=BUDGET, patience=_BUDGET_PATIENCE)
        if isinstance(got, str):
            return got
        budget = got
    try:
        hold = lock_device(directory, uuid, exclusive=not me.share, kind=HOLD)
        if isinstance(hold, str):
            return hold if hold.startswith("unusable:") else _busy_why(directory, uuid, me.share) or hold
        try:
            live = [r for r in file_records(directory) if r.gpu_uuid == uuid]
            clash = [r for r in live if not me.share or not r.share]
            why = clash[0].describe() if clash else (judge(uuid, live) if judge else None)
            if why is not None:
                os.close(hold)
                return why
            fd, final = _write_locked(directory, me.record(uuid))
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(hold)
            raise
        into._add(me.record(uuid), fd, final, hold)
        return None
    finally:
        if budget is not None:
            os.close(budget)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.lstat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def _busy_why(directory: Path, uuid: str, share: bool) -> str | None:
    """The lease record that explains a held device lock (None: no lease file, a bare lock)."""
    live = [r for r in file_records(directory) if r.gpu_uuid == uuid]
    clash = [r for r in live if not share or not r.share]
    return clash[0].describe() if clash else None


def _write_locked(directory: Path, record: LeaseRecord) -> tuple[int, Path]:
    """Write ``record`` atomically: a locked temp file renamed into place; return (fd, path)."""
    name = f"{safe_name(record.gpu_uuid)}.{record.pid}.{os.urandom(6).hex()}{SUFFIX}"
    final = directory / name
    return write_locked(directory, final, record.to_json().encode(), "a lease"), final


_LIVE: set[Lease] = set()


@atexit.register
def _release_all() -> None:
    """At a clean exit, delete our files (the locks would vanish anyway; this removes clutter)."""
    for lease in list(_LIVE):
        lease.release()
