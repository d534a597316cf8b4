"""``devicekit status``: table, --json schema, --watch, errors, and no torch on its path."""

from __future__ import annotations

import io
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.cli.main import main
from devicekit.sharing.leases import Lease
from tests.conftest import h100

SRC = str(Path(dk.__file__).parents[1])
ALICE = {"pid": 4242, "user": "alice", "memory": "2GiB", "command": "python train.py"}
GPU_KEYS = {"index", "uuid", "name", "pci_bus_id", "memory_total", "memory_used", "memory_free",
            "utilization", "memory_bandwidth_utilization", "temperature", "power_draw",
            "power_limit", "compute_capability", "compute_mode", "mig_enabled", "mig_devices",
            "processes", "backend", "leases", "architecture", "sm_count",
            "max_sm_clock", "memory_bandwidth", "capability", "blocked", "leases_not_listed"}
LEASE_KEYS = {"gpu_uuid", "pid", "user", "host", "command", "since", "memory", "share", "kind",
              "stopped_since", "job"}


@pytest.fixture
def two(simulate):
    path = simulate([h100(used="2GiB", util=5, temperature=41, processes=[ALICE]),
                     h100(used="70GiB", util=90)])
    return path


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["status", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_table(two, capsys):
    code, out, err = run_cli(capsys)
    assert (code, err) == (0, "")
    assert "backend simulated" in out and out.count("NVIDIA H100 80GB HBM3") == 2
    assert "2.0/80 GiB" in out and "70.0/80 GiB" in out and "90%" in out
    assert "alice" in out and "python train.py" in out
    code, out, _ = run_cli(capsys, "--no-processes")
    assert code == 0 and "python train.py" not in out and "1: alice" in out


def test_json_schema_with_a_lease(two, capsys):
    gpus = dk.gpus()
    with Lease.acquire([gpus[1].uuid], memory=8 * 2**30, command="python mine.py"):
        code, out, err = run_cli(capsys, "--json")
    assert (code, err) == (0, "")
    doc = json.loads(out)
    assert doc["schema"] == 1
    assert set(doc) == {"schema", "devicekit_version", "taken_at", "host", "backend",
                        "driver_version", "cuda_driver_version", "gpus", "other_leases",
                        "other_leases_not_listed", "ignored_leases", "ignored_leases_not_listed",
                        "warnings"}
    assert doc["backend"] == "simulated" and doc["devicekit_version"] == dk.__version__
    assert {"hostname", "cpu_count_logical", "memory_total", "usable_cpus"} <= set(doc["host"])
    first, second = doc["gpus"]
    assert set(first) == GPU_KEYS
    assert first["uuid"] == gpus[0].uuid and first["memory_used"] == 2 * 2**30
    assert first["processes"] == [{"pid": 4242, "user": "alice", "command": "python train.py",
                                   "memory": 2 * 2**30}]
    assert first["leases"] == []
    (lease,) = second["leases"]
    assert set(lease) == LEASE_KEYS
    assert lease["pid"] == os.getpid() and lease["memory"] == 8 * 2**30
    assert lease["command"] == "python mine.py" and lease["share"] is False


def test_watch_prints_frames_until_count(two, capsys):
    code, out, _ = run_cli(capsys, "--watch", "0.1", "--count", "2")
    assert code == 0 and out.count("backend simulated") == 2
    code, out, _ = run_cli(capsys, "--watch", "--count", "1")  # --watch without a value: 2 s
    assert code == 0 and out.count("backend simulated") == 1
    code, out, _ = run_cli(capsys, "--json", "--watch", "0.1", "--count", "3")
    docs = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(docs) == 3 and all(d["schema"] == 1 for d in docs)


def test_watch_on_a_terminal_uses_a_live_view(two, capsys, monkeypatch):
    from rich.console import Console

    from devicekit.cli import status

    screen = io.StringIO()
    monkeypatch.setattr(status, "_console",
                        lambda: Console(file=screen, force_terminal=True, width=120))
    code, _, _ = run_cli(capsys, "--watch", "0.1", "--count", "2")
    assert code == 0 and screen.getvalue().count("backend simulated") >= 2
    assert "\x1b[" in screen.getvalue()  # redrawn in place with cursor movements


@pytest.mark.parametrize("value", ["abc", "0", "0.01", "nan", "inf", "-1", "1e9"])
def test_bad_watch_value_one_line(two, capsys, value):
    code, out, err = run_cli(capsys, f"--watch={value}")
    assert code == 1 and out == ""
    assert err.startswith("devicekit: ") and err.count("\n") == 1 and repr(value) in err


@pytest.mark.parametrize("value", ["nan", "inf", "0", "61"])
def test_bad_hosts_timeout_one_line(two, capsys, value):
    # --timeout nan passed click's FloatRange and raised ValueError in the peer reader's join
    code, out, err = run_cli(capsys, "--hosts", "127.0.0.1:9", "--timeout", value)
    assert code == 1 and out == "" and err.count("\n") == 1, err
    assert f"Invalid value for '--timeout': '{value}' is not a number of seconds from 0.1 to 60" in err


def test_driver_failure_exit_2(two, capsys, monkeypatch):
    from tests.hardware.fake_pynvml import ERROR_CODES, FakeDevice, install_pynvml, make_pynvml

    monkeypatch.delenv("DEVICEKIT_SIMULATE")
    broken = make_pynvml([FakeDevice("GPU-1")],
                         init_error=ERROR_CODES["NVML_ERROR_LIB_RM_VERSION_MISMATCH"])
    install_pynvml(monkeypatch, broken)
    code, out, err = run_cli(capsys, "--json")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("devicekit: ") and "version mismatch" in err


def test_malformed_simulation_file_one_line(simulate, capsys):
    path = simulate([h100()])
    path.write_text('{"gpus": [{"name": "x", "memory_total": "10XB"}]}')
    code, out, err = run_cli(capsys, "--json")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert str(path) in err and "gpus[0].memory_total" in err


def test_no_driver_shows_no_gpus(capsys, monkeypatch):
    from tests.hardware.fake_pynvml import ERROR_CODES, FakeDevice, install_pynvml, make_pynvml

    absent = make_pynvml([FakeDevice("GPU-1")], init_error=ERROR_CODES["NVML_ERROR_LIBRARY_NOT_FOUND"])
    install_pynvml(monkeypatch, absent)
    code, out, _ = run_cli(capsys, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["backend"] == "none" and doc["gpus"] == []
    assert "NVML Shared Library Not Found" in doc["warnings"][0]


def _child_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=SRC)


def test_status_json_imports_no_torch(two):
    code = ("import sys\nfrom devicekit.cli.main import main\n"
            "try:\n    main(['status', '--json'])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print('torch' in sys.modules, rc, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], env=_child_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.stderr.strip() == "False 0", done.stderr
    assert json.loads(done.stdout)["schema"] == 1


def test_watch_stops_cleanly_on_ctrl_c(two):
    proc = subprocess.Popen([sys.executable, "-m", "devicekit", "status", "--watch", "0.2"],
                            env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        first = ""
        with selectors.DefaultSelector() as sel:  # never block past the deadline
            sel.register(proc.stdout, selectors.EVENT_READ)
            deadline = time.monotonic() + 30
            while "backend simulated" not in first and time.monotonic() < deadline:
                if sel.select(timeout=max(deadline - time.monotonic(), 0)):
                    first = proc.stdout.readline()  # the first frame: the watch is running
                    if not first:
                        break
        assert "backend simulated" in first, "no frame within 30 s"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and err == ""


def test_watch_on_a_terminal_shows_the_hint_and_restores_it_on_sigterm(two):
    """A live view killed by SIGTERM (timeout, kill, a job scheduler) used to die mid-frame with
    the cursor hidden and the prompt on its last line; it now ends like Ctrl-C."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "devicekit", "status", "--watch", "0.2"],
                            env=dict(_child_env(), TERM="xterm", COLUMNS="120"),
                            stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    # the follower stays open here too: when the child's end closes last, Linux hangs the
    # terminal up and may drop what the child wrote just before exiting
    seen = b""

    def read_until(done, seconds: float) -> None:
        nonlocal seen
        deadline = time.monotonic() + seconds
        with selectors.DefaultSelector() as sel:
            sel.register(leader, selectors.EVENT_READ)
            while not done() and time.monotonic() < deadline:
                if sel.select(timeout=max(deadline - time.monotonic(), 0)):
                    try:
                        chunk = os.read(leader, 65536)
                    except OSError:  # the child closed the terminal
                        return
                    if not chunk:
                        return
                    seen += chunk

    try:
        read_until(lambda: b"Ctrl-C to quit" in seen, 30)
        assert b"Ctrl-C to quit" in seen, seen[-400:]
        mark = len(seen)
        proc.send_signal(signal.SIGTERM)
        read_until(lambda: b"\x1b[?25h" in seen[mark:], 15)
        proc.wait(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 0
    tail = seen[mark:]
    assert b"\x1b[?25h" in tail  # the cursor comes back
    assert b"Traceback" not in seen


@pytest.mark.parametrize("command", ["status", "select"])
def test_timeout_without_hosts_is_refused_not_ignored(command: str) -> None:
    """A newcomer's ``status --timeout 5`` was accepted and did nothing (it is --hosts' option)."""
    from click.testing import CliRunner

    from devicekit.cli.main import cli

    result = CliRunner().invoke(cli, [command, "--timeout", "5"])
    assert result.exit_code == 2 and "--timeout goes with --hosts" in result.output
