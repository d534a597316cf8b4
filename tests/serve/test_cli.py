"""``devicekit serve`` as a command: its start line, one-line errors, clean stop on Ctrl-C and
SIGTERM, the non-loopback notice, and no torch on its path."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.cli.main import main
from devicekit.cli.serve import parse_interval
from tests.serve.conftest import machine, start_line

SRC = str(Path(dk.__file__).parents[1])


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_port_in_use_is_one_line(simulate, capsys):
    simulate(machine())
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out, err = run_cli(capsys, "--port", str(port))
    assert code == 1 and out == "" and err.count("\n") == 1
    assert err.startswith("devicekit: ") and f"port {port}" in err and "in use" in err


@pytest.mark.parametrize("args, words", [
    (["--host", "x" * 70 + ".example"], "--host"),          # refused before any lookup
    (["--host", "192.0.2.1"], "not an address of this machine"),  # TEST-NET: nobody's address
    (["--port", "70000"], "70000"),
    (["--interval", "0"], "'0'"),
    (["--interval", "2 hours"], "'2 hours'"),
    (["--interval", "nan"], "'nan'"),
])
def test_bad_options_are_one_line(simulate, capsys, args, words):
    simulate(machine())
    code, out, err = run_cli(capsys, *args)
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert err.startswith("devicekit: ") and words in err and "Traceback" not in err


def test_bad_simulation_file_is_one_line(simulate, capsys):
    path = simulate(machine())
    path.write_text('{"gpus": [{"name": "x", "memory_total": "10XB"}]}')
    code, out, err = run_cli(capsys, "--port", "0")
    assert code == 1 and out == "" and err.count("\n") == 1 and "gpus[0].memory_total" in err


@pytest.mark.parametrize("text, seconds", [("2s", 2.0), ("500ms", 0.5), ("1m", 60.0), ("3", 3.0),
                                           ("0.25s", 0.25)])
def test_parse_interval(text, seconds):
    assert parse_interval(text) == seconds


def _child_env(simulation: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=SRC, DEVICEKIT_SIMULATE=str(simulation))


def _start(simulation: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``devicekit serve --port 0`` and return it with its start line (within 60 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "devicekit", "serve", "--port", "0",
                             "--interval", "200ms", *args], env=_child_env(simulation),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = start_line(proc)
    if not line:
        proc.kill()
        raise AssertionError(f"no start line: {proc.communicate(timeout=10)}")
    return proc, line


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_serves_then_stops_cleanly(simulate, sig):
    path = simulate(machine())
    proc, line = _start(path)
    try:
        assert line.startswith("devicekit serve: http://127.0.0.1:")
        url = line.split()[2]
        with urllib.request.urlopen(url + "metrics", timeout=30) as response:
            assert b"devicekit_gpu_memory_used_bytes{" in response.read()
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert err == "devicekit serve: stopped\n"
    with pytest.raises(OSError):  # the port is closed
        urllib.request.urlopen(url + "metrics", timeout=5)


def test_other_than_loopback_says_so(simulate):
    path = simulate(machine())
    proc, line = _start(path, "--host", "0.0.0.0", "--hide-commands")
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0 and "http://0.0.0.0:" in line
    first = err.splitlines()[0]
    assert "reachable from other machines" in first and "--host 127.0.0.1" in first
    assert "command lines" not in first  # --hide-commands: only users are shown


def test_serve_imports_no_torch(simulate):
    path = simulate(machine())
    code = ("import sys, urllib.request\nfrom devicekit.serve import StatusServer\n"
            "import devicekit.cli.serve\n"
            "with StatusServer('127.0.0.1', 0, interval=0.2) as s:\n"
            "    urllib.request.urlopen(s.url, timeout=30).read()\n"
            "    urllib.request.urlopen(s.url + 'metrics', timeout=30).read()\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], env=_child_env(path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_ipv6_loopback_and_names(simulate):
    from devicekit.serve.server import StatusServer, is_loopback

    simulate(machine())
    assert is_loopback("127.0.0.1") and is_loopback("127.8.9.10") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("10.0.0.1")
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with StatusServer("::1", 0, interval=0.2) as server:
        assert server.url.startswith("http://[::1]:") and server.loopback_only
        with urllib.request.urlopen(server.url + "api/status", timeout=30) as response:
            assert response.status == 200


def test_allow_host_reaches_the_server(simulate):
    """``--allow-host NAME``: requests naming NAME are answered, other names get 403."""
    import http.client

    path = simulate(machine())
    proc, line = _start(path, "--allow-host", "gpu1.lab.example", "--allow-host", "gpu1")
    try:
        host, port = line.split()[2].removeprefix("http://").rstrip("/").rsplit(":", 1)
        answers = {}
        for name in ("gpu1.lab.example:9400", "gpu1", "evil.example"):
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            conn.putrequest("GET", "/metrics", skip_host=True)
            conn.putheader("Host", name)
            conn.endheaders()
            response = conn.getresponse()
            answers[name] = (response.status, response.read())
            conn.close()
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert answers["gpu1.lab.example:9400"][0] == answers["gpu1"][0] == 200
    status, body = answers["evil.example"]
    assert status == 403 and body.count(b"\n") == 1 and b"--allow-host evil.example" in body
