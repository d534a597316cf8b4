"""Other users' text (commands, user names, GPU names) is printed inert, to a pipe and a tty."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import pytest

from devicekit.hardware.printable import printable
from devicekit.sharing.leases import Lease
from tests.conftest import h100
from tests.security.conftest import src_env

TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"
EVIL = f"python train.py {TITLE}{CLEAR}\nFAKE LINE"


def test_printable_escapes_controls_and_keeps_text():
    assert printable("python train.py --lr 3e-4") == "python train.py --lr 3e-4"
    assert printable("café ümlaut 训练") == "café ümlaut 训练"
    shown = printable(EVIL)
    assert "\x1b" not in shown and "\x07" not in shown and "\n" not in shown
    assert "\\x1b]0;pwned\\x07" in shown and "\\x1b[2J" in shown and "\\x0aFAKE" in shown
    assert printable("a\u202eb\u2028c\x9bd") == "a\\u202eb\\u2028c\\x9bd"  # bidi, separator, C1


def _evil_gpus(simulate):
    return simulate([
        h100(used="2GiB", name=f"NVIDIA H100 {CLEAR}", uuid="GPU-0",
             processes=[{"pid": 4242, "user": f"eve{TITLE}", "memory": "1GiB", "command": EVIL}]),
        h100(uuid="GPU-1"),
    ])


def _assert_inert(text: str) -> None:
    assert TITLE not in text and CLEAR not in text and "\x07" not in text
    assert "\nFAKE LINE" not in text


def _on_tty(args: list[str], env: dict[str, str], timeout: float = 60) -> str:
    """Run ``python -m devicekit ARGS`` with stdout and stderr on a pseudo-terminal."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "devicekit", *args], env=env,
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait(timeout=10)
        os.close(leader)
    return out.decode(errors="replace")


def test_status_neutralises_escapes_on_pipe_and_tty(simulate, run_cli, monkeypatch):
    path = _evil_gpus(simulate)
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"],
                  COLUMNS="250")
    with Lease.acquire(["GPU-1"], command=EVIL):
        piped = run_cli("status", env=env)
        assert piped.returncode == 0, piped.stderr
        _assert_inert(piped.stdout)
        assert "\\x1b]0;pwned" in piped.stdout and "\\x1b[2J" in piped.stdout
        tty = _on_tty(["status"], env)
    _assert_inert(tty)
    assert "\\x1b]0;pwned" in tty


def test_select_reasons_neutralised_on_pipe_and_tty(simulate, run_cli):
    path = _evil_gpus(simulate)
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"])
    with Lease.acquire(["GPU-1"], command=EVIL):
        # GPU-1 leased, GPU-0 too busy: the reasons quote the lease's command and the GPU name
        piped = run_cli("select", "--min-free", "79.5GiB", env=env)
        assert piped.returncode == 3
        _assert_inert(piped.stderr)
        assert "\\x1b]0;pwned" in piped.stderr
        chosen = run_cli("select", env=env)  # a chosen GPU and the reasons for the other
        assert chosen.returncode == 0
        _assert_inert(chosen.stderr)
        tty = _on_tty(["select", "--min-free", "79.5GiB"], env)
    _assert_inert(tty)
    assert "\\x1b]0;pwned" in tty


@pytest.mark.parametrize("field", ["name", "user"])
def test_json_keeps_raw_text_escaped_by_json(simulate, run_cli, field):
    """--json is for programs: the exact text, in JSON's own escapes (never a raw ESC)."""
    path = _evil_gpus(simulate)
    env = src_env(DEVICEKIT_SIMULATE=str(path))
    done = run_cli("status", "--json", env=env)
    assert done.returncode == 0 and "\x1b" not in done.stdout and "\\u001b" in done.stdout
