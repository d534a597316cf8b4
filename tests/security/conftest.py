"""Fixtures for the adversarial tests: acting as a second, unprivileged user.

The tests here attack devicekit as another local user would (a malicious checkpoint, a lease
directory someone else owns, squatted lock files, escape sequences in a command line) and as a
careless one would (a daemonizing job, a stopped job, a full disk). Tests that need a second
user run as root and drop to ``nobody`` (uid 65534) in a child; they skip cleanly elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import devicekit

OTHER_UID = 65534  # nobody


def src_env(**extra: str) -> dict[str, str]:
    """Environment for a child ``sys.executable`` that imports this worktree's devicekit."""
    env = dict(os.environ)
    src = str(Path(devicekit.__file__).parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A root-owned mode-1777 directory under /tmp, as an admin would make for leases."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a root-owned shared directory")
    directory = Path(tempfile.mkdtemp(prefix="devicekit-security-", dir="/tmp"))
    os.chmod(directory, 0o1777)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def run_cli() -> Callable[..., subprocess.CompletedProcess[str]]:
    """``run_cli("status", env=...)``: ``python -m devicekit ...`` in a child, text captured."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60,
            **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "devicekit", *args], env=env or src_env(),
                              capture_output=True, text=True, timeout=timeout, **kwargs)

    return run


from tests.children import wait_line  # noqa: E402,F401  (shared helpers)
