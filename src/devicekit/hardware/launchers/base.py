"""The rank facts every environment reports, and the small base class they share.

Usage::

    from devicekit.hardware.launchers.base import DistEnv

    facts = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                    nnodes=1, master_addr="127.0.0.1", master_port=29500, source="single")
"""

from __future__ import annotations

import ipaddress
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from devicekit.errors import DistributedError

__all__ = ["DistEnv", "Environment", "integer_variable", "is_loopback", "DEFAULT_PORT", "check_resolvable"]

#: torchrun's default master port; used where nothing else says which port to use.
DEFAULT_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in a distributed job, as read from the environment.

    ``source`` is ``"torchrun"``, ``"slurm"``, ``"mpi"``, ``"devicekit"`` (``dk.launch``) or
    ``"single"`` (a plain process: rank 0 of 1).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    source: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    def describe(self) -> str:
        """One line for logs: ``rank 1/4 (local 1/2, node 0/2) via torchrun, master host:port``."""
        return (
            f"rank {self.rank}/{self.world_size} (local {self.local_rank}/{self.local_world_size},"
            f" node {self.node_rank}/{self.nnodes}) via {self.source},"
            f" master {self.master_addr}:{self.master_port}"
        )


class Environment(ABC):
    """One launcher's variables. Subclasses set ``name`` and implement ``detect`` and ``read``."""

    name: ClassVar[str] = "?"
    #: the variables that carry (rank, world size, local rank), for messages
    variables: ClassVar[tuple[str, str, str]] = ("rank", "world size", "local rank")

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    @staticmethod
    @abstractmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when this launcher's variables are present."""

    @abstractmethod
    def read(self) -> DistEnv:
        """The rank facts from the variables; one-line DistributedError when they are bad."""

    def check(self, facts: DistEnv, variables: tuple[str, str, str] | None = None) -> DistEnv:
        """Reject facts no launcher could mean (rank outside the world, zero processes)."""
        rank, size, local = variables or self.variables
        where = f"{self.name} variables"
        if facts.world_size < 1:
            raise DistributedError(f"{size}={facts.world_size} ({where}) must be >= 1")
        if not 0 <= facts.rank < facts.world_size:
            raise DistributedError(
                f"{rank}={facts.rank} is not in 0..{facts.world_size - 1} ({size}="
                f"{facts.world_size}, {where}); check the launcher's rank variables"
            )
        if not 0 <= facts.local_rank < max(facts.local_world_size, 1):
            raise DistributedError(
                f"{local}={facts.local_rank} is not below the {facts.local_world_size}"
                f" process(es) of this node ({where})"
            )
        if not 0 < facts.master_port < 65536:
            raise DistributedError(f"master port {facts.master_port} from {where} is not a TCP port")
        return facts


def integer_variable(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    """``int(environ[name])`` with a one-line error naming the variable when it is not a number."""
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise DistributedError(f"environment variable {name} is not set; the launcher must set it")
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise DistributedError(f"{name}={raw!r} is not an integer; fix the launcher's variables") from None


def is_loopback(address: str) -> bool:
    """True for ``localhost``, ``127.x.y.z`` and ``::1``: addresses other machines cannot reach."""
    host = address.strip().strip("[]").lower()
    if host in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_resolvable(address: str, what: str = "master address") -> None:
    """One-line :class:`DistributedError` when ``address`` names no host this machine can find.

    torchrun would otherwise retry the rendezvous with ``gai error -2`` every few seconds until
    its timeout. An IP address is always accepted (whether it answers is the rendezvous's job).
    """
    import socket

    host = address.strip().strip("[]")
    if not host:
        raise DistributedError(f"{what} {address!r} is empty; give node 0's host name or IP")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as exc:
        why = exc.strerror if isinstance(exc, socket.gaierror) and exc.strerror else str(exc)
        raise DistributedError(
            f"{what} {address!r} does not resolve ({why}); give node 0's host name or IP as"
            " every node can reach it (check with: getent hosts " + host + ")"
        ) from None
