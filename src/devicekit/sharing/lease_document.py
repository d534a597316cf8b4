"""The schema of a lease file, and its one decoder: another user's bytes become a record here.

A lease file (``<uuid>.<pid>.<token>.lease``, JSON, at most 64 KiB) is written by whoever holds
the lease, so everything in it is its owner's word. :class:`LeaseDocument` bounds every field
(see :mod:`devicekit.hardware.document_fields`): the GPU UUID in its format and matching the
file's name, the pid a whole number the kernel could give, the job id in ``run --name``'s
format (or a Slurm job id), memory a size up to 2**62 bytes, strings of bounded length. What
devicekit takes from the file system instead: the user (the file's owner) and the lease's age
(the file's inode change time, which no plain user can set back; the document's own
``since`` is only checked, never used). A file that fails is :class:`BadDocument`, and its
reader shows it as ignored, with its owner and the reason.

Usage::

    from devicekit.sharing.lease_document import decode_lease

    doc = decode_lease(path.name, path.read_bytes())   # LeaseDocument, or BadDocument: why
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from devicekit.hardware.document_fields import (
    BadDocument,
    ByteCount,
    EpochSeconds,
    GpuUuid,
    JobId,
    Pid,
    Text,
    cut,
    decode,
)
from devicekit.sharing.device_locks import safe_name

__all__ = ["LeaseDocument", "decode_lease", "MAX_LEASE_BYTES", "MAX_COMMAND_SHOWN", "SUFFIX"]

#: a lease file's name ends so
SUFFIX = ".lease"

#: the largest lease file read (a real one is a few hundred bytes)
MAX_LEASE_BYTES = 64 * 1024
#: the most of a holder's command line a record keeps (longer ones end in ``...``)
MAX_COMMAND_SHOWN = 200


class LeaseDocument(msgspec.Struct, frozen=True):
    """What a lease file may say (unknown keys are skipped; ``user`` is never read)."""

    gpu_uuid: GpuUuid
    pid: Pid
    host: Annotated[str, msgspec.Meta(max_length=255)] = ""
    command: Text = ""
    since: EpochSeconds | None = None
    memory: ByteCount | None = None
    share: bool = False
    job: JobId | None = None


def decode_lease(name: str, data: bytes) -> LeaseDocument:
    """The bytes of the lease file named ``name`` as a :class:`LeaseDocument` (its command
    cut to :data:`MAX_COMMAND_SHOWN` characters), or :class:`BadDocument` saying why."""
    doc = decode(data, LeaseDocument, limit=MAX_LEASE_BYTES)
    named = name[: -len(SUFFIX)].rsplit(".", 2)[0] if name.endswith(SUFFIX) else name
    if safe_name(doc.gpu_uuid) != named:
        raise BadDocument(f"its JSON says GPU {doc.gpu_uuid} but its name {cut(named, 100)}")
    if len(doc.command) > MAX_COMMAND_SHOWN:
        doc = msgspec.structs.replace(doc, command=cut(doc.command, MAX_COMMAND_SHOWN))
    return doc
