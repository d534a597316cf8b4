"""Hostile peers: what another machine's "devicekit serve" sends is refused or shown inert.

A tiny raw HTTP server on loopback plays the peer: a body larger than 4 MiB (announced or
streamed), JSON nested 100,000 deep, no status document, a chunked answer, a byte every 0.3 s,
a 403, a shell command in a UUID, and a well-formed document full of HTML and terminal escapes.
(tests/security/test_peer_attacks.py has the third attack round's peers.)
"""

from __future__ import annotations

import json
import time

import pytest

from devicekit.cli.main import main
from devicekit.serve import StatusServer
from devicekit.serve.lab import PeerReader
from devicekit.serve.peer_document import decode_status
from devicekit.serve.peer_fetch import PeerAddress, PeerError
from devicekit.serve.peer_schema import MAX_GPUS
from tests.serve.conftest import HOSTILE_COMMAND, HOSTILE_USER, get, machine
from tests.serve.raw_peer import (  # noqa: F401  (raw_peer_fixture: the fixture raw_peer)
    answer,
    drip,
    raw_peer_fixture,
    stream_forever,
)


def read_one(address: str, timeout: float = 3.0):
    (one,) = PeerReader().read([PeerAddress.parse(address)], timeout)
    return one


NOW = time.time()
HOSTILE_DOC = {
    "schema": 1, "taken_at": NOW, "devicekit_version": "0.1.0", "backend": "simulated",
    "host": {"hostname": "<i>evil</i>\x1b[2J"},
    "gpus": [
        {"index": 0, "uuid": "GPU-e0", "name": "NVIDIA \u202eH100<script>x</script>",
         "memory_total": 80 * 2**30, "memory_used": 0, "memory_free": 80 * 2**30,
         "utilization": None, "processes": [
             {"pid": 666, "user": HOSTILE_USER, "command": HOSTILE_COMMAND, "memory": 2**30}],
         "leases": [{"gpu_uuid": "GPU-e0", "pid": 5, "user": "<img src=x onerror=alert(1)>",
                     "job": "\x1b]0;pwn\x07" + "j" * 500, "since": NOW - 60, "command": "x",
                     "kind": "lease", "share": False, "memory": None}]},
        {"index": 2, "uuid": "GPU-e2", "name": "NVIDIA H100", "memory_total": 80 * 2**30,
         "memory_used": 0, "memory_free": 80 * 2**30, "utilization": 0},
    ],
    "other_leases": [], "warnings": ["\x1b[31mred\x1b[0m <b>warning</b>"],
}


@pytest.mark.parametrize("respond, words", [
    (answer(b"x" * 10, headers=f"Content-Length: {5 * 2**20}\r\n"), "more than 4 MiB: refused"),
    (stream_forever, "larger than 4 MiB: refused"),
    (answer(b"[" * 100_000 + b"]" * 100_000), "did not send a devicekit status document"),
    (answer(b'{"schema": 1, "gpus": [], "new": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
     "nested deeper than Python's recursion limit: refused"),
    (answer(b'{"hello": "world"}'), "did not send a devicekit status document"),
    (answer(b"<html>", headers="Transfer-Encoding: chunked\r\n"), "chunked answer"),
    (answer(b"\xff\xfe not utf-8"), "not UTF-8"),
    (answer(b"devicekit serve: refused Host '127.0.0.1'\n", status="403 Forbidden"),
     "answered HTTP 403: devicekit serve: refused Host"),
    (answer(json.dumps({**HOSTILE_DOC, "gpus": [HOSTILE_DOC["gpus"][-1]] * (MAX_GPUS + 1)})
            .encode()), f"Expected `array` of length <= {MAX_GPUS} - at `$.gpus`"),
    (answer(json.dumps({**HOSTILE_DOC, "gpus": [{**HOSTILE_DOC["gpus"][-1],
                                                 "uuid": "GPU-e1; rm -rf ~"}]}).encode()),
     "not a GPU-/MIG- UUID - at `$.gpus[0].uuid`"),
    (answer(json.dumps({**HOSTILE_DOC, "gpus": [{**HOSTILE_DOC["gpus"][-1],
                                                 "uuid": "GPU-e3\n"}]}).encode()),
     "not a GPU-/MIG- UUID - at `$.gpus[0].uuid`"),
    (answer(json.dumps({**HOSTILE_DOC, "gpus": [{**HOSTILE_DOC["gpus"][-1],
                                                 "utilization": float("nan")}]}).encode()),
     "sent an answer that is not JSON"),
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


def test_brackets_inside_strings_are_text():
    doc = {**HOSTILE_DOC, "warnings": ["[" * 40 + "{" * 40]}
    assert decode_status(json.dumps(doc).encode())["warnings"] == ["[" * 40 + "{" * 40]


def test_the_decoded_document_keeps_only_checked_fields():
    doc = decode_status(json.dumps({**HOSTILE_DOC, "extra": {"new": [1, 2]}}).encode())
    assert [g["uuid"] for g in doc["gpus"]] == ["GPU-e0", "GPU-e2"]
    assert "extra" not in doc and "capability" not in doc["gpus"][0]
    assert len(doc["gpus"][0]["leases"][0]["job"]) == 64  # cut to the job id's bound
    with pytest.raises(PeerError, match="schema 1"):
        decode_status(b'{"schema": 2, "gpus": []}')
    with pytest.raises(PeerError, match="did not send a devicekit status document"):
        decode_status(b"[1, 2, 3]")


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
