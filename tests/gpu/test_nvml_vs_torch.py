"""On a real GPU: what NVML (devicekit's inventory) says agrees with what CUDA/torch says.

torch runs in a fresh interpreter with a controlled environment, so ``CUDA_DEVICE_ORDER`` and
``CUDA_VISIBLE_DEVICES`` are read by CUDA at its initialisation exactly as in a user's script
(this process's CUDA may already be initialised with whatever the runner had set).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import devicekit
from devicekit.hardware.nvml import NVMLBackend

pytestmark = pytest.mark.gpu
SRC = str(Path(devicekit.__file__).parents[1])

TORCH_SIDE = """
import json, torch
out = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    out.append({"uuid": str(p.uuid), "name": p.name, "total": p.total_memory,
                "cc": [p.major, p.minor]})
print(json.dumps(out))
"""


def torch_view(**env_overrides: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=SRC)
    for name in ("DEVICEKIT_SIMULATE", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        env.pop(name, None)
    env.update(env_overrides)
    done = subprocess.run([sys.executable, "-c", TORCH_SIDE], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def bare(uuid: str) -> str:
    uuid = uuid.lower()
    return uuid[4:] if uuid.startswith(("gpu-", "mig-")) else uuid


@pytest.fixture(scope="module")
def nvml_gpus():
    gpus = NVMLBackend().snapshot()
    if not gpus:
        pytest.skip("NVML sees no GPU")
    if any(g.mig_enabled for g in gpus):
        pytest.skip("a GPU is in MIG mode: CUDA's devices are its instances, not the GPUs")
    return gpus


def test_uuids_names_and_capabilities_match(nvml_gpus):
    seen = torch_view(CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert len(seen) == len(nvml_gpus)
    for gpu, dev in zip(nvml_gpus, seen, strict=True):  # PCI_BUS_ID: ordinal i is NVML's i-th
        assert bare(gpu.uuid) == bare(dev["uuid"])
        assert gpu.name == dev["name"]
        assert list(gpu.compute_capability) == dev["cc"]


def test_memory_totals_agree(nvml_gpus):
    by_uuid = {bare(d["uuid"]): d for d in torch_view()}
    for gpu in nvml_gpus:
        dev = by_uuid.get(bare(gpu.uuid))
        if dev is None:
            continue
        # CUDA's total leaves out what the driver reserves for itself: a few percent at most
        assert dev["total"] <= gpu.memory_total
        assert (gpu.memory_total - dev["total"]) / gpu.memory_total < 0.05
        assert gpu.memory_used + gpu.memory_free <= gpu.memory_total


def test_ordinals_follow_visible_devices(nvml_gpus):
    chosen = list(reversed(nvml_gpus))
    seen = torch_view(CUDA_VISIBLE_DEVICES=",".join(g.uuid for g in chosen))
    assert [bare(d["uuid"]) for d in seen] == [bare(g.uuid) for g in chosen]
    last = nvml_gpus[-1]
    seen = torch_view(CUDA_VISIBLE_DEVICES=str(last.index), CUDA_DEVICE_ORDER="PCI_BUS_ID")
    assert [bare(d["uuid"]) for d in seen] == [bare(last.uuid)]


def test_snapshot_facts_are_live(nvml_gpus):
    backend = NVMLBackend()
    for gpu in backend.snapshot():
        assert gpu.uuid.startswith("GPU-") and gpu.pci_bus_id and ":" in gpu.pci_bus_id
        assert 0 <= (gpu.utilization or 0) <= 100
        assert gpu.memory_total > 0 and gpu.processes is not None
    assert backend.driver_version() and backend.cuda_driver_version()
