"""The real Slurm fixture: ``slurm`` is a running one-node cluster (tests/slurm/cluster.py).

One cluster per pytest-xdist worker, started the first time a test asks for it (under a
second on this machine) and stopped at the end of the session; between tests every job is
cancelled and the queue drained. Where Slurm cannot run (not installed, not root, a machine
with real NVIDIA GPUs) every test here skips with the reason. ``.ci/run`` installs Debian's
``slurm-wlm`` and ``munge`` so that CI runs them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.cluster import SlurmCluster, slurm_missing


@pytest.fixture(scope="session")
def _slurm_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_missing()
    if why:
        pytest.skip(why)
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture
def slurm(_slurm_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """A running Slurm cluster with an empty queue; jobs left by the test are cancelled."""
    yield _slurm_session
    _slurm_session.clear()


@pytest.fixture(scope="session")
def _slurm_two_nodes_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = slurm_missing()
    if why:
        pytest.skip(why)
    with SlurmCluster.start(tmp_path_factory.mktemp("slurm2"), nodes=2) as cluster:
        yield cluster


@pytest.fixture
def slurm_two_nodes(_slurm_two_nodes_session: SlurmCluster) -> Iterator[SlurmCluster]:
    """A running two-node cluster (two slurmd on this host: ``dknode`` and ``dknode2``), for
    steps over several nodes; its queue is emptied after each test like ``slurm``'s."""
    yield _slurm_two_nodes_session
    _slurm_two_nodes_session.clear()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if {"slurm", "slurm_two_nodes"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slurm)
