"""devicekit's own imports print nothing: torch's deprecation noise stays out of users' logs."""

from __future__ import annotations

import subprocess
import sys

from tests.ranks import child_env

SAVE_IN_A_PROCESS_GROUP = """
import torch, torch.distributed as dist
import devicekit as dk
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
model = dk.ddp(torch.nn.Linear(2, 2), device="cpu")
opt = torch.optim.Adam(model.parameters())
model(torch.ones(1, 2)).sum().backward(); opt.step()
dk.save_ddp_checkpoint(model, opt, "{ckpt}", epoch=1)
dist.destroy_process_group()
print("saved")
"""


def test_save_ddp_checkpoint_prints_no_jit_script_warnings(tmp_path) -> None:
    # importing torch.distributed.optim only for an isinstance check printed 8
    # "`torch.jit.script` is deprecated" lines per rank on torch >= 2.10
    code = SAVE_IN_A_PROCESS_GROUP.format(store=tmp_path / "store", ckpt=tmp_path / "c.pt")
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True,
                          text=True, timeout=120, env=child_env())
    assert done.returncode == 0, done.stderr
    assert "saved" in done.stdout
    assert "jit.script" not in done.stderr
    assert "torch.distributed.optim" not in done.stderr
