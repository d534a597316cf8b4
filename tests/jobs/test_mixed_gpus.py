"""Mixed GPUs in ``devicekit run`` and ``dk.launch``: rank 0 gets the strongest leased GPU."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.jobs.allocation import allocate
from devicekit.jobs.run import RunRequest, plan_run
from tests.mixed import MIXED_UUIDS, mixed_machine


@pytest.fixture
def mixed(simulate: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return simulate(mixed_machine())


def test_allocation_orders_leased_gpus_strongest_first(mixed: Path) -> None:
    plan = allocate("all")
    try:
        assert plan.uuids == [MIXED_UUIDS["h100"], MIXED_UUIDS["a100"], MIXED_UUIDS["t4"]]
        assert plan.visible_devices(0) == MIXED_UUIDS["h100"]
    finally:
        plan.release()
    # two GPUs chosen by free memory (A100, then T4 ... or H100): still strongest first
    plan = allocate(2, min_free_memory="60GiB")
    try:
        assert plan.uuids == [MIXED_UUIDS["h100"], MIXED_UUIDS["a100"]]
    finally:
        plan.release()


def test_run_puts_the_h100_at_cuda0_and_pins_the_order(mixed: Path) -> None:
    plan = plan_run(RunRequest(gpus="all", command=["python", "train.py"]), environ={})
    try:
        assert plan.env["CUDA_VISIBLE_DEVICES"].split(",")[0] == MIXED_UUIDS["h100"]
        assert plan.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    finally:
        plan.allocation.release()


def visible() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_launch_rank0_gets_the_h100(mixed: Path) -> None:
    views = dk.launch(visible, nprocs=3, backend=None, timeout=60)
    assert views == [MIXED_UUIDS["h100"], MIXED_UUIDS["a100"], MIXED_UUIDS["t4"]]
