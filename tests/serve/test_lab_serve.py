"""``devicekit serve --peer``: ``/api/lab`` and the lab page over in-process servers.

The peers are :class:`StatusServer` instances whose samplers hand out made-up documents, so
each "host" differs; a closed port and a socket that never answers play the broken peers.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from devicekit.cli.main import main
from devicekit.serve import StatusServer
from devicekit.serve.peer_fetch import PeerAddress
from devicekit.serve.sampler import Sampler
from tests.conftest import h100
from tests.serve.conftest import document, get, machine


@pytest.fixture
def servers() -> Iterator[Callable[..., StatusServer]]:
    started: list[StatusServer] = []

    def start(collect: Callable[[], dict[str, Any]] | None = None, **kwargs: Any) -> StatusServer:
        sampler = Sampler(0.2, collect=collect, hide_commands=kwargs.get("hide_commands", False)) \
            if collect is not None else None
        server = StatusServer("127.0.0.1", 0, interval=0.2, sampler=sampler, **kwargs)
        server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def address(server: StatusServer) -> PeerAddress:
    return PeerAddress.parse(f"127.0.0.1:{server.address[1]}")


def lab_when(server: StatusServer, predicate: Callable[[dict[str, Any]], bool],
             seconds: float = 30) -> dict[str, Any]:
    """``/api/lab`` once ``predicate`` holds for it (bounded)."""
    deadline = time.monotonic() + seconds
    while True:
        status, _, body = get(server, "/api/lab")
        assert status == 200
        lab = json.loads(body)
        if predicate(lab):
            return lab
        assert time.monotonic() < deadline, f"the lab never got there: {lab['hosts']}"
        time.sleep(0.05)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_api_lab_merges_every_peer_with_age_and_error(simulate, servers):
    one = servers(document(simulate, "gpu1", [h100(uuid="GPU-11"), h100(uuid="GPU-12")],
                           {0: {"job": "bert-7"}}))
    two = servers(document(simulate, "gpu2", [h100(used="70GiB", util=99, uuid="GPU-21")]))
    dead = PeerAddress.parse(f"127.0.0.1:{_closed_port()}")
    simulate(machine())
    lab_server = servers(peers=[address(one), address(two), dead])
    lab = lab_when(lab_server, lambda d: d["hosts"][1]["ok"] and d["hosts"][2]["ok"])
    local, first, second, down = lab["hosts"]
    assert local["local"] and local["ok"] and local["url"] is None
    assert [first["host"], second["host"]] == [address(one).label, address(two).label]
    assert first["status"]["host"]["hostname"] == "gpu1" and 0 <= first["age"] < 10
    assert first["status"]["gpus"][0]["leases"][0]["job"] == "bert-7"
    assert not down["ok"] and down["status"] is None and "connection refused" in down["error"]
    status, headers, body = get(lab_server, "/lab")
    page = body.decode()
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert 'data-fragment="/lab/fragment"' in page and "bert-7" in page
    for host in ("gpu1", "gpu2", address(one).label, down["host"]):
        assert host in page
    assert "connection refused" in page
    _, _, fragment = get(lab_server, "/lab/fragment")
    assert b"bert-7" in fragment and b"<html" not in fragment


def test_a_peer_that_stops_keeps_its_last_answer_with_the_error(simulate, servers):
    peer = servers(document(simulate, "gpu1", [h100(uuid="GPU-11")], {0: {"job": "j1"}}))
    simulate(machine())
    lab_server = servers(peers=[address(peer)])
    lab_when(lab_server, lambda d: d["hosts"][1]["ok"])
    peer.stop()
    lab = lab_when(lab_server, lambda d: d["hosts"][1]["error"] is not None)
    host = lab["hosts"][1]
    assert not host["ok"] and host["status"]["host"]["hostname"] == "gpu1"
    assert "connection refused" in host["error"] and host["age"] >= 0
    _, _, body = get(lab_server, "/lab/fragment")
    assert b"showing the last answer" in body and b"j1" in body


def test_hide_commands_hides_the_peers_commands_too(simulate, servers):
    peer = servers(document(simulate, "gpu1", [h100(uuid="GPU-11", processes=[
        {"pid": 9, "user": "eve", "command": "python secret.py --token abc"}])], {0: {}}))
    simulate(machine())
    lab_server = servers(peers=[address(peer)], hide_commands=True)
    lab = lab_when(lab_server, lambda d: d["hosts"][1]["ok"])
    text = json.dumps(lab)
    assert "secret.py" not in text and "python train.py" not in text
    assert lab["hosts"][1]["status"]["gpus"][0]["processes"][0]["command"] is None


def test_a_silent_peer_never_holds_a_request(simulate, servers):
    simulate(machine())
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        peer = PeerAddress.parse(f"127.0.0.1:{silent.getsockname()[1]}")
        lab_server = servers(peers=[peer], peer_timeout=8.0)
        for _ in range(10):  # while the lab thread waits on the silent peer (8 s)
            started = time.monotonic()
            status, _, _ = get(lab_server, "/api/lab", timeout=30)
            # a request held by the peer would take the peer's 8 s: far from it, even loaded
            assert status == 200 and time.monotonic() - started < 6.0
            time.sleep(0.1)
        lab = lab_when(lab_server, lambda d: d["hosts"][1]["error"] != "not read yet")
        assert lab["hosts"][1]["error"] in ("no answer within 8 s", "no complete answer within 8 s")


def test_lab_without_peers_is_this_host(server):
    status, _, body = get(server, "/api/lab")
    (host,) = json.loads(body)["hosts"]
    assert status == 200 and host["local"] and len(host["status"]["gpus"]) == 3


@pytest.mark.parametrize("value, words", [
    ("gpu1/x", "host 'gpu1/x' is not HOST:PORT"),
    ("https://gpu1:9400", "must be http://"),
    ("gpu1:70000", "port outside 1-65535"),
])
def test_bad_peer_is_one_line(simulate, capsys, value, words):
    simulate(machine())
    with pytest.raises(SystemExit) as done:
        main(["serve", "--port", "0", "--peer", value])
    out, err = capsys.readouterr()
    assert done.value.code == 1 and out == "" and err.count("\n") == 1, err
    assert words in err and "--peer" in err
