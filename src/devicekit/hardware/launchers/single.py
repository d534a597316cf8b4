"""A plain process: rank 0 of a world of one.

Usage::

    from devicekit.hardware.launchers.single import SingleEnvironment

    assert SingleEnvironment().read().world_size == 1
"""

from __future__ import annotations

from collections.abc import Mapping

from devicekit.hardware.launchers.base import (
    DEFAULT_PORT,
    DistEnv,
    Environment,
    integer_variable,
)

__all__ = ["SingleEnvironment"]


class SingleEnvironment(Environment):
    """No launcher: one process, rank 0. MASTER_ADDR/MASTER_PORT are honoured if set."""

    name = "single"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        return True

    def read(self) -> DistEnv:
        e = self.environ
        return DistEnv(
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            node_rank=0,
            nnodes=1,
            master_addr=e.get("MASTER_ADDR", "127.0.0.1") or "127.0.0.1",
            master_port=integer_variable(e, "MASTER_PORT", DEFAULT_PORT),
            source=self.name,
        )
