"""MPI launchers (``mpirun``/``mpiexec``): Open MPI, MPICH/Intel MPI (PMI) and MVAPICH.

Open MPI sets OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; MPICH and Intel MPI set
PMI_RANK/PMI_SIZE (plus MPI_LOCALRANKID/MPI_LOCALNRANKS); MVAPICH sets
MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}. MPI does not say where rank 0 runs, so a job
over several nodes needs MASTER_ADDR exported to every rank (``mpirun -x MASTER_ADDR=...``).

MPI does not name the node either. Where mpi4py is installed, node ranks come from the host
names of all ranks (as Lightning does: the sorted distinct host names, this host's index).
Without it (or when the program has not imported ``mpi4py.MPI``) they come from the variables: the local rank tells block placement (mpirun's
default, ``--map-by slot``) from round-robin placement (``--map-by node``); a placement that
is neither (a rankfile) is refused with one line rather than guessed.

Usage::

    from devicekit.hardware.launchers.mpi import MPIEnvironment

    if MPIEnvironment.detect(os.environ):
        print(MPIEnvironment().read().rank)
"""

from __future__ import annotations

import functools
import socket
import sys
from collections.abc import Mapping, Sequence

from devicekit.errors import DistributedError
from devicekit.hardware.launchers.base import (
    DEFAULT_PORT,
    DistEnv,
    Environment,
    integer_variable,
)

__all__ = ["MPIEnvironment", "FLAVOURS", "node_of_host", "gather_hostnames"]

#: (rank, size, local rank, local size) variable names per MPI flavour, in order of preference
FLAVOURS: tuple[tuple[str, str, str, str], ...] = (
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
     "MV2_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


class MPIEnvironment(Environment):
    """Ranks started by an MPI launcher."""

    name = "mpi"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return any(rank in environ and size in environ for rank, size, _, _ in FLAVOURS)

    def read(self) -> DistEnv:
        e = self.environ
        rank_var, size_var, local_var, local_size_var = next(
            f for f in FLAVOURS if f[0] in e and f[1] in e
        )
        rank = integer_variable(e, rank_var)
        world = integer_variable(e, size_var)
        local_world = integer_variable(e, local_size_var, world)
        local_rank = integer_variable(e, local_var, rank % max(local_world, 1))
        hosts = gather_hostnames() if world > 1 else None
        if hosts is not None and len(hosts) == world:
            node_rank, nnodes = node_of_host(hosts, hosts[rank])
        else:
            node_rank, nnodes = _node_from_placement(rank, world, local_rank, local_world)
        return self.check(
            DistEnv(
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                local_world_size=local_world,
                node_rank=node_rank,
                nnodes=nnodes,
                master_addr=e.get("MASTER_ADDR") or "127.0.0.1",
                master_port=integer_variable(e, "MASTER_PORT", DEFAULT_PORT),
                source=self.name,
            ),
            (rank_var, size_var, local_var),
        )


def node_of_host(hostnames: Sequence[str], host: str) -> tuple[int, int]:
    """(node rank, node count): ``host``'s index among the sorted distinct ``hostnames``."""
    unique = sorted(set(hostnames))
    return unique.index(host), len(unique)


@functools.cache
def gather_hostnames() -> list[str] | None:
    """Every rank's host name in rank order, through mpi4py; None where it is not in use.

    Only when the program has imported ``mpi4py.MPI`` itself (devicekit never starts MPI
    behind your back); the collective runs once per process and is remembered, so every rank
    must read ``dk.dist.env()`` at least once, as ``dk.dist.init()`` does.
    """
    MPI = sys.modules.get("mpi4py.MPI")
    if MPI is None:
        return None
    try:
        return [str(h) for h in MPI.COMM_WORLD.allgather(socket.gethostname())]
    except Exception:  # an MPI that cannot run the collective: fall back to the variables
        return None


def _node_from_placement(rank: int, world: int, local_rank: int, local_world: int
                         ) -> tuple[int, int]:
    """Node rank and count from the rank variables alone (block or round-robin placement)."""
    per_node = max(local_world, 1)
    nnodes = max(-(-world // per_node), 1)
    if rank % per_node == local_rank:  # --map-by slot (the default): ranks in blocks per node
        return rank // per_node, nnodes
    if rank // nnodes == local_rank:  # --map-by node: ranks dealt round-robin over the nodes
        return rank % nnodes, nnodes
    raise DistributedError(
        f"MPI rank {rank} is local rank {local_rank} of {per_node}, which neither block nor"
        " round-robin placement gives; install mpi4py so devicekit can read the ranks' host names"
    )
