"""Hostile lab peers (issue 44, items 8-11): a peer can cost only its own line.

Each peer is a raw HTTP server on loopback (tests/serve/raw_peer.py) beside one good peer with
two free GPUs. What a hostile peer sends:

- item 8: ``"`` then ``\\"`` repeated (the old regex pre-scan was quadratic on it: 64 KiB took
  33 s), at 64 KiB and at the 4 MiB ceiling;
- item 9: a lease whose ``since`` is 1e300, 1e18 or 2**61 (``time.localtime`` overflowed in
  ``select --hosts``), or whose ``since`` is a day in 1990 or a week ahead;
- item 10: 1 MiB of 5 GPUs x 256 MIG instances x 256 empty leases ``{}`` (it became 148 MiB of
  ``status --hosts --json``), and 4 MiB of the smallest item past its list's limit;
- item 11: one UUID listed twice (``select --hosts`` printed it twice in ``--gpu-ids``);
- a peer that drips a byte every 0.3 s.

``status --hosts`` and ``select --hosts`` must answer from the good peer, naming each bad one
with its reason, within their timeout; a real ``devicekit serve --peer`` child over all of them
must keep answering ``/metrics``, keep its lab moving and stop on SIGTERM. The peers' defences
that held in round 3 (drip, endless, silent peers, huge Content-Length, chunked answers, deep
nesting, shell text in a UUID, terminal escapes) stay tested in tests/serve/test_lab_hostile.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from devicekit.cli.main import main
from devicekit.serve.lab import MAX_LAB_BYTES, HostAnswer, PeerReader, lab_document
from devicekit.serve.peer_document import MAX_DOCUMENT, decode_status
from devicekit.serve.peer_fetch import MAX_BYTES, PeerAddress, PeerError
from tests.conftest import h100
from tests.security.conftest import src_env
from tests.serve.conftest import start_line, stop_process
from tests.serve.raw_peer import answer, drip, raw_peer_fixture  # noqa: F401  (a fixture)

NOW = time.time()
GIB = 2**30


def gpu(index: int, uuid: str, **extra: Any) -> dict[str, Any]:
    return {"index": index, "uuid": uuid, "name": "NVIDIA H100 80GB HBM3",
            "memory_total": 80 * GIB, "memory_used": 0, "memory_free": 80 * GIB,
            "utilization": 0, **extra}


def status(gpus: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"schema": 1, "taken_at": time.time(), "host": {"hostname": "peer"}, "gpus": gpus,
            "other_leases": [], "warnings": [], **extra}


def body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def leased(since: float) -> bytes:
    lease = {"gpu_uuid": "GPU-b0", "pid": 42, "user": "bob", "since": since, "job": "j"}
    return json.dumps(status([gpu(0, "GPU-b0", leases=[lease]), gpu(1, "GPU-b1")]),
                      ).replace('"since": 1e+300', '"since": 1e300').encode()


GOOD = body(status([gpu(0, "GPU-g0"), gpu(1, "GPU-g1")]))
QUADRATIC_64K = b'{"schema": 1, "gpus": [], "x": "' + b'\\"' * 32 * 1024
QUADRATIC_CEILING = b'{"schema": 1, "gpus": [], "x": "' + b'\\"' * ((MAX_BYTES - 40) // 2)
EMPTY_LEASES = body(status([gpu(i, f"GPU-e{i}", mig_devices=[
    {"index": m, "uuid": f"MIG-e{i}-{m}", "leases": [{}] * 256} for m in range(256)])
    for i in range(5)]))
_PROCESSES = body(status([gpu(0, "GPU-p0", processes=[])]))
TINY_ITEMS = _PROCESSES.replace(b'"processes":[]', b'"processes":[' + b",".join(
    [b'{"pid":1}'] * ((MAX_BYTES - len(_PROCESSES)) // 10 - 1)) + b"]")
DUPLICATE = body(status([gpu(0, "GPU-d0"), gpu(1, "GPU-d0")]))
DUPLICATE_MIG = body(status([gpu(0, "GPU-m0", mig_enabled=True, mig_devices=[
    {"index": 0, "uuid": "MIG-m"}, {"index": 1, "uuid": "MIG-m"}])]))

#: (body, words of the bad host's line)
HOSTILE: dict[str, tuple[bytes, str]] = {
    "quadratic 64 KiB": (QUADRATIC_64K, "not JSON (Input data was truncated)"),
    "quadratic 4 MiB": (QUADRATIC_CEILING, "not JSON (Input data was truncated)"),
    "since 1e300": (leased(1e300), "<= 4294967296.0 - at `$.gpus[0].leases[0].since`"),
    "since 1e18": (leased(1e18), "<= 4294967296.0 - at `$.gpus[0].leases[0].since`"),
    "since 2**61": (leased(2**61), "<= 4294967296.0 - at `$.gpus[0].leases[0].since`"),
    "since 1990": (leased(631152000.0), "more than 5 years ago"),
    "since next week": (leased(NOW + 7 * 86400), "h ahead of this machine's clock"),
    "empty leases": (EMPTY_LEASES, "missing required field `gpu_uuid`"),
    "tiny items at 4 MiB": (TINY_ITEMS, "length <= 256 - at `$.gpus[0].processes`"),
    "duplicate UUID": (DUPLICATE, "UUID GPU-d0 at `$.gpus[1].uuid` is listed at `$.gpus[0].uuid`"),
    "duplicate MIG UUID": (DUPLICATE_MIG, "UUID MIG-m at `$.gpus[0].mig_devices[1].uuid`"),
}


def test_the_bodies_are_the_issues():
    assert 0.9 * 1024 * 1024 <= len(EMPTY_LEASES) < 1.1 * 1024 * 1024  # item 10's 1 MiB
    assert MAX_BYTES - 64 < len(TINY_ITEMS) <= MAX_BYTES
    assert MAX_BYTES - 64 < len(QUADRATIC_CEILING) <= MAX_BYTES
    assert b'"since": 1e300' in leased(1e300) and b"2305843009213693952" in leased(2**61)


@pytest.mark.parametrize("name", list(HOSTILE))
def test_each_hostile_document_is_refused_with_its_reason(name):
    data, words = HOSTILE[name]
    with pytest.raises(PeerError) as info:
        decode_status(data)
    assert words in str(info.value) and "\n" not in str(info.value)


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out, err = capsys.readouterr()
    return done.value.code, out, err


@pytest.fixture
def lab(raw_peer):
    """{name: address} of the hostile peers, the good one and a dripping one."""
    peers = {name: raw_peer(answer(data)).address for name, (data, _) in HOSTILE.items()}
    peers["good"] = raw_peer(answer(GOOD)).address
    peers["drip"] = raw_peer(drip).address
    return peers


def test_select_and_status_hosts_answer_from_the_good_peer(lab, capsys):
    """Items 8-11 in ``select --hosts`` / ``status --hosts [--json]``: every bad host is one line
    with its reason, the good one is chosen, nothing waits past the timeout (the drip peer's)."""
    hosts = ",".join(lab.values())
    started = time.monotonic()
    code, out, err = run_cli(capsys, "select", "--hosts", hosts, "-n", "2", "--timeout", "2")
    assert time.monotonic() - started < 2 + 4  # the timeout, and a margin for a loaded machine
    assert (code, out) == (0, f"{lab['good'].split(':')[0]} GPU-g0,GPU-g1\n"), err
    assert "Traceback" not in err
    for name, (_, words) in HOSTILE.items():
        line = next(li for li in err.splitlines() if f"{lab[name]}:" in li)
        assert words in line, (name, line)
    assert "within 2 s" in next(li for li in err.splitlines() if lab["drip"] in li)

    code, out, err = run_cli(capsys, "status", "--hosts", hosts, "--timeout", "2")
    assert code == 0 and "Traceback" not in err
    assert "1 of 13 host(s) answered" in out
    for name in HOSTILE:
        assert f"{lab[name]}: sent" in out or f"{lab[name]}: did not" in out, name

    # item 10: the 1 MiB of empty leases was 148 MiB of --json; each host's status has a
    # ceiling now, and a refused one is a line
    code, out, _ = run_cli(capsys, "status", "--hosts", hosts, "--json", "--timeout", "2")
    assert code == 0 and len(out) < 64 * 1024
    by_host = {h["host"]: h for h in json.loads(out)["hosts"]}
    assert [h["ok"] for h in by_host.values()].count(True) == 1
    assert [g["uuid"] for g in by_host[lab["good"]]["status"]["gpus"]] == ["GPU-g0", "GPU-g1"]
    assert "missing required field `gpu_uuid`" in by_host[lab["empty leases"]]["error"]


def test_a_document_past_its_ceiling_once_rebuilt_is_refused():
    lease = {"gpu_uuid": "GPU-x0", "pid": 1, "since": NOW, "command": "c" * 300,
             "user": "u" * 100, "host": "h" * 100, "job": "j" * 64}
    gpus = [gpu(i, f"GPU-x{i}", leases=[lease] * 256) for i in range(8)]
    data = body(status(gpus))
    assert len(data) < MAX_BYTES
    with pytest.raises(PeerError, match=f"more than the {MAX_DOCUMENT // 1024} KiB kept"):
        decode_status(data)
    fits = decode_status(body(status(gpus[:1])))
    assert len(json.dumps(fits)) <= MAX_DOCUMENT


def test_the_lab_document_has_a_ceiling_over_all_hosts():
    lease = {"gpu_uuid": "GPU-x0", "pid": 1, "since": NOW, "command": "c" * 300}
    doc = decode_status(body(status([gpu(i, f"GPU-x{i}", leases=[lease] * 150)
                                     for i in range(4)])))
    size = len(json.dumps(doc, separators=(",", ":")))
    count = MAX_LAB_BYTES // size + 3
    answers = [HostAnswer(PeerAddress.parse(f"h{i}:1"), doc, None, NOW) for i in range(count)]
    lab = lab_document(answers, now=NOW)
    kept = [h for h in lab["hosts"] if h["status"] is not None]
    assert len(kept) == MAX_LAB_BYTES // size
    assert all("left out: the hosts before it fill" in h["error"]
               for h in lab["hosts"][len(kept):])
    assert sum(len(json.dumps(h["status"], separators=(",", ":"))) for h in kept) <= MAX_LAB_BYTES


def _get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def test_serve_peer_keeps_answering_and_stops_on_sigterm(lab, tmp_path):
    """A real ``devicekit serve --peer`` over every hostile peer: /metrics answered every time,
    /api/lab and /lab move on with each bad host shown as bad, SIGTERM stops it (exit 0)."""
    simulation = tmp_path / "own.json"
    simulation.write_text(json.dumps({"gpus": [h100(uuid="GPU-own0")]}))
    (tmp_path / "leases").mkdir()
    env = src_env(DEVICEKIT_SIMULATE=str(simulation), DEVICEKIT_LEASE_DIR=str(tmp_path / "leases"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    peers = [word for address in lab.values() for word in ("--peer", address)]
    proc = subprocess.Popen([sys.executable, "-m", "devicekit", "serve", "--port", "0",
                             "--interval", "200ms", *peers], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = start_line(proc)
        assert line.startswith("devicekit serve: http://"), line
        url = line.split()[2]
        deadline = time.monotonic() + 60
        while True:  # the first round with every peer read (the drip peer: its timeout)
            lab_doc = json.loads(_get(url + "api/lab"))
            hosts = {h["host"]: h for h in lab_doc["hosts"]}
            if all(h["error"] != "not read yet" for h in hosts.values()):
                break
            assert time.monotonic() < deadline, hosts
            time.sleep(0.2)
        assert hosts[lab["good"]]["ok"]
        for name, (_, words) in HOSTILE.items():
            assert words in (hosts[lab[name]]["error"] or ""), (name, hosts[lab[name]])
        answered = 0
        for _ in range(8):
            started = time.monotonic()
            metrics = _get(url + "metrics").decode()
            answered += "devicekit_sample_ok 1" in metrics and time.monotonic() - started < 5
            time.sleep(0.1)
        assert answered == 8
        first = lab_doc["taken_at"]
        deadline = time.monotonic() + 30
        while json.loads(_get(url + "api/lab"))["taken_at"] == first:  # the lab moves on
            assert time.monotonic() < deadline, "the lab froze at its first round"
            time.sleep(0.2)
        page = _get(url + "lab").decode()
        assert 'data-uuid="GPU-g0"' in page and "more than 5 years ago" in page
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
    finally:
        stop_process(proc)


def test_a_peer_document_is_decoded_once_at_one_place():
    """No module of the lab turns a peer's bytes into objects but peer_document (the one
    decoder), and none of them parses JSON by hand."""
    serve = Path(__file__).resolve().parents[2] / "src" / "devicekit" / "serve"
    for name in ("peer_fetch.py", "lab.py", "lab_poller.py", "lab_choice.py", "lab_hosts.py"):
        text = (serve / name).read_text()
        assert "json.loads" not in text and "msgspec.json.decode" not in text, name
        assert "import re\n" not in text or name == "lab_hosts.py", name


# --- the defences of round 3 that held, kept tested ----------------------------------------------

def test_a_redirect_is_not_followed(raw_peer):
    target = raw_peer(answer(GOOD))
    hops = raw_peer(answer(b"", status="302 Found",
                           headers=f"Location: http://{target.address}/api/status\r\n"))
    (got,) = PeerReader().read([PeerAddress.parse(hops.address)], 2.0)
    assert got.status is None and got.error == "answered HTTP 302"


def test_a_silent_peer_costs_its_timeout_only(raw_peer):
    silent = raw_peer(lambda conn: time.sleep(1.5))
    started = time.monotonic()
    (got,) = PeerReader().read([PeerAddress.parse(silent.address)], 1.0)
    assert time.monotonic() - started < 2.5 and "within 1 s" in got.error


def test_hosts_file_tricks_are_refused_in_one_line(tmp_path):
    import os

    from devicekit.errors import InvalidValueError
    from devicekit.serve.lab_hosts import hosts_file, lab_hosts

    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    path = hosts_file(env)
    path.parent.mkdir(parents=True)
    os.mkfifo(path)  # a FIFO nobody writes: refused, never waited on
    started = time.monotonic()
    with pytest.raises(InvalidValueError, match="hosts file"):
        lab_hosts([], env)
    assert time.monotonic() - started < 5
    path.unlink()
    marker = tmp_path / "ran"
    for entry, words in [(f"$(touch {marker})", "is not HOST:PORT"),
                         ("file:///etc/passwd", "must be http://"),
                         ("`id`:9400", "is not HOST:PORT")]:
        path.write_text(entry + "\n")
        with pytest.raises(InvalidValueError, match=words) as info:
            lab_hosts([], env)
        assert "line 1" in str(info.value) and "\n" not in str(info.value)
    assert not marker.exists()
