"""MPI launchers (``mpirun``/``mpiexec``): Open MPI, MPICH/Intel MPI (PMI) and MVAPICH.

Open MPI sets OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}; MPICH and Intel MPI set
PMI_RANK/PMI_SIZE (plus MPI_LOCALRANKID/MPI_LOCALNRANKS); MVAPICH sets
MV2_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}. MPI does not say where rank 0 runs, so a job
over several nodes needs MASTER_ADDR exported to every rank (``mpirun -x MASTER_ADDR=...``).

Usage::

    from devicekit.parallel.environments.mpi import MPIEnvironment

    if MPIEnvironment.detect(os.environ):
        print(MPIEnvironment().read().rank)
"""

from __future__ import annotations

from collections.abc import Mapping

from devicekit.parallel.environments.base import (
    DEFAULT_PORT,
    DistEnv,
    Environment,
    integer_variable,
)

__all__ = ["MPIEnvironment", "FLAVOURS"]

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
        # ranks are placed by node in blocks (mpirun's default --map-by slot)
        nnodes = max(-(-world // max(local_world, 1)), 1)
        return self.check(
            DistEnv(
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                local_world_size=local_world,
                node_rank=rank // max(local_world, 1),
                nnodes=nnodes,
                master_addr=e.get("MASTER_ADDR") or "127.0.0.1",
                master_port=integer_variable(e, "MASTER_PORT", DEFAULT_PORT),
                source=self.name,
            )
        )
