"""End to end on the CPU: ``devicekit run`` under srun-like and torchrun launchers, concurrent
single-node runs, and torchrun's per-rank log directory (issue 14, items 1, 6 and 8)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.ranks import child_env, devicekit_command, rendezvous_port

pytestmark = pytest.mark.slow

#: every rank records who it is and the sum of (rank + 1) over the world
SCRIPT = textwrap.dedent(
    """
    import sys, time, torch, devicekit as dk
    dk.dist.init(timeout=90)
    f = dk.dist.env()
    total = dk.dist.all_reduce_mean(torch.tensor([float(f.rank + 1)])).item() * f.world_size
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
    dk.dist.barrier()
    open(f"{sys.argv[1]}/rank{f.rank}.txt", "w").write(f"{f.source} {f.rank} {f.world_size} {total:g}")
    dk.dist.destroy()
    """
)


def start_all(commands: list[tuple[list[str], dict[str, str]]], logs: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for i, (argv, env) in enumerate(commands):
        with (logs / f"job{i}.log").open("w") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen[bytes]], logs: Path, timeout: float = 150) -> list[str]:
    try:
        deadline = time.monotonic() + timeout
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    outputs = [(logs / f"job{i}.log").read_text() for i in range(len(procs))]
    assert [p.returncode for p in procs] == [0] * len(procs), outputs
    return outputs


def ranks(directory: Path, world: int) -> list[list[str]]:
    return [(directory / f"rank{r}.txt").read_text().split() for r in range(world)]


def slurm_task(procid: int, ntasks: int, localid: int, nodeid: int, nnodes: int, per_node: int,
               port: int) -> dict[str, str]:
    return child_env(SLURM_PROCID=str(procid), SLURM_NTASKS=str(ntasks), SLURM_LOCALID=str(localid),
                     SLURM_NODEID=str(nodeid), SLURM_NNODES=str(nnodes),
                     SLURM_TASKS_PER_NODE=f"{per_node}(x{nnodes})", SLURM_JOB_NODELIST="localhost",
                     SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_JOB_NAME="train",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def test_srun_tasks_join_one_world(tmp_path: Path, no_leftover_children: None) -> None:
    """srun -n 2 devicekit run -- python script.py: one world of 2, not two worlds of 1."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    port = rendezvous_port()
    argv = devicekit_command("run", "--", sys.executable, str(script), str(tmp_path))
    procs = start_all([(argv, slurm_task(r, 2, r, 0, 1, 2, port)) for r in (0, 1)], tmp_path)
    wait_all(procs, tmp_path)
    assert ranks(tmp_path, 2) == [["slurm", "0", "2", "3"], ["slurm", "1", "2", "3"]]


def test_srun_one_task_per_node_runs_torchrun_on_each(tmp_path: Path, no_leftover_children: None) -> None:
    """srun --ntasks-per-node=1 devicekit run --procs 2: torchrun per node, a world of 4."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    port = rendezvous_port()
    argv = devicekit_command("run", "--procs", "2", "--", sys.executable, str(script), str(tmp_path))
    procs = start_all([(argv, slurm_task(n, 2, 0, n, 2, 1, port)) for n in (0, 1)], tmp_path)
    outputs = wait_all(procs, tmp_path, timeout=200)
    assert [r[:3] for r in ranks(tmp_path, 4)] == [["torchrun", str(r), "4"] for r in range(4)]
    assert {r[3] for r in ranks(tmp_path, 4)} == {"10"}
    assert "node 1 of 2" in outputs[1]


def test_under_torchrun_each_rank_is_its_rank(tmp_path: Path, no_leftover_children: None) -> None:
    """torchrun --nproc-per-node 2 devicekit run -- python script.py (the agent's store kept)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(rendezvous_port()), "--no-python",
            *devicekit_command("run", "--", sys.executable, str(script), str(tmp_path))]
    wait_all(start_all([(argv, child_env())], tmp_path), tmp_path)
    assert ranks(tmp_path, 2) == [["torchrun", "0", "2", "3"], ["torchrun", "1", "2", "3"]]


def test_two_concurrent_single_node_runs_do_not_share_a_port(tmp_path: Path,
                                                             no_leftover_children: None) -> None:
    """Each single-node run gets torchrun's standalone rendezvous on its own free port (no
    29500 on torch releases that do not pick one themselves)."""
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    jobs = [(devicekit_command("run", "--procs", "2", "--", sys.executable, str(script), str(d), "2"),
             child_env()) for d in dirs]
    outputs = wait_all(start_all(jobs, tmp_path), tmp_path, timeout=200)
    for d in dirs:
        assert [r[:3] for r in ranks(d, 2)] == [["torchrun", "0", "2"], ["torchrun", "1", "2"]]
    assert all("standalone rendezvous" in out for out in outputs)


def test_log_dir_keeps_each_ranks_output(tmp_path: Path, no_leftover_children: None) -> None:
    logs = tmp_path / "logs"
    done = subprocess.run(
        devicekit_command("run", "--log-dir", str(logs), "--", sys.executable, "-c",
                          "import os; print('hello from', os.environ['RANK'])"),
        env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = [p for p in logs.rglob("stdout.log") if "hello from 0" in p.read_text()]
    assert files, list(logs.rglob("*"))
    assert "hello from 0" in done.stdout + done.stderr  # still shown (--tee)
