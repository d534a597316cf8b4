"""The hang doctor with NCCL on two real GPUs (skips with fewer than 2 GPUs).

Rank 1 sleeps before the 4th all_reduce; rank 0 waits in it on its GPU. The report must name
rank 1 and its line, and show the collective rank 0 waits in, as on gloo
(tests/jobs/test_hang_doctor.py).
"""

from __future__ import annotations

import time

import pytest
import torch

import devicekit as dk

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def stuck_on_gpu() -> str:
    import torch.distributed as tdist

    t = torch.ones(4, device=dk.dist.device())
    for step in range(6):
        if step == 3 and tdist.get_rank() == 1:
            time.sleep(300)
        tdist.all_reduce(t)
    torch.cuda.synchronize()
    return "done"


def test_nccl_hang_names_the_stuck_rank() -> None:
    with pytest.raises(dk.RankHangError) as info:
        dk.launch(stuck_on_gpu, nprocs=2, devices="visible", hang_timeout=5)
    err = info.value
    assert err.stuck_ranks == [1]
    assert "rank 1: not in a collective; now at test_hang_nccl.py" in err.report
    assert "rank 0: waits in all_reduce" in err.report
    assert "look at rank 1" in err.report.splitlines()[-1]
