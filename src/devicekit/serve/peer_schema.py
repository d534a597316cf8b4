"""The one schema of a lab peer's status document (``/api/status``), with a bound on every field.

What another machine's ``devicekit serve`` sends is decoded by msgspec straight into these
types (:mod:`~devicekit.serve.peer_document` does it, once): a value of the wrong type, a
number outside its range (NaN and infinities are no JSON, ``1e999`` is out of range), an
identifier not in its format or a list longer than any real machine's fails the whole document,
with the JSON path of the bad value. Free text (commands, user names, reasons) is cut to its
bound by :func:`cut_texts` once the lists are known to be short, never refused: it is another
user's text, printed inert downstream. No type here runs Python code while msgspec decodes (a
``__post_init__`` per item made a 4 MiB list of tiny items 10x slower to refuse).
Fields a newer devicekit adds are skipped; the schema is ``status --json``'s (docs/cli.md).

The bounds, stated once (docs/lab.md has them as a table):

- lists: :data:`MAX_GPUS` GPUs, :data:`MAX_MIG` MIG instances per GPU (NVIDIA's most is 7),
  :data:`MAX_PROCESSES` processes and :data:`MAX_GPU_LEASES` leases per GPU, :data:`MAX_MIG_LEASES`
  per MIG instance, :data:`MAX_OTHER_LEASES` leases on no GPU, :data:`MAX_QUEUE` waiting tickets;
- identifiers: GPU and MIG UUIDs match :data:`UUID_PATTERN` (at most 96 characters); indices
  0-255; pids 0-2**31; counts and sizes non-negative ints below 2**53 bytes (8 PiB);
- numbers: utilization 0-100 %, temperature -100-250 C, power 0-100 kW, times finite epoch
  seconds in [0, 2**32] here and checked against this machine's clock after decoding.

Usage::

    import msgspec
    from devicekit.serve.peer_schema import PeerStatus

    doc = msgspec.json.Decoder(PeerStatus).decode(body)   # msgspec.ValidationError: ... at `$.gpus[0]`
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

# the field types every untrusted document shares (hardware/document_fields.py): one definition
from devicekit.hardware.document_fields import EpochSeconds as Epoch
from devicekit.hardware.document_fields import Percent, Seconds

__all__ = ["PeerStatus", "PeerGPU", "PeerMig", "PeerProcess", "PeerLease", "PeerTicket",
           "PeerHost", "is_identifier", "UUID_PATTERN", "MAX_GPUS", "MAX_MIG", "MAX_PROCESSES",
           "MAX_GPU_LEASES", "MAX_MIG_LEASES", "MAX_OTHER_LEASES", "MAX_QUEUE", "MAX_TEXT",
           "MAX_WARNINGS", "TEXT_LIMITS", "cut_texts"]

#: GPUs one peer may list (a DGX has 8; MIG instances are listed under their GPU)
MAX_GPUS = 64
#: MIG instances per GPU (7 on every MIG-capable NVIDIA GPU)
MAX_MIG = 7
#: processes on one GPU
MAX_PROCESSES = 256
#: leases on one GPU (its MIG instances' included) and on one MIG instance
MAX_GPU_LEASES = 256
MAX_MIG_LEASES = 64
#: leases whose GPU is not present, and waiting tickets of one machine
MAX_OTHER_LEASES = 256
MAX_QUEUE = 1024
#: the longest free text kept from a peer (a command line); the rest is cut
MAX_TEXT = 300
#: warnings kept from one peer (more are counted in one more warning)
MAX_WARNINGS = 20
#: a GPU or MIG UUID as NVML gives it (``GPU-8e0b...``), and as safe as a word of a shell command
UUID_PATTERN = r"^(GPU|MIG)-[A-Za-z0-9][A-Za-z0-9_.:-]{0,91}\Z"
_UUID_RE = re.compile(UUID_PATTERN)

Uuid = Annotated[str, Meta(pattern=UUID_PATTERN, max_length=96)]
Index = Annotated[int, Meta(ge=0, le=255)]
Pid = Annotated[int, Meta(ge=0, le=2**31)]
Bytes = Annotated[int, Meta(ge=0, lt=2**53)]
Count = Annotated[int, Meta(ge=0, le=65536)]
Celsius = Annotated[float, Meta(ge=-100, le=250)]
Watts = Annotated[float, Meta(ge=0, le=100_000)]
# Epoch: seconds since the epoch; the window around this machine's clock is checked after
# decoding. Seconds: a declared time limit, at most ten years.
Load = Annotated[float, Meta(ge=0, le=1e6)]
Words = Annotated[list[Annotated[str, Meta(max_length=200)]], Meta(max_length=512)]


def is_identifier(value: Any) -> bool:
    """Whether ``value`` is a GPU or MIG UUID in :data:`UUID_PATTERN` (safe in a shell command)."""
    return isinstance(value, str) and len(value) <= 96 and bool(_UUID_RE.match(value))


class _Base(msgspec.Struct, gc=False):
    """Schema types: decoded by msgspec, never built from a peer's bytes any other way."""


class PeerLease(_Base):
    """A lease on a peer (docs/cli.md, "A lease object")."""

    gpu_uuid: Uuid
    pid: Pid
    user: str | None = None
    host: str | None = None
    command: str | None = None
    since: Epoch | None = None
    memory: Bytes | None = None
    share: bool = False
    kind: str = "lease"
    stopped_since: Epoch | None = None
    job: str | None = None
    idle_since: Epoch | None = None



class PeerProcess(_Base):
    pid: Pid
    user: str | None = None
    command: str | None = None
    memory: Bytes | None = None



class PeerMig(_Base):
    index: Index
    uuid: Uuid
    name: str = ""
    memory_total: Bytes = 0
    memory_used: Bytes = 0
    memory_free: Bytes | None = None
    leases: Annotated[list[PeerLease], Meta(max_length=MAX_MIG_LEASES)] = []



class PeerGPU(_Base):
    index: Index
    uuid: Uuid
    name: str = ""
    pci_bus_id: str | None = None
    memory_total: Bytes = 0
    memory_used: Bytes = 0
    memory_free: Bytes | None = None
    utilization: Percent | None = None
    memory_bandwidth_utilization: Percent | None = None
    temperature: Celsius | None = None
    power_draw: Watts | None = None
    power_limit: Watts | None = None
    compute_capability: str | None = None
    compute_mode: str | None = None
    mig_enabled: bool = False
    backend: str | None = None
    blocked: str | None = None
    mig_devices: Annotated[list[PeerMig], Meta(max_length=MAX_MIG)] = []
    processes: Annotated[list[PeerProcess], Meta(max_length=MAX_PROCESSES)] = []
    leases: Annotated[list[PeerLease], Meta(max_length=MAX_GPU_LEASES)] = []



class PeerTicket(_Base):
    """A waiting ticket (docs/cli.md, ``devicekit queue``)."""

    ticket: str
    user: str | None = None
    pid: Pid | None = None
    host: str | None = None
    command: str | None = None
    gpus_asked: Count | None = None
    filters: str | None = None
    since: Epoch | None = None
    time_limit: Seconds | None = None
    reserved: Words = []
    reserved_uuids: Words = []
    reason: str | None = None
    backfill: bool = False



class PeerHost(_Base):
    hostname: str | None = None
    cpu_count_logical: Count | None = None
    cpu_count_physical: Count | None = None
    load_average: Annotated[list[Load], Meta(min_length=3, max_length=3)] | None = None
    memory_total: Bytes | None = None
    memory_available: Bytes | None = None
    memory_used: Bytes | None = None
    usable_cpus: Count | None = None



class PeerStatus(_Base):
    """A peer's whole ``status --json`` document, schema 1."""

    schema: Literal[1]
    gpus: Annotated[list[PeerGPU], Meta(max_length=MAX_GPUS)]
    taken_at: Epoch | None = None
    devicekit_version: str | None = None
    host: PeerHost = msgspec.field(default_factory=PeerHost)
    backend: str | None = None
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    other_leases: Annotated[list[PeerLease], Meta(max_length=MAX_OTHER_LEASES)] = []
    warnings: Annotated[list[str], Meta(max_length=4096)] = []
    queue: Annotated[list[PeerTicket], Meta(max_length=MAX_QUEUE)] = []



#: the longest text kept of each text field (the rest is cut)
TEXT_LIMITS: dict[type, dict[str, int]] = {
    PeerLease: {"user": 100, "host": 100, "command": MAX_TEXT, "kind": 10, "job": 64},
    PeerProcess: {"user": 100, "command": MAX_TEXT},
    PeerMig: {"name": 100},
    PeerGPU: {"name": 100, "pci_bus_id": 40, "compute_capability": 10, "compute_mode": 30,
              "backend": 20, "blocked": MAX_TEXT},
    PeerTicket: {"ticket": 20, "user": 100, "host": 100, "command": MAX_TEXT, "filters": 200,
                 "reason": MAX_TEXT},
    PeerHost: {"hostname": 100},
    PeerStatus: {"devicekit_version": 40, "backend": 20, "driver_version": 40,
                 "cuda_driver_version": 20},
}


def _cut(item: _Base) -> None:
    for name, limit in TEXT_LIMITS[type(item)].items():
        value = getattr(item, name)
        if value is not None and len(value) > limit:
            setattr(item, name, value[:limit])


def cut_texts(doc: PeerStatus) -> None:
    """Cut every text of a decoded document to its bound (:data:`TEXT_LIMITS`), in place; keep
    :data:`MAX_WARNINGS` warnings (and say how many more), labels and UUIDs the ticket reserves."""
    _cut(doc)
    _cut(doc.host)
    for gpu in doc.gpus:
        _cut(gpu)
        for mig in gpu.mig_devices:
            _cut(mig)
            for lease in mig.leases:
                _cut(lease)
        for process in gpu.processes:
            _cut(process)
        for lease in gpu.leases:
            _cut(lease)
    for lease in doc.other_leases:
        _cut(lease)
    for ticket in doc.queue:
        _cut(ticket)
        ticket.reserved = [label[:40] for label in ticket.reserved[:MAX_GPUS]]
        ticket.reserved_uuids = [u for u in ticket.reserved_uuids[:MAX_GPUS * (MAX_MIG + 1)]
                                 if is_identifier(u)]
    extra = len(doc.warnings) - MAX_WARNINGS
    doc.warnings = [w[:MAX_TEXT] for w in doc.warnings[:MAX_WARNINGS]]
    if extra > 0:
        doc.warnings.append(f"{extra} more warning(s) on the host itself")
