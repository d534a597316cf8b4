"""Shared by tests/parallel, tests/jobs and tests/strategy: a machine with no GPU, and environments for rank subprocesses.

Each of those folders' conftest.py imports the fixtures from here (``no_launcher`` is autouse there).
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import devicekit

#: the src directory of the devicekit under test, for PYTHONPATH of every subprocess
SRC = str(Path(devicekit.__file__).resolve().parents[1])

RANK_VARIABLES = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "DEVICEKIT_LAUNCH", "DEVICEKIT_OWN_DEVICES",
    "DEVICEKIT_GPUS_PER_PROC", "DEVICEKIT_LOOPBACK_OK", "SLURM_PROCID", "SLURM_NTASKS",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_JOB_NODELIST",
    "SLURM_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE",
    "SLURM_JOB_ID", "SLURM_JOB_NAME", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE",
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_RANK", "MV2_COMM_WORLD_RANK",
    "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE",
    "KUBERNETES_PORT", "KUBERNETES_SERVICE_HOST",  # a CI pod would look like a Kubeflow job
    "SLURM_STEP_ID", "SLURM_STEPID", "PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR",
    "PET_MASTER_PORT", "PET_NPROC_PER_NODE", "PET_RDZV_BACKEND", "PET_RDZV_ENDPOINT", "PET_RDZV_ID",
    "PET_MAX_RESTARTS",
)


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_cuda: None) -> None:
    """No launcher variables, no GPU (an empty simulation; CUDA hidden from torch too)."""
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    empty = tmp_path / "no-gpus.json"
    empty.write_text(json.dumps({"gpus": []}))
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(empty))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a subprocess running the devicekit under test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def worker_ports(ports: range) -> range:
    """This pytest-xdist worker's share of ``ports`` (all of them outside xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1:
        return ports
    index = int(worker[2:]) % count
    size = len(ports) // count
    return ports[index * size:(index + 1) * size]


def rendezvous_port() -> int:
    """A free port below the ephemeral range, for processes that rendezvous on it later.

    A port the OS hands out as free (bind to 0) is an ephemeral one; a TCPStore client that
    retries ``connect()`` to it before the server listens can get it as its own local port and
    connect to itself (TCP simultaneous open), hanging the rendezvous.

    Under pytest-xdist each worker draws from its own slice of that range, so two workers never
    hand out the same port (a port checked free here is only bound later, by the ranks).
    """
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) \
        if Path("/proc/sys/net/ipv4/ip_local_port_range").exists() else 32768
    ports = worker_ports(range(20000, min(low, 32768)))
    for port in random.sample(ports, min(200, len(ports))):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


def pid_written(pid_file: Path, timeout: float = 30) -> int:
    """The pid a started child writes to ``pid_file``, waiting for it at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "child never started"
        time.sleep(0.05)
    return int(pid_file.read_text())


def devicekit_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "devicekit", *args]


@pytest.fixture
def no_leftover_children() -> Iterator[None]:
    """Fails the test if a process it started (directly or not) is still alive afterwards."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    left = [p for p in me.children(recursive=True)
            if p.pid not in before and "resource_tracker" not in " ".join(_cmdline(p))]
    alive = []
    for proc in left:
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    for proc in alive:
        proc.kill()
    assert not alive, f"processes left behind: {[(p.pid, p.cmdline()) for p in alive]}"


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
