"""``devicekit serve`` attacked by another user of the machine.

- idle sockets: a local user opens hundreds of TCP connections and sends nothing, reopening
  every one the server closes; a normal client's ``GET /metrics`` must still be answered, every
  time, within a second or two;
- ``--hide-commands``: a command line planted in a lease, a waiting ticket and (through the
  lease) a queue reason and a stopped-job warning must appear in no byte any endpoint serves;
- DNS rebinding: a request whose ``Host`` (or ``Origin``) is a name the server is not known by
  is refused with 403 and one inert line.

Every server here listens on 127.0.0.1, port 0; every wait and every loop is bounded.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import devicekit as dk
from devicekit.serve import StatusServer
from devicekit.serve.connections import Limits
from devicekit.serve.hosts import HostPolicy, host_name
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.leases import Lease
from devicekit.sharing.tickets import Ticket
from tests.security.conftest import OTHER_UID, src_env
from tests.serve.conftest import machine, wait_for

# --- idle connections --------------------------------------------------------------------------

#: another local user: holds COUNT idle connections (never a byte sent) for SECONDS, reopening
#: each one the server closes and each connect not done within 1 s; prints "ready N", then totals
ATTACKER = r"""
import errno, os, resource, selectors, socket, sys, time
host, port, count, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if soft != resource.RLIM_INFINITY and soft < count + 64:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, count + 64), hard))
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(UID); os.setuid(UID)  # from here on: another, unprivileged user
sel = selectors.DefaultSelector()
pending, stats = {}, {"opened": 0, "closed_by_server": 0}

def open_one():
    s = socket.socket(); s.setblocking(False)
    if s.connect_ex((host, port)) not in (0, errno.EINPROGRESS):
        s.close(); return
    sel.register(s, selectors.EVENT_WRITE, "connecting"); pending[s] = time.monotonic()
    stats["opened"] += 1

def pump(timeout):
    for key, _ in sel.select(timeout):
        s = key.fileobj
        if key.data == "connecting":
            del pending[s]
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                sel.unregister(s); s.close()
            else:
                sel.modify(s, selectors.EVENT_READ, "held")
        else:  # readable: the server closed it
            sel.unregister(s); s.close(); stats["closed_by_server"] += 1
    for s, started in list(pending.items()):
        if time.monotonic() - started > 1.0:
            del pending[s]; sel.unregister(s); s.close()

start = time.monotonic(); deadline = start + seconds
while time.monotonic() < min(deadline, start + 3):
    while len(sel.get_map()) < count:
        open_one()
    pump(0.01)
    if len(sel.get_map()) - len(pending) >= count:
        break
print("ready", len(sel.get_map()) - len(pending), flush=True)
while time.monotonic() < deadline:
    pump(0.01)
    while len(sel.get_map()) < count:
        open_one()
held = len(sel.get_map()) - len(pending)
for key in list(sel.get_map().values()):
    key.fileobj.close()
print("done", stats["opened"], stats["closed_by_server"], held, flush=True)
""".replace("UID", str(OTHER_UID))


def probe(address: tuple[str, int], timeout: float) -> tuple[int, float]:
    """A normal client: a new connection, GET /metrics; (status or 0, seconds taken)."""
    start = time.monotonic()
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        body = response.read()
        ok = response.status == 200 and b"devicekit_gpus " in body
        return (response.status if ok else -response.status), time.monotonic() - start
    except OSError:
        return 0, time.monotonic() - start
    finally:
        conn.close()


def attack(server: StatusServer, idle: int, seconds: float, probes: int) -> dict:
    """Hold ``idle`` sockets for ``seconds`` from a child while probing ``probes`` times."""
    address = server.address
    assert server.loop is not None
    threads_before = threading.active_count()
    child = subprocess.Popen([sys.executable, "-c", ATTACKER, address[0], str(address[1]),
                              str(idle), str(seconds)], env=src_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        ready = child.stdout.readline().split()  # within 3 s: the child's own bound
        assert ready and ready[0] == "ready", child.stderr.read() if child.stderr else ""
        results, most_open, most_threads = [], 0, 0
        gap = (seconds - 1.5) / probes
        for _ in range(probes):
            most_open = max(most_open, server.loop.open_connections)
            most_threads = max(most_threads, threading.active_count())
            results.append(probe(address, timeout=2.0))
            time.sleep(max(gap - results[-1][1], 0))
        out, err = child.communicate(timeout=seconds + 30)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=10)
    assert child.returncode == 0, err
    done = out.split()
    return {"held": int(ready[1]), "opened": int(done[1]), "closed_by_server": int(done[2]),
            "results": results, "most_open": most_open,
            "threads": most_threads - threads_before, "counts": dict(server.loop.counts)}


def report(name: str, found: dict) -> str:
    latencies = sorted(t for _, t in found["results"])
    return (f"{name}: {found['held']} idle sockets held, {found['opened']} opened, "
            f"{found['closed_by_server']} closed by the server; {len(latencies)} probes, "
            f"median {latencies[len(latencies) // 2] * 1000:.1f} ms, "
            f"max {latencies[-1] * 1000:.1f} ms; server {found['counts']}")


def test_idle_sockets_do_not_keep_others_out(simulate, capsys):
    """800 idle sockets held for 6 s (the server closes each after its 3 s head timeout and the
    attacker reopens it): 20 probes, every one answered within 2 s, and no thread per socket."""
    simulate(machine())
    with StatusServer("127.0.0.1", 0, interval=0.5) as server:
        found = attack(server, idle=800, seconds=6.0, probes=20)
    with capsys.disabled():
        print("\n" + report("idle sockets", found))
    assert found["held"] >= 700, found
    assert [status for status, _ in found["results"]] == [200] * 20, found["results"]
    assert max(t for _, t in found["results"]) < 2.0, found["results"]
    assert found["counts"]["timed_out"] >= found["held"] // 2  # the head timeout closed them
    assert found["threads"] <= 1  # the attacker's sockets cost the server no thread


def test_a_flood_past_the_cap_evicts_the_flooder(simulate, capsys):
    """With the cap at 200 and 600 idle sockets wanted, every new one evicts the oldest idle
    one: the server never holds more than 200, and every probe is still answered."""
    simulate(machine())
    with StatusServer("127.0.0.1", 0, interval=0.5, limits=Limits(connections=200)) as server:
        found = attack(server, idle=600, seconds=5.0, probes=15)
    with capsys.disabled():
        print("\n" + report("flood past the cap", found))
    assert [status for status, _ in found["results"]] == [200] * 15, found["results"]
    assert max(t for _, t in found["results"]) < 2.0, found["results"]
    assert found["counts"]["evicted"] >= 400 and found["most_open"] <= 200, found


# --- --hide-commands ---------------------------------------------------------------------------

SECRETS = ("HIDDENSECRET1", "HIDDENSECRET2", "HIDDENSECRET3")
ENDPOINTS = ("/", "/index.html", "/fragment", "/api/status", "/metrics", "/static/page.js",
             "/static/page.css")


def everything(server: StatusServer) -> bytes:
    """Every byte every endpoint serves (GET and HEAD)."""
    out = b""
    for method in ("GET", "HEAD"):
        for path in ENDPOINTS:
            conn = http.client.HTTPConnection(*server.address, timeout=10)
            try:
                conn.request(method, path)
                response = conn.getresponse()
                assert response.status == 200, path
                out += str(response.getheaders()).encode() + response.read()
            finally:
                conn.close()
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="stopped jobs: /proc")
def test_hide_commands_leaves_no_command_anywhere(simulate):
    """A lease whose command holds a token (quoted by the queue's reason and by the stopped-job
    warning), a long shared lease (quoted cut short), two waiting tickets with tokens: none of
    it in any endpoint's bytes; user and pid stay in the reasons."""
    simulate(machine())
    gpus = dk.gpus()
    short = f"sleep 60 --token={SECRETS[0]}"
    long = f"python t.py --token={SECRETS[1]} --epochs 100 --lr 3e-4 --name run-7"
    tickets: list[Ticket] = []
    stopped = subprocess.Popen(["sleep", "60"])  # this process's job: one of it is stopped
    try:
        with Lease.acquire([gpus[0].uuid], command=short), \
                Lease.acquire([gpus[1].uuid], command=long, share=True, memory=8 * 2**30):
            os.kill(stopped.pid, signal.SIGSTOP)
            for uuid in (gpus[0].uuid, gpus[1].uuid):
                tickets.append(Ticket.take(lease_dir(), {
                    "count": 1, "candidates": [uuid], "command": f"sleep 5 --token={SECRETS[2]}"}))

            def planted(snap) -> bool:
                doc = snap.status
                return len(doc.get("queue", [])) == 2 and any("stopped" in w for w in doc["warnings"])

            with StatusServer("127.0.0.1", 0, interval=0.2) as plain:  # the plant is there
                wait_for(plain, planted)
                shown = everything(plain)
                doc = plain.sampler.snapshot.status
            assert all(s.encode() in shown for s in SECRETS)
            reasons = [t["reason"] for t in doc["queue"]]
            assert SECRETS[0] in reasons[0] and SECRETS[1] in reasons[1], reasons

            with StatusServer("127.0.0.1", 0, interval=0.2, hide_commands=True) as hidden:
                wait_for(hidden, planted)
                served = everything(hidden)
                doc = json.loads(hidden.sampler.snapshot.status_json)
    finally:
        for ticket in tickets:
            ticket.close()
        stopped.kill()
        stopped.wait(timeout=10)
    leaked = [s for s in SECRETS if s.encode() in served]
    assert leaked == [], leaked
    assert b"sleep 60" not in served and b"python t.py" not in served and b"sleep 5" not in served
    me = os.getpid()
    first, second = (t["reason"] for t in doc["queue"])
    assert first.startswith("Busy: GPU 0 leased by ") and f"(pid {me}) since " in first, first
    assert second.startswith("Busy: GPU 1 shared by ") and f"(pid {me}, 8 GiB asked)" in second
    assert all(t["command"] is None for t in doc["queue"])
    assert any(f"(pid {me}) is stopped since" in w for w in doc["warnings"]), doc["warnings"]
    assert all(lease["command"] is None for g in doc["gpus"] for lease in g["leases"])


# --- Host and Origin ---------------------------------------------------------------------------


def ask(server: StatusServer, host: str | None, origin: str | None = None,
        path: str = "/api/status") -> tuple[int, bytes]:
    """GET ``path`` with exactly this ``Host`` (None: no Host line, HTTP/1.0) and ``Origin``."""
    lines = [f"GET {path} HTTP/{'1.1' if host is not None else '1.0'}"]
    if host is not None:
        lines.append(f"Host: {host}")
    if origin is not None:
        lines.append(f"Origin: {origin}")
    request = ("\r\n".join(lines) + "\r\nConnection: close\r\n\r\n").encode("latin-1")
    with socket.create_connection(server.address, timeout=10) as sock:
        sock.sendall(request)
        data = b""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


@pytest.fixture
def loopback(simulate):
    simulate(machine())
    with StatusServer("127.0.0.1", 0, interval=0.5, allow_hosts=["gpu1.lab.example"]) as server:
        yield server


def test_loopback_names_are_answered(loopback):
    port = loopback.address[1]
    for host in ("localhost", f"localhost:{port}", "LOCALHOST:1234", "localhost.", "127.0.0.1",
                 f"127.0.0.1:{port}", "[::1]", f"[::1]:{port}", "gpu1.lab.example:9400"):
        status, body = ask(loopback, host)
        assert status == 200 and body.startswith(b"{"), host
    assert ask(loopback, None)[0] == 200  # HTTP/1.0, no Host: accepted
    assert ask(loopback, "localhost", origin=f"http://localhost:{port}")[0] == 200


def test_a_rebound_name_is_refused_in_one_inert_line(loopback):
    port = loopback.address[1]
    for host in ("evil.example", f"evil.example:{port}", "localhost.evil.example",
                 "127.0.0.1.nip.io", "gpu1.lab.example.evil"):
        for path in ("/api/status", "/", "/metrics", "/fragment", "/nope"):
            status, body = ask(loopback, host, path=path)
            assert status == 403, (host, path)
            text = body.decode()
            assert text.count("\n") == 1 and text.endswith("\n")
            assert f"'{host}'" in text and "--allow-host" in text, text
            assert b"gpus" not in body and b"devicekit_" not in body
    status, body = ask(loopback, "evil.example")
    assert b"--allow-host evil.example" in body
    hostile = 'x<script>alert(1)</script>\x1b]0;pwn\x07'
    status, body = ask(loopback, hostile)
    assert status == 403 and b"\x1b" not in body and b"\x07" not in body
    assert b"\\x1b]0;pwn\\x07" in body and body.count(b"\n") == 1


def test_a_foreign_origin_is_refused(loopback):
    port = loopback.address[1]
    for origin in ("http://evil.example", f"http://evil.example:{port}", "null", "file://",
                   "http://localhost.evil.example"):
        status, body = ask(loopback, f"127.0.0.1:{port}", origin=origin)
        assert status == 403 and b"Origin" in body, origin
    assert ask(loopback, "localhost", origin="https://gpu1.lab.example")[0] == 200


def test_off_loopback_the_machine_names_and_ip_scrapes(loopback):
    """The policy a --host 0.0.0.0 server gets (tested on a loopback server: tests never listen
    on other interfaces): the hostname, the FQDN, any IP:port (Prometheus) and --allow-host."""
    loopback.hosts = HostPolicy.for_bind("0.0.0.0", ["gpu1.lab.example"])
    hostname, fqdn = socket.gethostname(), socket.getfqdn()
    for host in (hostname, f"{hostname}:9400", fqdn, f"{fqdn.upper()}:9400", "10.1.2.3:9400",
                 "[2001:db8::7]:9400", "localhost", "gpu1.lab.example"):
        assert ask(loopback, host, path="/metrics")[0] == 200, host
    assert ask(loopback, "evil.example:9400", path="/metrics")[0] == 403


def test_host_values_parse_strictly():
    assert host_name("Gpu1.Lab:9400") == "gpu1.lab" and host_name("[::1]:80") == "::1"
    for bad in ("", "a b", "[::1", "[evil.example]:80", "x:y", "x:80:90", "evil.example/x",
                "ev\x00il", "a..b"):
        assert host_name(bad) is None, bad


def test_bad_allow_host_is_one_line(simulate, capsys):
    from devicekit.cli.main import main

    simulate(machine())
    for bad in ("two words", "gpu1:9400", "http://gpu1", ""):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve", "--port", "0", "--allow-host", bad])
        out, err = capsys.readouterr()
        assert exit_info.value.code == 1 and out == "" and err.count("\n") == 1, err
        assert err.startswith("devicekit: --allow-host ") and "Traceback" not in err
