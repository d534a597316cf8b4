"""Fixtures for ``devicekit serve``: simulated GPUs with a hostile process, a running server."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest

from devicekit.serve import StatusServer
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

