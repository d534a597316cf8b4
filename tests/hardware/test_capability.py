"""Capability scores, the known-model table, the bench cache and ``order="fastest"``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.hardware.bench_cache import cache_dir, read_result, write_result
from devicekit.hardware.capability import (
    capabilities,
    capability,
    relative_weights,
    strongest_first,
)
from devicekit.hardware.gpu import GPU
from devicekit.hardware.known_gpus import KNOWN_GPUS, lookup
from tests.mixed import MIXED_UUIDS, mixed_machine


@pytest.mark.parametrize(("name", "model"), [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200 SXM"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"), ("NVIDIA A100-PCIE-40GB", "A100 40GB"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"), ("Tesla T4", "T4"), ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"), ("NVIDIA A10", "A10"), ("Tesla V100-SXM2-32GB", "V100 SXM2"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
])
def test_known_names_find_their_model(name: str, model: str) -> None:
    found = lookup(name)
    assert found is not None and found.model == model


def test_unknown_model_is_none_and_table_is_consistent() -> None:
    assert lookup("NVIDIA GeForce GT 710") is None
    for known in KNOWN_GPUS:  # tensor peaks never below the plain fp32 peak
        assert known.half_peak >= (known.fp32 or 0) > 0 and known.memory_bandwidth_gbs > 0
    h100 = lookup("NVIDIA H100 80GB HBM3")
    assert h100 is not None and h100.peak("bf16") == 989.4 and h100.memory_bandwidth_gbs == 3350
    with pytest.raises(ValueError, match="fp8"):
        h100.peak("fp8")


def test_simulated_gpus_take_their_facts_from_the_table(simulate: Callable[..., Path]) -> None:
    simulate([*mixed_machine(), {"name": "Mystery GPU", "memory_total": "8GiB", "sm_count": 10,
                                 "max_sm_clock": 1000, "compute_capability": "8.0"}])
    t4, h100, a100, mystery = dk.gpus()
    assert t4.compute_capability == (7, 5) and t4.sm_count == 40 and t4.architecture == "Turing"
    assert h100.memory_bandwidth == 3350 and a100.compute_capability == (8, 0)
    assert mystery.architecture is None and mystery.memory_bandwidth is None
    scores = capabilities(dk.gpus())
    assert [s.source for s in scores] == ["table", "table", "table", "facts"]
    assert scores[3].score == pytest.approx(10 * 1000e6 * 2048 / 1e12)


def test_a_bad_speed_fact_names_the_key(simulate: Callable[..., Path]) -> None:
    simulate([{"name": "Tesla T4", "memory_total": "16GiB", "sm_count": "many"}])
    with pytest.raises(dk.SimulationFileError, match=r"gpus\[0\]\.sm_count: 'many' is not a number"):
        dk.gpus()


def test_fastest_first_orders_h100_a100_t4(simulate: Callable[..., Path]) -> None:
    simulate(mixed_machine())
    assert [g.name for g in strongest_first(dk.gpus())] == [
        "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4"]
    weights = relative_weights(dk.gpus())
    assert sum(weights) == pytest.approx(1) and weights[1] > weights[2] > weights[0]
    with dk.select_gpus("all", order="fastest") as sel:
        assert [g.uuid for g in sel.gpus] == [MIXED_UUIDS["h100"], MIXED_UUIDS["a100"],
                                              MIXED_UUIDS["t4"]]
    # free memory alone would put the A100 (80 GiB free) before the H100 (70 GiB free)
    with dk.select_gpus(1, order="free-memory", lease=False) as sel:
        assert sel.gpus[0].uuid == MIXED_UUIDS["a100"]


def _gpu(uuid: str, name: str) -> GPU:
    return GPU(index=0, uuid=uuid, name=name, memory_total=1, memory_used=0, memory_free=1)


def test_bench_figures_win_only_when_every_gpu_has_one() -> None:
    a, b = _gpu("GPU-a", "NVIDIA H100 80GB HBM3"), _gpu("GPU-b", "NVIDIA A100-SXM4-80GB")
    write_result("GPU-b", {"matmul_tflops": {"bf16": 250.0}})
    assert [c.source for c in capabilities([a, b])] == ["table", "table"]
    assert capability(b).source == "bench" and capability(b).score == 250.0
    write_result("GPU-a", {"matmul_tflops": {"fp32": 40.0, "bf16": 600.0}})
    assert [c.score for c in capabilities([a, b])] == [600.0, 250.0]


def test_cache_is_per_uuid_atomic_and_tolerates_garbage() -> None:
    path = write_result("GPU-x/../y", {"matmul_tflops": {"bf16": 1.0}})
    assert path.parent == cache_dir() and "/" not in path.name
    assert not [p for p in cache_dir().iterdir() if p.name.startswith(".")]  # no temp file left
    path.write_text("{not json")
    assert read_result("GPU-x/../y") is None
    assert capability(_gpu("GPU-x/../y", "Tesla T4")).source == "table"


def test_cli_select_order_fastest(simulate: Callable[..., Path]) -> None:
    path = simulate(mixed_machine())
    env = {**os.environ, "DEVICEKIT_SIMULATE": str(path)}
    done = subprocess.run([sys.executable, "-m", "devicekit", "select", "-n", "2", "--order",
                           "fastest"], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{MIXED_UUIDS['h100']},{MIXED_UUIDS['a100']}"
    status = subprocess.run([sys.executable, "-m", "devicekit", "status", "--json"], env=env,
                            capture_output=True, text=True, timeout=30)
    scores = {g["name"]: g["capability"] for g in json.loads(status.stdout)["gpus"]}
    assert scores["Tesla T4"] == {"score": 65.0, "source": "table"}


def test_doctor_warns_on_mixed_models_and_says_what_devicekit_does(
        simulate: Callable[..., Path]) -> None:
    from devicekit.sharing.doctor_checks import check_gpus, take_inventory

    simulate(mixed_machine())
    check = check_gpus(take_inventory())
    assert check.status == "warn" and "mixed GPU models" in check.message
    assert "GPU 1 989 > GPU 2 312 > GPU 0 65" in check.message
    assert "rank 0 the strongest" in check.message and "weights='auto'" in check.message
