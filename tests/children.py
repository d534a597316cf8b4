"""Bounded child processes running the devicekit under test: ``spawn`` (a fixture), ``child_env``, ``wait_line``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import devicekit

SRC = str(Path(devicekit.__file__).parents[1])


def child_env(**extra: str) -> dict[str, str]:
    """The current environment plus PYTHONPATH pointing at the devicekit under test."""
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC
    env.update(extra)
    return env


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``python -c CODE`` children; every one is killed and reaped at the end of the test."""
    children: list[subprocess.Popen[str]] = []

    def start(code: str, *args: str, **popen: object) -> subprocess.Popen[str]:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], env=child_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **popen)  # type: ignore[call-overload]
        children.append(proc)
        return proc

    yield start
    for proc in children:
        if proc.poll() is None:
            proc.kill()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_line(proc: subprocess.Popen[str], timeout: float = 15.0) -> str:
    """The child's next stdout line, failing the test (not hanging) if none comes in time."""
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            _, err = proc.communicate(timeout=10)
            raise AssertionError(f"child printed nothing within {timeout} s; stderr: {err}")
    line = proc.stdout.readline()
    if not line:
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"child exited early (rc={proc.returncode}); stderr: {err}")
    return line.strip()
