"""Where the rank facts come from: torchrun, Kubeflow, Slurm, MPI, ``dk.launch`` or a plain process.

Each cluster environment is one small class with ``detect(environ)`` and ``read(environ)``
(Lightning Fabric's idea, without its connectors). :func:`detect_environment` asks them in
order of precedence and returns the first that recognises the variables; a plain process is
the fallback. This is the one reader of launcher variables: ``dk.dist.env()`` / ``dk.dist.init()``
(a rank's view), ``devicekit run`` (:mod:`devicekit.jobs.outer`: the launcher it runs under),
``dk.launch``, ``doctor`` (:mod:`devicekit.hardware.launcher_checks`) and ``status`` all ask it.
Slurm's rules (decided from the step, not the job name) are in :mod:`.slurm`.

On the hardware floor: the environment alone, no torch. Imports only ``errors``.

Usage::

    from devicekit.hardware.launchers import detect_environment

    facts = detect_environment().read()      # a frozen DistEnv
    print(facts.source, facts.rank, facts.world_size, facts.master_addr)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from devicekit.hardware.launchers.base import DistEnv, Environment
from devicekit.hardware.launchers.mpi import MPIEnvironment
from devicekit.hardware.launchers.single import SingleEnvironment
from devicekit.hardware.launchers.slurm import SlurmEnvironment, SlurmPlace, slurm_place
from devicekit.hardware.launchers.slurm_nodes import expand_nodelist
from devicekit.hardware.launchers.torchrun import (
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
    "SlurmPlace",
    "slurm_place",
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
