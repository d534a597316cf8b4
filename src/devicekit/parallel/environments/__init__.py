"""Where the rank facts come from: torchrun, Kubeflow, Slurm, MPI, ``dk.launch`` or a plain process.

Each cluster environment is one small class with ``detect(environ)`` and ``read(environ)``
(Lightning Fabric's idea, without its connectors). :func:`detect_environment` asks them in
order of precedence and returns the first that recognises the variables; a plain process is
the fallback. ``dk.dist.env()`` is the public entry point.

Part of the ``parallel`` wing (what a rank reads about itself); ``devicekit.jobs`` reads the
same classes to join an outer launcher's job. Imports only ``errors``.

Usage::

    from devicekit.parallel.environments import detect_environment

    facts = detect_environment().read()      # a frozen DistEnv
    print(facts.source, facts.rank, facts.world_size, facts.master_addr)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from devicekit.parallel.environments.base import DistEnv, Environment
from devicekit.parallel.environments.mpi import MPIEnvironment
from devicekit.parallel.environments.single import SingleEnvironment
from devicekit.parallel.environments.slurm import SlurmEnvironment, expand_nodelist
from devicekit.parallel.environments.torchrun import (
    DevicekitEnvironment,
    KubeflowEnvironment,
    TorchrunEnvironment,
)

__all__ = [
    "DistEnv",
    "Environment",
    "DevicekitEnvironment",
    "TorchrunEnvironment",
    "KubeflowEnvironment",
    "SlurmEnvironment",
    "MPIEnvironment",
    "SingleEnvironment",
    "ENVIRONMENTS",
    "detect_environment",
    "expand_nodelist",
]

#: Order of precedence: a launcher started inside a Slurm or MPI job sets its own variables,
#: which describe the processes better than the outer allocation does.
ENVIRONMENTS: tuple[type[Environment], ...] = (
    DevicekitEnvironment,
    KubeflowEnvironment,
    TorchrunEnvironment,
    SlurmEnvironment,
    MPIEnvironment,
)


def detect_environment(environ: Mapping[str, str] | None = None) -> Environment:
    """The first environment whose variables are present (a plain process when none is)."""
    environ = os.environ if environ is None else environ
    for kind in ENVIRONMENTS:
        if kind.detect(environ):
            return kind(environ)
    return SingleEnvironment(environ)
