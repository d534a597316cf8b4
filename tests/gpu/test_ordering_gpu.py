"""On a real GPU: devicekit's uuid -> cuda:N mapping agrees with CUDA's own device list.

Each check runs in a fresh interpreter, so the CUDA_VISIBLE_DEVICES it sets is read by CUDA at
initialisation exactly as a user's script would.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import devicekit

pytestmark = pytest.mark.gpu
SRC = str(Path(devicekit.__file__).parents[1])

CHECK = """
import json, os, sys
import devicekit as dk
from devicekit.hardware.visible import torch_ordinal
mode = sys.argv[1]
found = dk.gpus()
if mode == "probed":  # cuInit now: CUDA_VISIBLE_DEVICES set later is ignored by CUDA
    import torch
    torch.cuda.is_available()
if mode == "reversed":
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in reversed(found))
sel = dk.select_gpus("all", lease=False)
if mode in ("narrowed", "probed"):
    sel = dk.select_gpus(1, lease=False, order="index", exclude=[g.index for g in found[:-1]])
    os.environ["CUDA_VISIBLE_DEVICES"] = sel.cuda_visible_devices
before = [d.index for d in sel.devices]           # computed from the environment
import torch
torch.cuda.init()
after = [d.index for d in sel.devices]            # matched in CUDA's own list by UUID
actual = [str(torch.cuda.get_device_properties(i).uuid) for i in after]
print(json.dumps({"wanted": [g.uuid for g in sel.gpus], "before": before, "after": after,
                  "actual": actual}))
"""


def run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC)
    for name in ("DEVICEKIT_SIMULATE", "CUDA_VISIBLE_DEVICES"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", CHECK, mode], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def same(nvml_uuid: str, torch_uuid: str) -> bool:
    def strip(u: str) -> str:
        u = u.lower()
        return u[4:] if u.startswith(("gpu-", "mig-")) else u

    return strip(nvml_uuid) == strip(torch_uuid)


@pytest.mark.parametrize("mode", ["all", "reversed", "narrowed", "probed"])
def test_devices_point_at_the_selected_cards(mode):
    result = run(mode)
    assert result["before"] == result["after"]
    assert all(same(w, a) for w, a in zip(result["wanted"], result["actual"], strict=True)), result
    if mode == "narrowed":
        assert result["after"] == [0]
