"""doctor's checks, one by one, on simulated and fake-NVML machines."""

from __future__ import annotations

import os
import re
import sys
import types

import pytest

from devicekit.hardware.gpu import GPU, MigDevice
from devicekit.hardware.launcher_checks import check_launcher
from devicekit.hardware.torch_checks import (
    TORCH_FLOOR,
    TORCH_NEWEST_TESTED,
    check_nccl,
    check_torch_build,
    check_torch_version,
    format_nccl_version,
    parse_cuda_version,
    parse_torch_version,
)
from devicekit.sharing.doctor_checks import (
    Check,
    Inventory,
    check_backend,
    check_device_order,
    check_gpus,
    check_lease_dir,
    check_visible_devices,
    run_checks,
    speed_order,
    summarize,
    take_inventory,
)
from tests.conftest import h100
from tests.hardware.fake_pynvml import ERROR_CODES, FakeDevice, install_pynvml, make_pynvml

A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0"}


def _gpu(index: int, name: str = "NVIDIA H100 80GB HBM3", **kw) -> GPU:
    return GPU(index=index, uuid=f"GPU-{index}aaaaaaa-0000-0000-0000-000000000000", name=name,
               memory_total=80 * 2**30, memory_used=0, memory_free=80 * 2**30, **kw)


def _nvml(*gpus: GPU, cuda: str = "12.4") -> Inventory:
    return Inventory(backend="nvml", gpus=gpus, driver_version="550.54.15",
                     cuda_driver_version=cuda, nvml_version="12.550.54.15")


def test_backend_check_per_backend(simulate, monkeypatch):
    simulate([h100()])
    sim = take_inventory()
    assert check_backend(sim).status == "pass" and "simulated" in check_backend(sim).message
    ok = check_backend(_nvml(_gpu(0)))
    assert ok.status == "pass" and "550.54.15" in ok.message and "CUDA <= 12.4" in ok.message
    monkeypatch.delenv("DEVICEKIT_SIMULATE")
    from devicekit.hardware import inventory

    for code, status in (("NVML_ERROR_LIBRARY_NOT_FOUND", "warn"),
                         ("NVML_ERROR_LIB_RM_VERSION_MISMATCH", "fail")):
        install_pynvml(monkeypatch, make_pynvml([FakeDevice("GPU-1")], init_error=ERROR_CODES[code]))
        inventory._cache.clear()
        check = check_backend(take_inventory())
        assert check.status == status and "\n" not in check.message


def test_gpu_modes():
    assert check_gpus(_nvml(_gpu(0), _gpu(1))).status == "pass"
    bad = check_gpus(_nvml(_gpu(0), _gpu(1, compute_mode="prohibited")))
    assert bad.status == "fail" and "GPU 1" in bad.message and "nvidia-smi -c DEFAULT" in bad.message
    excl = check_gpus(_nvml(_gpu(0, compute_mode="exclusive_process")))
    assert excl.status == "warn" and "one process at a time" in excl.message
    assert check_gpus(_nvml(_gpu(0, mig_enabled=True))).status == "warn"
    mig = MigDevice(0, "MIG-x", "1g.10gb", 10 * 2**30, 0)
    assert "MIG" in check_gpus(_nvml(_gpu(0, mig_enabled=True, mig_devices=(mig,)))).message
    assert check_gpus(Inventory(backend="none", gpus=())).status == "skip"


def test_mixed_models_group_equal_speeds_with_equals(simulate):
    a100 = {**A100, "memory_used": "0GiB", "utilization": 0}
    simulate([h100(), h100(), a100, a100])
    check = check_gpus(take_inventory())
    assert check.status == "warn"
    assert "(16-bit TFLOP/s: GPU 0 989 = GPU 1 989 > GPU 2 312 = GPU 3 312)" in check.message


def test_speed_order_compares_the_printed_figures():
    assert speed_order([(3, 989.4), (0, 988.6), (1, 312.0)]) == "GPU 3 989 = GPU 0 989 > GPU 1 312"
    assert speed_order([(0, 989.6), (1, 989.4)]) == "GPU 0 990 > GPU 1 989"
    assert speed_order([(2, 65.0)]) == "GPU 2 65" and speed_order([]) == ""


def test_device_order():
    mixed = _nvml(_gpu(0, "NVIDIA A100-SXM4-40GB", compute_capability=(8, 0)),
                  _gpu(1, compute_capability=(9, 0)))
    same = _nvml(_gpu(0), _gpu(1))
    assert check_device_order(same, {}).status == "pass"
    assert check_device_order(same, {"CUDA_VISIBLE_DEVICES": "1"}).status == "pass"
    warn = check_device_order(mixed, {"CUDA_VISIBLE_DEVICES": "1,0"})
    assert warn.status == "warn" and "uses indices" in warn.message and "PCI_BUS_ID" in warn.message
    assert check_device_order(mixed, {}).status == "warn"
    assert check_device_order(mixed, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                                      "CUDA_VISIBLE_DEVICES": "1"}).status == "pass"
    bad = check_device_order(same, {"CUDA_DEVICE_ORDER": "SLOWEST"})
    assert bad.status == "fail" and "'SLOWEST'" in bad.message


@pytest.mark.parametrize("value,status,needle", [
    ("0,1", "pass", "cuda:1=GPU 1"),
    ("1", "pass", "cuda:0=GPU 1"),
    ("GPU-1aaa", "pass", "cuda:0=GPU 1"),
    ("", "warn", "hides every GPU"),
    ("-1", "warn", "hides every GPU"),
    ("0,banana", "fail", "'banana'"),
    ("cuda:0", "fail", "'cuda:0'"),
    ("0,7", "fail", "'7'"),
    ("1,1", "fail", "already listed"),
    ("GPU-ffff", "fail", "matches no GPU"),
])
def test_visible_devices(value, status, needle):
    check = check_visible_devices(_nvml(_gpu(0), _gpu(1)), {"CUDA_VISIBLE_DEVICES": value})
    assert check.status == status and needle in check.message and "\n" not in check.message


def test_visible_devices_without_gpus_is_not_judged():
    assert check_visible_devices(Inventory("none", ()), {"CUDA_VISIBLE_DEVICES": "3"}).status == "skip"
    assert check_visible_devices(Inventory("none", ()), {}).status == "pass"


def test_lease_dir(tmp_path, monkeypatch):
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(fresh))
    check = check_lease_dir()
    assert check.status == "pass" and fresh.is_dir() and "0 live lease(s)" in check.message
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path / "link"))
    check = check_lease_dir()
    assert check.status == "fail" and "symlink" in check.message
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(blocker / "sub"))
    assert check_lease_dir().status == "fail"


@pytest.mark.parametrize("env,status,needle", [
    ({}, "pass", "single process"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "n1",
      "MASTER_PORT": "29500"}, "pass", "torchrun: rank 1/2 (local 1/2"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "1"}, "fail",
     "RANK=2 is not in 0..1 (WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "fail", "WORLD_SIZE='two' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "4"}, "fail", "MASTER_ADDR and MASTER_PORT unset"),
    ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, "fail", "not a TCP port"),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "n", "MASTER_PORT": "2"},
     "warn", "only 2 GPU(s) are visible"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "1"}, "fail",
     "LOCAL_RANK=1 is not below"),
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "5", "SLURM_NTASKS": "4", "SLURM_STEP_ID": "0"},
     "fail", "SLURM_PROCID=5 is not in 0..3 (SLURM_STEP_NUM_TASKS=4"),
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "5", "SLURM_NTASKS": "4"}, "fail",
     "SLURM_PROCID=5 but no SLURM_STEP_ID"),
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
      "SLURM_STEP_ID": "3"}, "pass", "slurm: rank 1/4 (local 1/4"),
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "RANK": "0", "SLURM_STEP_ID": "0",
      "WORLD_SIZE": "4", "MASTER_ADDR": "n", "MASTER_PORT": "2"}, "warn", "SLURM_PROCID=1"),
    ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "pass",
     "Slurm job 9 (the sbatch script, 2 task(s) in the job); one process, a world of one"),
    ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2"}, "pass", "Slurm job 9 (salloc's shell, 2 task(s) in the job)"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "pass", "mpi: rank 0/2"),
    ({"PMI_RANK": "-1", "PMI_SIZE": "2"}, "fail", "PMI_RANK=-1 is not in 0..1 (PMI_SIZE=2"),
])
def test_launcher_variables(env, status, needle):
    check = check_launcher(env, visible_gpus=2)
    assert check.status == status, check
    assert needle in check.message and "\n" not in check.message


def test_torch_build_against_the_driver(monkeypatch):
    import torch

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # a machine whose GPUs are visible
    gpus = (_gpu(0),)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    cpu = check_torch_build(_nvml(*gpus))
    assert cpu.status == "fail" and "CPU-only" in cpu.message and "whl/cu124" in cpu.message
    assert check_torch_build(Inventory("simulated", gpus)).status == "warn"
    assert check_torch_build(Inventory("none", ())).status == "pass"
    monkeypatch.setattr(torch.version, "cuda", "12.6")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert check_torch_build(_nvml(*gpus, cuda="12.8")).status == "pass"
    assert check_torch_build(_nvml(*gpus, cuda="12.4")).status == "warn"
    old = check_torch_build(_nvml(*gpus, cuda="11.8"))
    assert old.status == "fail" and "CUDA 12.6" in old.message and "11.8" in old.message
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_torch_build(_nvml(*gpus, cuda="12.8")).status == "fail"
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert check_torch_build(_nvml(*gpus)).status == "fail"


def test_torch_import_failure_is_a_fail(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    check = check_torch_build(_nvml(_gpu(0)))
    assert check.status == "fail" and "cannot be imported" in check.message
    assert check_nccl().status == "skip"


def test_nccl(monkeypatch):
    import torch

    if torch.version.cuda is None:
        assert check_nccl().status == "skip"
    fake = types.SimpleNamespace(version=lambda: (2, 21, 5))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "nccl", fake, raising=False)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True, raising=False)
    for name in [k for k in os.environ if k.startswith("NCCL_")]:
        monkeypatch.delenv(name)
    # NVIDIA's images label their NCCL with NCCL_VERSION: not a setting (seen on an H100 machine)
    monkeypatch.setenv("NCCL_VERSION", "2.28.3-1")
    assert check_nccl() == Check("nccl", "pass", "NCCL 2.21.5")
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    check = check_nccl()
    assert check.status == "warn" and "NCCL_P2P_DISABLE=1" in check.message
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: False)
    assert check_nccl().status == "warn"


def test_version_parsing():
    assert parse_cuda_version("12.4") == (12, 4) and parse_cuda_version("x") is None
    assert format_nccl_version((2, 21, 5)) == "2.21.5"
    assert format_nccl_version(21905) == "2.19.5" and format_nccl_version(2708) == "2.7.8"


def test_run_checks_on_a_simulated_machine(simulate):
    simulate([h100(), A100])
    checks = run_checks(env={"CUDA_VISIBLE_DEVICES": "1"})
    names = [c.name for c in checks]
    assert names == ["nvml", "gpus", "torch", "torch_version", "nccl", "cuda_device_order",
                     "cuda_visible_devices", "lease_dir", "queue_policy", "pid_namespace", "launcher"]
    by_name = {c.name: c for c in checks}
    assert by_name["cuda_device_order"].status == "warn"  # mixed models, index, no PCI_BUS_ID
    assert summarize(checks)["fail"] == 0
    assert [c.name for c in run_checks(env={}, torch=False)] == [
        "nvml", "gpus", "cuda_device_order", "cuda_visible_devices", "lease_dir", "queue_policy", "pid_namespace",
        "launcher"]


def test_torch_version_against_the_tested_range(monkeypatch):
    floor = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}"
    newest = f"{TORCH_NEWEST_TESTED[0]}.{TORCH_NEWEST_TESTED[1]}"
    assert check_torch_version(f"{floor}.0+cu124").status == "pass"
    assert check_torch_version(f"{newest}.3").status == "pass"
    old = check_torch_version(f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.1")
    assert old.status == "fail" and f"pip install 'torch>={floor}'" in old.message
    assert check_torch_version("1.13.1").status == "fail"
    new = check_torch_version(f"{TORCH_NEWEST_TESTED[0]}.{TORCH_NEWEST_TESTED[1] + 1}.0.dev20260101")
    assert new.status == "warn" and newest in new.message and "newer" in new.message
    assert check_torch_version("3.0.0").status == "warn"
    assert check_torch_version("nightly").status == "warn"
    import torch

    monkeypatch.setattr(torch, "__version__", f"{floor}.1")
    assert check_torch_version() == Check("torch_version", "pass",
                                          f"torch {floor}.1, within the tested {floor} to {newest}")
    monkeypatch.setitem(sys.modules, "torch", None)
    assert check_torch_version().status == "skip"


def test_torch_version_parsing():
    assert parse_torch_version("2.13.0+cpu") == (2, 13)
    assert parse_torch_version("2.16.0.dev20260101+cu128") == (2, 16)
    assert parse_torch_version("2.6.0a0+git1234") == (2, 6)
    assert parse_torch_version("") is None and parse_torch_version(None) is None


def test_the_floor_is_what_the_package_declares_and_the_docs_record():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    declared = re.search(r'"torch>=([\d.]+)"', (root / "pyproject.toml").read_text()).group(1)
    assert parse_torch_version(declared) == TORCH_FLOOR
    record = (root / "docs" / "torch-versions.md").read_text()
    for version in (TORCH_FLOOR, TORCH_NEWEST_TESTED):  # each end has a row in the results table
        assert re.search(rf"^\| {version[0]}\.{version[1]}\.\d+ +\|", record, re.M), version
