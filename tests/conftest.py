"""Shared fixtures: simulated GPUs, an isolated lease directory, a clean environment."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

GPU_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "DEVICEKIT_SIMULATE", "DEVICEKIT_LEASE_DIR")


def h100(used: str = "0GiB", util: int = 0, **extra: Any) -> dict[str, Any]:
    """One simulated H100 entry for a simulation file."""
    return {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": used,
            "utilization": util, **extra}


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every test starts without GPU variables, with its own lease directory and bench cache."""
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path_factory.mktemp("leases")))
    monkeypatch.setenv("DEVICEKIT_BENCH_CACHE", str(tmp_path_factory.mktemp("bench-cache")))
    from devicekit.hardware import inventory, visible

    inventory._cache.clear()
    visible._warned.clear()  # DeviceOrderWarning is once per process: each test is a fresh one


@pytest.fixture
def admin_lease_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A root-owned mode-1777 lease directory under /tmp, as an admin would make it, in force."""
    directory = tempfile.mkdtemp(prefix="devicekit-leases-", dir="/tmp")
    os.chmod(directory, 0o1777)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", directory)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def simulate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """``simulate([h100(), h100(used="70GiB")])`` writes a file and points DEVICEKIT_SIMULATE at it."""

    def write(gpus: list[dict[str, Any]], name: str = "gpus.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"gpus": gpus}))
        monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
        return path

    return write


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch in this process sees no CUDA device, also on a GPU machine.

    Setting ``CUDA_VISIBLE_DEVICES=""`` hides nothing from a process whose CUDA is already
    initialised (any earlier test may have done that), so tests whose premise is "a machine
    without a GPU" patch torch's answers; subprocesses still get the variable.
    """
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip cleanly where torch sees no CUDA device."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch broken: no GPU tests
        has_cuda = False
    if has_cuda and not os.environ.get("DEVICEKIT_SKIP_GPU_TESTS"):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
