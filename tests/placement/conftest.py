"""Fixtures for placement tests: a subprocess environment that imports the devicekit under test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import devicekit


@pytest.fixture
def child_env() -> dict[str, str]:
    """Environment for a ``sys.executable`` child that must import this worktree's devicekit."""
    env = dict(os.environ)
    src = str(Path(devicekit.__file__).parents[1])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env
