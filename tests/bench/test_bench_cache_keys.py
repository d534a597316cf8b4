"""The bench cache on a (simulated) GPU: a result ``dk.bench`` writes for ``cuda:0`` is found
again by the NVML UUID of that GPU, in the cache folder in force when it was written. Issue 38:
on the H200 the full bench wrote no entry the test could read (``cached is None``): the test's
module fixture wrote before conftest gave the test its own cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit.hardware.bench_cache import cache_dir, read_result
from devicekit.hardware.capability import capability
from devicekit.measure import bench_runner
from devicekit.measure.report import BenchReport, Figure

TORCH_UUID = "5d9b2f4e-1111-2222-3333-444455556666"  # str() of torch's _CUuuid: no "GPU-"


@pytest.fixture
def cuda_h200(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch describes cuda:0 as an H200 with the UUID format torch uses."""
    class Properties:
        uuid = TORCH_UUID

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())


def _full_run(entry: bench_runner.DeviceBench) -> BenchReport:
    entry.figures += [
        Figure("matmul.bf16.8192", "matmul bf16 8192x8192", 702.5, "TFLOP/s"),
        Figure("matmul.bf16.4096", "matmul bf16 4096x4096", 650.0, "TFLOP/s"),
        Figure("memory.copy", "copy within memory", 3900.0, "GB/s"),
    ]
    return BenchReport([entry], quick=False, gpu_count=1)


def test_a_gpu_result_is_found_by_its_nvml_uuid(cuda_h200: None, simulate, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    entry = bench_runner._describe(torch.device("cuda", 0))
    assert entry.uuid == f"GPU-{TORCH_UUID}" and entry.name == "NVIDIA H200"
    written = bench_runner._write_cache(_full_run(entry))
    assert [Path(p).parent for p in written] == [cache_dir()]
    cached = read_result(f"GPU-{TORCH_UUID}")
    assert cached is not None and cached["name"] == "NVIDIA H200" and cached["quick"] is False
    assert cached["matmul_tflops"] == {"bf16": 702.5} and cached["memory_gbs"] == 3900.0
    simulate([{"name": "NVIDIA H200", "memory_total": "141GiB", "memory_used": "0GiB",
               "utilization": 0, "uuid": f"GPU-{TORCH_UUID}"}])
    (gpu,) = dk.gpus()
    assert (capability(gpu).source, capability(gpu).score) == ("bench", 702.5)
    # what the H200 run met: the reader looked in another folder than the writer used
    monkeypatch.setenv("DEVICEKIT_BENCH_CACHE", str(tmp_path / "elsewhere"))
    assert read_result(f"GPU-{TORCH_UUID}") is None and capability(gpu).source != "bench"


def test_bench_writes_to_the_folder_in_force_when_it_runs(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    monkeypatch.setenv("DEVICEKIT_BENCH_CACHE", str(tmp_path / "mine"))
    monkeypatch.setattr(bench_runner, "_run_steps", lambda steps, progress: None)  # no timing
    report = dk.bench(["cpu"], quick=True, progress=False)
    assert [Path(p) for p in report.cache_files] == [tmp_path / "mine" / "cpu.json"]
    assert read_result("cpu") is not None
