"""torchrun (``torch.distributed.run``) and ``dk.launch``: both set the same variables.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK (the node),
GROUP_WORLD_SIZE (the node count), MASTER_ADDR and MASTER_PORT. ``dk.launch`` sets the same
ones plus ``DEVICEKIT_LAUNCH=1``. A launcher that sets only RANK and WORLD_SIZE (Kubeflow's
PyTorchJob, one process per pod) starts one process per node: local rank 0 of 1, node = rank.
Every launcher that starts several processes on a node says so with LOCAL_RANK.

Usage::

    from devicekit.hardware.launchers.torchrun import TorchrunEnvironment

    if TorchrunEnvironment.detect(os.environ):
        print(TorchrunEnvironment().read().local_rank)
"""

from __future__ import annotations

from collections.abc import Mapping

from devicekit.hardware.launchers.base import (
    DEFAULT_PORT,
    DistEnv,
    Environment,
    integer_variable,
)

__all__ = ["TorchrunEnvironment", "DevicekitEnvironment", "KubeflowEnvironment", "LAUNCH_MARKER", "PUBLISHED_MARKER",
           "published_by_devicekit"]

#: set by ``dk.launch`` in every rank it starts
LAUNCH_MARKER = "DEVICEKIT_LAUNCH"
#: set by ``dk.dist.init`` when it publishes torchrun's variables for a Slurm / MPI rank:
#: "<source>:<RANK>:<WORLD_SIZE>:<MASTER_PORT>", so those variables are not taken for torchrun's
PUBLISHED_MARKER = "DEVICEKIT_PUBLISHED_FROM"


def published_by_devicekit(environ: Mapping[str, str]) -> bool:
    """True when RANK & co. are the ones ``dk.dist.init`` published (not a launcher's)."""
    marker = environ.get(PUBLISHED_MARKER, "")
    own = ":".join(environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    return bool(marker) and marker.split(":", 1)[-1] == own


class TorchrunEnvironment(Environment):
    """Processes started by torchrun (or any launcher setting RANK and WORLD_SIZE)."""

    name = "torchrun"
    variables = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return ("RANK" in environ and "WORLD_SIZE" in environ
                and not published_by_devicekit(environ))

    def read(self) -> DistEnv:
        e = self.environ
        rank = integer_variable(e, "RANK")
        world = integer_variable(e, "WORLD_SIZE")
        if "LOCAL_RANK" not in e and "LOCAL_WORLD_SIZE" not in e:
            # one process per node (Kubeflow's PyTorchJob: one pod per rank)
            local_rank, local_world = 0, 1
        else:
            local_rank = integer_variable(e, "LOCAL_RANK", rank if "LOCAL_WORLD_SIZE" not in e else 0)
            local_world = integer_variable(e, "LOCAL_WORLD_SIZE", world)
        nnodes = integer_variable(e, "GROUP_WORLD_SIZE", max(world // max(local_world, 1), 1))
        node_rank = integer_variable(e, "GROUP_RANK", rank // max(local_world, 1))
        return self.check(
            DistEnv(
                rank=rank,
                local_rank=local_rank,
                world_size=world,
                local_world_size=local_world,
                node_rank=node_rank,
                nnodes=nnodes,
                master_addr=e.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1",
                master_port=integer_variable(e, "MASTER_PORT", DEFAULT_PORT),
                source=self.name,
            )
        )


class DevicekitEnvironment(TorchrunEnvironment):
    """Ranks started by ``dk.launch``: torchrun's variables plus ``DEVICEKIT_LAUNCH=1``."""

    name = "devicekit"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return environ.get(LAUNCH_MARKER) == "1" and TorchrunEnvironment.detect(environ)


class KubeflowEnvironment(TorchrunEnvironment):
    """A Kubeflow PyTorchJob pod: RANK, WORLD_SIZE, MASTER_ADDR/PORT, one process per pod."""

    name = "kubeflow"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return (("KUBERNETES_PORT" in environ or "KUBERNETES_SERVICE_HOST" in environ)
                and "LOCAL_RANK" not in environ and "GROUP_RANK" not in environ
                and "TORCHELASTIC_RUN_ID" not in environ and TorchrunEnvironment.detect(environ))
