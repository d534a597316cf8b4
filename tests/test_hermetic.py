"""The suite never touches this machine's GPUs, NVML, lease directory or caches unless a test is
marked ``gpu`` and the run is a GPU run (tests/conftest.py): checked here, also in a child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.sharing.lease_directory import DEFAULT_LEASE_DIR, lease_dir
from tests.conftest import gpu_run
from tests.ranks import worker_ports


@pytest.fixture
def hermetic_run(request: pytest.FixtureRequest) -> None:
    if request.config._devicekit_gpu_run:  # type: ignore[attr-defined]
        pytest.skip("a GPU run lets torch see the GPU")


def _tripwire() -> types.ModuleType:
    """A ``pynvml`` that fails the test if anything opens it."""
    module = types.ModuleType("pynvml")

    def touched(*_: object) -> None:
        raise AssertionError("a test opened NVML")

    module.nvmlInit = touched  # type: ignore[attr-defined]
    module.nvmlInitWithFlags = touched  # type: ignore[attr-defined]
    return module


def test_a_plain_test_sees_no_gpu_and_never_opens_nvml(hermetic_run: None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.hardware import inventory

    monkeypatch.setitem(sys.modules, "pynvml", _tripwire())
    inventory._cache.clear()
    assert dk.gpus() == []
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert json.loads(Path(os.environ["DEVICEKIT_SIMULATE"]).read_text()) == {"gpus": []}


def test_shared_state_is_private_to_the_test() -> None:
    assert lease_dir() != Path(DEFAULT_LEASE_DIR)
    assert str(lease_dir()).startswith(os.environ.get("TMPDIR", "/tmp"))
    assert Path(os.environ["XDG_CACHE_HOME"]) != Path.home() / ".cache"
    assert Path(os.environ["DEVICEKIT_BENCH_CACHE"]) != Path.home() / ".cache" / "devicekit" / "bench"


def test_torch_in_this_process_and_in_children_sees_no_cuda(hermetic_run: None) -> None:
    import torch

    assert torch.cuda.device_count() == 0
    child = subprocess.run(
        [sys.executable, "-c", "import os, torch; print(os.environ['CUDA_VISIBLE_DEVICES'] == '',"
                               " torch.cuda.device_count(), os.environ['DEVICEKIT_SIMULATE'] != '')"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert child.returncode == 0, child.stderr
    assert child.stdout.split() == ["True", "0", "True"]


class _Config:
    def __init__(self, markexpr: str = "", args: tuple[str, ...] = ()) -> None:
        self.option = types.SimpleNamespace(markexpr=markexpr)
        self.args = list(args)


GPU_DIR = str(Path(__file__).resolve().parent / "gpu")


@pytest.mark.parametrize("markexpr,args,expected", [
    ("", (), False),                                            # make test
    ("", ("tests",), False),
    ("not gpu", (), False),
    ("gpu", (), True),                                           # pytest -m gpu
    ("", (GPU_DIR,), True),                                      # pytest tests/gpu
    ("", (f"{GPU_DIR}/test_run_gpu.py::test_x",), True),
    ("", (GPU_DIR, "tests/jobs"), False),                         # mixed: hermetic
])
def test_what_counts_as_a_gpu_run(monkeypatch: pytest.MonkeyPatch, markexpr: str,
                                  args: tuple[str, ...], expected: bool) -> None:
    monkeypatch.delenv("DEVICEKIT_TEST_GPU", raising=False)
    assert gpu_run(_Config(markexpr, args)) is expected  # type: ignore[arg-type]
    monkeypatch.setenv("DEVICEKIT_TEST_GPU", "1")
    assert gpu_run(_Config(markexpr, args)) is True  # type: ignore[arg-type]


def test_xdist_workers_draw_ports_from_disjoint_ranges(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = range(20000, 32000)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")
    slices = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(worker_ports(ports)))
    assert all(len(s) == 4000 for s in slices)
    assert not (slices[0] & slices[1]) and not (slices[1] & slices[2]) and not (slices[0] & slices[2])
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert worker_ports(ports) == ports
