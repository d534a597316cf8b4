"""Hostile peers: what another machine's "devicekit serve" sends is refused or shown inert.

A tiny raw HTTP server on loopback plays the peer: a body larger than 4 MiB (announced or
streamed), JSON nested 100,000 deep, no status document, a chunked answer, a byte every 0.3 s,
a 403, and a well-formed document full of HTML, terminal escapes and a shell command in a UUID.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from devicekit.cli.main import main
from devicekit.serve import StatusServer
from devicekit.serve.lab import PeerReader
from devicekit.serve.peer_document import MAX_GPUS, clean_status
from devicekit.serve.peer_fetch import PeerAddress, PeerError, parse_json
from tests.serve.conftest import HOSTILE_COMMAND, HOSTILE_USER, get, machine

Respond = Callable[[socket.socket], None]


class RawPeer:
    """Answers every connection on a loopback port with ``respond(conn)``, in one thread."""

    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.listener.settimeout(0.1)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    head = b""
                    while b"\r\n\r\n" not in head and len(head) < 65536:
                        chunk = conn.recv(4096)
                        if not chunk:
                            break
                        head += chunk
                    self.respond(conn)
                except OSError:  # the client gave up (as it should): nothing to do
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.listener.close()


@pytest.fixture
def raw_peer() -> Iterator[Callable[[Respond], RawPeer]]:
    peers: list[RawPeer] = []

    def make(respond: Respond) -> RawPeer:
        peers.append(RawPeer(respond))
        return peers[-1]

    yield make
    for peer in peers:
        peer.close()


def answer(body: bytes, status: str = "200 OK", headers: str = "") -> Respond:
    def respond(conn: socket.socket) -> None:
        length = "" if "Content-Length" in headers or "Transfer" in headers else \
            f"Content-Length: {len(body)}\r\n"
        conn.sendall(f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{length}"
                     f"{headers}Connection: close\r\n\r\n".encode() + body)
    return respond


def read_one(address: str, timeout: float = 3.0):
    (one,) = PeerReader().read([PeerAddress.parse(address)], timeout)
    return one


def stream_forever(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
    chunk = b"[" + b"0," * 32768
    for _ in range(200):  # 13 MiB at most, if nobody stops reading
        conn.sendall(chunk)


def drip(conn: socket.socket) -> None:
    for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789":
        conn.sendall(bytes([byte]))
        time.sleep(0.3)


NOW = time.time()
HOSTILE_DOC = {
    "schema": 1, "taken_at": NOW, "devicekit_version": "0.1.0", "backend": "simulated",
    "host": {"hostname": "<i>evil</i>\x1b[2J"},
    "gpus": [
        {"index": 0, "uuid": "GPU-e0", "name": "NVIDIA \u202eH100<script>x</script>",
         "memory_total": 80 * 2**30, "memory_used": 0, "memory_free": 80 * 2**30,
         "utilization": float("nan"), "processes": [
             {"pid": 666, "user": HOSTILE_USER, "command": HOSTILE_COMMAND, "memory": 2**30}],
         "leases": [{"gpu_uuid": "GPU-e0", "pid": 5, "user": "<img src=x onerror=alert(1)>",
                     "job": "\x1b]0;pwn\x07" + "j" * 500, "since": NOW - 60, "command": "x",
                     "kind": "lease", "share": False, "memory": None}]},
        {"index": 1, "uuid": "GPU-e1; rm -rf ~", "name": "NVIDIA H100", "memory_total": 1,
         "memory_used": 0},
        {"index": 3, "uuid": "GPU-e3\n", "name": "NVIDIA H100", "memory_total": 1,
         "memory_used": 0},
        {"index": 2, "uuid": "GPU-e2", "name": "NVIDIA H100", "memory_total": 80 * 2**30,
         "memory_used": 0, "memory_free": 80 * 2**30, "utilization": 0},
    ],
    "other_leases": [], "warnings": ["\x1b[31mred\x1b[0m <b>warning</b>"],
}


@pytest.mark.parametrize("respond, words", [
    (answer(b"x" * 10, headers=f"Content-Length: {5 * 2**20}\r\n"), "more than 4 MiB: refused"),
    (stream_forever, "larger than 4 MiB: refused"),
    (answer(b"[" * 100_000 + b"]" * 100_000), "nested more than 32 deep: refused"),
    (answer(b'{"hello": "world"}'), "did not send a devicekit status document"),
    (answer(b"<html>", headers="Transfer-Encoding: chunked\r\n"), "chunked answer"),
    (answer(b"\xff\xfe not utf-8"), "not UTF-8"),
    (answer(b"devicekit serve: refused Host '127.0.0.1'\n", status="403 Forbidden"),
     "answered HTTP 403: devicekit serve: refused Host"),
    (answer(json.dumps({**HOSTILE_DOC, "gpus": [HOSTILE_DOC["gpus"][-1]] * (MAX_GPUS + 1)})
            .encode()), f"lists {MAX_GPUS + 1} GPUs, more than the {MAX_GPUS}"),
])
def test_hostile_answers_are_refused_in_one_line(raw_peer, respond, words):
    peer = raw_peer(respond)
    started = time.monotonic()
    got = read_one(peer.address)
    assert time.monotonic() - started < 10
    assert got.status is None and got.error is not None and words in got.error, got.error
    assert "\n" not in got.error and "\x1b" not in got.error


def test_a_dripping_peer_is_cut_at_the_timeout(raw_peer):
    peer = raw_peer(drip)
    started = time.monotonic()
    got = read_one(peer.address, timeout=1.0)
    assert time.monotonic() - started < 6  # cut at the deadline, not at the drip's end
    assert got.status is None and "within 1 s" in got.error


def test_depth_is_checked_before_parsing():
    with pytest.raises(PeerError, match="nested more than"):
        parse_json(b'{"a": ' * 40 + b"1" + b"}" * 40)
    assert parse_json(b'{"a": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') == {"a": "[" * 40}


def test_clean_status_keeps_only_checked_fields():
    doc = clean_status(json.loads(json.dumps(HOSTILE_DOC)))
    assert [g["uuid"] for g in doc["gpus"]] == ["GPU-e0", "GPU-e2"]  # the shell one is left out
    assert any("left out" in w for w in doc["warnings"])
    gpu = doc["gpus"][0]
    assert gpu["utilization"] is None  # NaN is no number
    assert len(gpu["leases"][0]["job"]) == 64
    with pytest.raises(PeerError):
        clean_status({"schema": 2, "gpus": []})
    with pytest.raises(PeerError):
        clean_status([1, 2, 3])


def test_hostile_text_is_inert_in_status_select_and_the_lab_page(raw_peer, capsys, simulate):
    peer = raw_peer(answer(json.dumps(HOSTILE_DOC).encode()))
    with pytest.raises(SystemExit) as done:
        main(["status", "--hosts", peer.address])
    out, err = capsys.readouterr()
    assert done.value.code == 0, err
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "\\x1b]" in out and "\\u202e" in out and "<img src=x" in out  # shown, as text
    assert "\\x1b[31mred" in out and "rm -rf" not in out
    with pytest.raises(SystemExit) as done:
        main(["select", "--hosts", peer.address, "-n", "1"])
    out, err = capsys.readouterr()
    assert done.value.code == 0 and out == "127.0.0.1 GPU-e2\n"  # never the UUID with a command
    assert "\x1b" not in err and "rm -rf" not in err
    simulate(machine())
    with StatusServer("127.0.0.1", 0, interval=0.2,
                      peers=[PeerAddress.parse(peer.address)]) as server:
        deadline = time.monotonic() + 30
        while server.lab.snapshot.rounds < 1:
            assert time.monotonic() < deadline, "the lab never read its peer"
            time.sleep(0.05)
        status, headers, body = get(server, "/lab")
        page = body.decode()
        assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]
        assert "<script>x" not in page and "<img" not in page and "\x1b" not in page
        assert "&lt;img src=x onerror=alert(1)&gt;" in page and "&lt;i&gt;evil&lt;/i&gt;" in page
        assert "\\x1b]0;pwn\\x07" in page and "\\u202e" in page
        _, _, body = get(server, "/api/lab")
        hosts = json.loads(body)["hosts"]
        assert [h["ok"] for h in hosts] == [True, True]
        assert hosts[1]["status"]["host"]["hostname"] == "<i>evil</i>\x1b[2J"  # exact, in JSON
