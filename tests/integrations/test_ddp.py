"""Two gloo ranks under each framework: one leak report (rank 0), one agreed batch size.

Each test starts the framework's own launcher (Lightning's ddp strategy re-runs the script;
torchrun for the HF Trainer) in a new process group, bounded in time and killed whole on timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import child_env, rendezvous_port

HERE = Path(__file__).resolve().parent
TIMEOUT = 300


def run_ranks(command: list[str], out: Path) -> list[dict]:
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    env.pop("DEVICEKIT_SIMULATE", None)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the ranks did not finish in {TIMEOUT} s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    return results + [output]


@pytest.mark.slow
def test_lightning_ddp_two_ranks_one_report(tmp_path: Path, no_leftover_children: None) -> None:
    rank0, rank1, output = run_ranks([sys.executable, str(HERE / "lightning_ddp_job.py"), str(tmp_path)], tmp_path)
    assert len(rank0["warnings"]) == 1 and "self.loss_history" in rank0["warnings"][0]
    assert rank0["reports"] == [["self.loss_history"]]
    assert rank1["warnings"] == [] and rank1["reports"] == []
    assert rank0["batch_size"] == rank1["batch_size"] == 13  # the smaller rank's limit, on both
    assert rank0["loader_batch_size"] == rank1["loader_batch_size"] == 13


@pytest.mark.slow
def test_transformers_ddp_two_ranks_one_report(tmp_path: Path, no_leftover_children: None) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
               f"--master-port={rendezvous_port()}", str(HERE / "transformers_ddp_job.py"), str(tmp_path)]
    rank0, rank1, output = run_ranks(command, tmp_path)
    assert rank0["world"] == rank1["world"] == 2 and rank0["steps"] == rank1["steps"] == 6
    assert len(rank0["warnings"]) == 1 and "self.losses" in rank0["warnings"][0]
    assert rank0["reports"] == [["self.losses"]]
    assert rank1["warnings"] == [] and rank1["reports"] == []
    assert rank0["batch_size"] == rank1["batch_size"] == 7
