"""Shared fixtures: simulated GPUs, an isolated lease directory, a clean environment.

The suite is hermetic: unless the run is a GPU run (``-m gpu``, paths under ``tests/gpu``, or
``DEVICEKIT_TEST_GPU=1``), no test and no process a test starts touches this machine's real
GPUs, its NVML, its lease directory or its caches, even on a GPU server:

- ``CUDA_VISIBLE_DEVICES=""`` is set before torch is imported, so torch here and in every child
  sees no CUDA device;
- every test runs on an empty GPU simulation (``DEVICEKIT_SIMULATE``), so NVML is never opened
  (a test that fakes NVML removes the variable itself), except tests marked ``gpu``;
- the lease directory, the bench and batch-size caches are temporary, per test;
- under pytest-xdist each worker draws rendezvous ports from its own range (tests/ranks.py).
- under pytest-xdist each worker's own torch runs one intra-op thread (the workers share the cores).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.children import spawn  # noqa: F401  (a fixture for every folder)
from tests.suite_budget import RECORD_ENV, Budget, is_whole_suite, slowest_modules_first

GPU_ENV = ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "DEVICEKIT_SIMULATE", "DEVICEKIT_LEASE_DIR")


def h100(used: str = "0GiB", util: int = 0, **extra: Any) -> dict[str, Any]:
    """One simulated H100 entry for a simulation file."""
    return {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": used,
            "utilization": util, **extra}


#: set to 1 to run the ``gpu`` tests (they also run with ``-m gpu`` or paths under tests/gpu)
GPU_RUN_ENV = "DEVICEKIT_TEST_GPU"


def gpu_run(config: pytest.Config) -> bool:
    """Whether this run is meant for the real GPU (then tests marked ``gpu`` run)."""
    if os.environ.get(GPU_RUN_ENV) == "1":
        return True
    marks = (config.option.markexpr or "").replace("not gpu", "")
    if "gpu" in marks:
        return True
    gpu_dir = Path(__file__).resolve().parent / "gpu"
    args = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    return bool(args) and all(a == gpu_dir or gpu_dir in a.parents for a in args)


def pytest_configure(config: pytest.Config) -> None:
    """Before any test module imports torch: hide the machine's GPUs and shared state."""
    config._devicekit_gpu_run = gpu_run(config)  # type: ignore[attr-defined]
    if config._devicekit_gpu_run:  # type: ignore[attr-defined]
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:  # CUDA reads the variable once, when it starts: start it now, seeing no device
        import torch

        torch.cuda.device_count()
        if os.environ.get("PYTEST_XDIST_WORKER"):
            # several workers share the cores: a second intra-op OpenMP thread per worker only
            # spins against the others (this process only; children keep their own defaults)
            torch.set_num_threads(1)
    except Exception:  # torch broken: its own tests say so
        pass
    scratch = Path(tempfile.mkdtemp(prefix="devicekit-tests-"))
    os.environ["DEVICEKIT_LEASE_DIR"] = str(scratch / "leases")
    os.environ["DEVICEKIT_BENCH_CACHE"] = str(scratch / "bench-cache")
    os.environ["XDG_CACHE_HOME"] = str(scratch / "cache")
    # a command's status line shows after a phase lasted 2 s, which a loaded machine makes any
    # phase do: off for the suite (in subprocesses too); the tests of it set a short threshold
    os.environ["DEVICEKIT_STATUS_AFTER"] = "3600"
    config._devicekit_scratch = scratch  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    scratch = getattr(config, "_devicekit_scratch", None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(autouse=True)
def _isolated_env(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """Every test starts without GPU variables, on no GPU (an empty simulation: NVML is never
    opened; tests marked ``gpu`` see the real ones), with its own lease directory and caches."""
    for name in GPU_ENV:
        monkeypatch.delenv(name, raising=False)
    if request.node.get_closest_marker("gpu") is None:
        empty = tmp_path_factory.mktemp("no-gpus") / "no-gpus.json"
        empty.write_text('{"gpus": []}')
        monkeypatch.setenv("DEVICEKIT_SIMULATE", str(empty))
        if not request.config._devicekit_gpu_run:  # type: ignore[attr-defined]
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path_factory.mktemp("leases")))
    monkeypatch.setenv("DEVICEKIT_BENCH_CACHE", str(tmp_path_factory.mktemp("bench-cache")))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
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
    """``simulate([h100(), h100(used="70GiB")])`` writes a file and points DEVICEKIT_SIMULATE at it.

    The simulated GPUs are visible (``CUDA_VISIBLE_DEVICES`` unset), as on a machine that has them.
    """

    def write(gpus: list[dict[str, Any]], name: str = "gpus.json") -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"gpus": gpus}))
        monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
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
    """Modules run slowest first (tests/suite_budget.py). Tests marked ``gpu`` skip cleanly where
    torch sees no CUDA device, and in a run that is not a GPU run (``make test`` on a GPU server
    leaves its GPUs alone)."""
    slowest_modules_first(items)
    if not config._devicekit_gpu_run:  # type: ignore[attr-defined]
        has_cuda = False
        reason = f"needs a CUDA GPU and a GPU run (-m gpu, tests/gpu, or {GPU_RUN_ENV}=1)"
    else:
        reason = "needs a CUDA GPU"
        try:
            import torch

            has_cuda = torch.cuda.is_available()
        except Exception:  # torch broken: no GPU tests
            has_cuda = False
    if has_cuda and not os.environ.get("DEVICEKIT_SKIP_GPU_TESTS"):
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_budget = Budget()


def pytest_sessionstart(session: pytest.Session) -> None:
    _budget.whole_suite = is_whole_suite(session.config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _budget.note(report)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Tests over the budget, listed; with DEVICEKIT_RECORD_DURATIONS=1 the durations recorded."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller reports
        return
    _budget.summary(terminalreporter)
    if os.environ.get(RECORD_ENV) == "1":
        _budget.record(workers=getattr(config.option, "numprocesses", None))
        terminalreporter.line(f"durations recorded in tests/durations.json ({len(_budget.seconds)} tests)")
