"""The one schema of a lab peer's status document (``/api/status``), with a bound on every field.

What another machine's ``devicekit serve`` sends is decoded by msgspec straight into these
types (:mod:`~devicekit.serve.peer_document` does it, once): a value of the wrong type, a
number outside its range (NaN and infinities are no JSON, ``1e999`` is out of range), an
identifier not in its format or a list longer than any real machine's fails the whole document,
with the JSON path of the bad value. Free text (commands, user names, reasons) is cut to its
bound as it is decoded, never refused: it is another user's text, printed inert downstream.
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

__all__ = ["PeerStatus", "PeerGPU", "PeerMig", "PeerProcess", "PeerLease", "PeerTicket",
           "PeerHost", "is_identifier", "UUID_PATTERN", "MAX_GPUS", "MAX_MIG", "MAX_PROCESSES",
           "MAX_GPU_LEASES", "MAX_MIG_LEASES", "MAX_OTHER_LEASES", "MAX_QUEUE", "MAX_TEXT",
           "MAX_WARNINGS"]

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
Percent = Annotated[float, Meta(ge=0, le=100)]
Celsius = Annotated[float, Meta(ge=-100, le=250)]
Watts = Annotated[float, Meta(ge=0, le=100_000)]
#: seconds since the epoch; the window around this machine's clock is checked after decoding
Epoch = Annotated[float, Meta(ge=0, le=2**32)]
#: a declared time limit: at most ten years
Seconds = Annotated[float, Meta(ge=0, le=10 * 366 * 86400)]
Load = Annotated[float, Meta(ge=0, le=1e6)]
Words = Annotated[list[Annotated[str, Meta(max_length=200)]], Meta(max_length=512)]


def is_identifier(value: Any) -> bool:
    """Whether ``value`` is a GPU or MIG UUID in :data:`UUID_PATTERN` (safe in a shell command)."""
    return isinstance(value, str) and len(value) <= 96 and bool(_UUID_RE.match(value))


def cut(value: str | None, limit: int = MAX_TEXT) -> str | None:
    return value[:limit] if value is not None and len(value) > limit else value


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

    def __post_init__(self) -> None:
        self.user, self.host = cut(self.user, 100), cut(self.host, 100)
        self.command, self.kind, self.job = cut(self.command), cut(self.kind, 10) or "", \
            cut(self.job, 64)


class PeerProcess(_Base):
    pid: Pid
    user: str | None = None
    command: str | None = None
    memory: Bytes | None = None

    def __post_init__(self) -> None:
        self.user, self.command = cut(self.user, 100), cut(self.command)


class PeerMig(_Base):
    index: Index
    uuid: Uuid
    name: str = ""
    memory_total: Bytes = 0
    memory_used: Bytes = 0
    memory_free: Bytes | None = None
    leases: Annotated[list[PeerLease], Meta(max_length=MAX_MIG_LEASES)] = []

    def __post_init__(self) -> None:
        self.name = cut(self.name, 100) or ""


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

    def __post_init__(self) -> None:
        self.name, self.pci_bus_id = cut(self.name, 100) or "", cut(self.pci_bus_id, 40)
        self.compute_capability, self.compute_mode = cut(self.compute_capability, 10), \
            cut(self.compute_mode, 30)
        self.backend, self.blocked = cut(self.backend, 20), cut(self.blocked)


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

    def __post_init__(self) -> None:
        self.ticket = cut(self.ticket, 20) or ""
        self.user, self.host = cut(self.user, 100), cut(self.host, 100)
        self.command, self.filters, self.reason = cut(self.command), cut(self.filters, 200), \
            cut(self.reason)
        self.reserved = [cut(r, 40) or "" for r in self.reserved[:MAX_GPUS]]
        self.reserved_uuids = [u for u in self.reserved_uuids[:MAX_GPUS * (MAX_MIG + 1)]
                               if is_identifier(u)]


class PeerHost(_Base):
    hostname: str | None = None
    cpu_count_logical: Count | None = None
    cpu_count_physical: Count | None = None
    load_average: Annotated[list[Load], Meta(min_length=3, max_length=3)] | None = None
    memory_total: Bytes | None = None
    memory_available: Bytes | None = None
    memory_used: Bytes | None = None
    usable_cpus: Count | None = None

    def __post_init__(self) -> None:
        self.hostname = cut(self.hostname, 100)


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

    def __post_init__(self) -> None:
        self.devicekit_version, self.backend = cut(self.devicekit_version, 40), \
            cut(self.backend, 20)
        self.driver_version, self.cuda_driver_version = cut(self.driver_version, 40), \
            cut(self.cuda_driver_version, 20)
        extra = len(self.warnings) - MAX_WARNINGS
        self.warnings = [cut(w) or "" for w in self.warnings[:MAX_WARNINGS]]
        if extra > 0:
            self.warnings.append(f"{extra} more warning(s) on the host itself")
