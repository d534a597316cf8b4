"""Fixtures for ``devicekit serve``: simulated GPUs with a hostile process, a running server."""

from __future__ import annotations

import copy
import http.client
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from devicekit.serve import StatusServer
from devicekit.sharing.machine_status import collect_status
from tests.conftest import h100

#: a command line and a user name that try HTML, a script and terminal escapes
HOSTILE_COMMAND = 'python x.py "<script>alert(1)</script><img src=x onerror=alert(2)>" \x1b[2J\x1b]0;pwn\x07'
HOSTILE_USER = "<b>mallory</b>"
ALICE = {"pid": 4242, "user": "alice", "memory": "2GiB", "command": "python train.py"}
MALLORY = {"pid": 666, "user": HOSTILE_USER, "memory": "1GiB", "command": HOSTILE_COMMAND}


def machine(count: int = 3) -> list[dict[str, Any]]:
    """``count`` simulated GPUs: a busy one with alice's and a hostile process, a full one,
    the rest idle; the first carries temperature and power."""
    gpus = [h100(used="3GiB", util=35, temperature=51, power_draw=250.5, power_limit=700,
                 memory_bandwidth_utilization=12, processes=[ALICE, MALLORY]),
            h100(used="70GiB", util=90)]
    gpus += [h100() for _ in range(count - 2)]
    return gpus


@pytest.fixture
def server(simulate) -> Iterator[StatusServer]:
    """A server on a free loopback port over :func:`machine`, sampling every 0.2 s."""
    simulate(machine())
    srv = StatusServer("127.0.0.1", 0, interval=0.2)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def start_line(proc: subprocess.Popen[str], seconds: float = 60) -> str:
    """The first stdout line of a starting ``devicekit serve`` ("" if none within ``seconds``)."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if sel.select(timeout=max(deadline - time.monotonic(), 0)):
                return proc.stdout.readline()
    return ""


def get(server: StatusServer, path: str, method: str = "GET",
        timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """One request: ``(status, headers, body)``."""
    address, port = server.address
    conn = http.client.HTTPConnection(address, port, timeout=timeout)
    try:
        conn.request(method, path)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def get_json(server: StatusServer, path: str = "/api/status") -> dict[str, Any]:
    status, _, body = get(server, path)
    assert status == 200
    return json.loads(body)


def wait_for(server: StatusServer, predicate: Any, seconds: float = 30) -> None:
    """Wait until ``predicate(snapshot)`` holds (the sampler runs every 0.2 s)."""
    import time

    deadline = time.monotonic() + seconds
    while not predicate(server.sampler.snapshot):
        assert time.monotonic() < deadline, "the sampler did not catch up within the deadline"
        time.sleep(0.05)



SRC = str(Path(__file__).resolve().parents[2] / "src")


class ServeProcesses:
    """Starts ``devicekit serve --port 0`` children on loopback, each over its own simulated
    GPUs and lease directory; :meth:`stop_all` stops every one (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def __call__(self, simulation: Path, lease_dir: Path,
                 *args: str) -> tuple[subprocess.Popen[str], str]:
        """Start one; ``(process, url)`` once it printed its start line (within 60 s)."""
        env = dict(os.environ, PYTHONPATH=SRC, DEVICEKIT_SIMULATE=str(simulation),
                   DEVICEKIT_LEASE_DIR=str(lease_dir))
        env.pop("CUDA_VISIBLE_DEVICES", None)
        proc = subprocess.Popen([sys.executable, "-m", "devicekit", "serve", "--port", "0",
                                 "--interval", "200ms", *args], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.started.append(proc)
        line = start_line(proc)
        assert line.startswith("devicekit serve: http://"), f"no start line: {line!r}"
        return proc, line.split()[2]

    def stop_all(self) -> None:
        for proc in self.started:
            stop_process(proc)


@pytest.fixture
def serve_process() -> Iterator[ServeProcesses]:
    """``serve_process(simulation, lease_dir, *args) -> (process, url)``; all stopped after
    the test."""
    processes = ServeProcesses()
    try:
        yield processes
    finally:
        processes.stop_all()


def stop_process(proc: subprocess.Popen[str]) -> None:
    """SIGTERM ``proc`` and wait (bounded); SIGKILL if it does not stop."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
    else:
        proc.communicate(timeout=10)


def document(simulate, hostname: str, gpus: list[dict[str, Any]],
             leases: dict[int, dict[str, Any]] | None = None) -> Callable[[], dict[str, Any]]:
    """A collect function: the simulated ``gpus`` as ``hostname`` sees them, with ``leases``
    (GPU index -> lease fields) written in."""
    simulate(gpus, name=f"{hostname}.json")
    base = collect_status().to_dict()
    base["host"]["hostname"] = hostname
    for index, fields in (leases or {}).items():
        gpu = base["gpus"][index]
        gpu["leases"] = [{"gpu_uuid": gpu["uuid"], "pid": 4000 + index, "user": "bob",
                          "host": hostname, "command": "python secret.py", "since": time.time(),
                          "memory": None, "share": False, "kind": "lease",
                          "stopped_since": None, "job": None, **fields}]

    def collect() -> dict[str, Any]:
        doc = copy.deepcopy(base)
        doc["taken_at"] = time.time()
        return doc
    return collect
