"""dk.launch with real processes on the CPU (gloo): results, failures, hangs, no orphans."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

import devicekit as dk

pytestmark = pytest.mark.slow


def train_tiny(steps: int) -> dict[str, object]:
    """Every rank trains the same DDP model on its own data; returns what it ended with."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    facts = dk.dist.env()
    torch.manual_seed(facts.rank)  # different initial weights: DDP must broadcast rank 0's
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(100 + facts.rank)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=data)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    # the environment the interpreter started with (before spawn re-imported __main__, which may
    # touch CUDA at module level): the rank's variables must already be there
    startup = dict(item.split("=", 1) for item in
                   Path("/proc/self/environ").read_bytes().decode(errors="replace").split("\0")
                   if "=" in item) if Path("/proc/self/environ").exists() else None
    return {"rank": facts.rank, "source": facts.source, "world": facts.world_size,
            "startup": startup,
            "params": params.tolist(), "loss": float(dk.dist.all_reduce_mean(loss.detach())),
            "gathered": dk.dist.gather_object(facts.rank * 10)}


def test_two_ranks_train_and_agree() -> None:
    results = dk.launch(train_tiny, 5, nprocs=2, timeout=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert {r["source"] for r in results} == {"devicekit"} and results[0]["world"] == 2
    assert results[0]["params"] == results[1]["params"]
    assert results[0]["loss"] == results[1]["loss"]
    assert results[0]["gathered"] == results[1]["gathered"] == [0, 10]
    for rank, result in enumerate(results):
        startup = result["startup"]
        if startup is not None:  # Linux: CUDA_VISIBLE_DEVICES & co. are set at exec, not later
            assert (startup.get("RANK"), startup.get("WORLD_SIZE")) == (str(rank), "2")
            assert startup.get("CUDA_VISIBLE_DEVICES") == ""


def fail_on_rank_one(pid_dir: str) -> None:
    Path(pid_dir, f"{dk.dist.env().rank}.pid").write_text(str(os.getpid()))
    rank = dk.dist.env().rank
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("rank one cannot go on")
    if rank == 0:
        dk.dist.barrier()  # fails too once rank 1 is gone: a consequence, not the cause
    time.sleep(60)  # rank 2 would wait forever: launch must stop it


def test_failing_rank_stops_the_job(tmp_path: Path, no_leftover_children: None) -> None:
    import multiprocessing

    before = set(multiprocessing.active_children())
    start = time.monotonic()
    with pytest.raises(dk.RankFailedError) as info:
        dk.launch(fail_on_rank_one, str(tmp_path), nprocs=3, devices="cpu", timeout=60)
    assert time.monotonic() - start < 30  # not the 60 s timeout: the others were stopped
    err = info.value
    assert err.rank == 1
    assert str(err).splitlines()[0] == "rank 1 of 3 failed: ValueError: rank one cannot go on"
    assert 'raise ValueError("rank one cannot go on")' in err.traceback_text
    assert "fail_on_rank_one" in err.traceback_text
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    assert set(multiprocessing.active_children()) <= before  # reaped by multiprocessing too
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def hang_on_rank_one() -> str:
    if dk.dist.env().rank == 1:
        time.sleep(60)
    dk.dist.barrier()
    return "done"


def test_hanging_rank_is_named(no_leftover_children: None) -> None:
    start = time.monotonic()
    with pytest.raises(dk.RankHangError) as info:
        dk.launch(hang_on_rank_one, nprocs=2, timeout=3)
    assert time.monotonic() - start < 60  # bounded (start-up on a busy machine is not counted)
    err = info.value
    assert err.stuck_ranks == [1]
    assert "rank 1 at test_launch.py" in str(err) and "hang_on_rank_one" in str(err)
    assert "hang_on_rank_one" in err.stacks[1]
    assert "barrier" in err.stacks[0]  # rank 0 waits for it in a collective


def _both_ranks_ready(rank: int) -> None:
    """Wait (up to 60 s) until both ranks have started: on a loaded machine one rank can start
    seconds after the other, and ``init(timeout=1)`` would time out in the rendezvous, not in
    the barrier the test is about (CI once failed so: 'wait timeout after 1000ms' at init)."""
    import tempfile

    marks = Path(tempfile.gettempdir()) / f"dk-launch-sync-{os.environ['MASTER_PORT']}"
    marks.mkdir(exist_ok=True)
    (marks / str(rank)).touch()
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)


def barrier_with_timeout() -> object:
    import shutil
    import tempfile

    import torch

    rank = int(os.environ["RANK"])
    _both_ranks_ready(rank)
    dk.dist.init(timeout=1)
    if rank == 0:
        shutil.rmtree(Path(tempfile.gettempdir()) / f"dk-launch-sync-{os.environ['MASTER_PORT']}",
                      ignore_errors=True)
    if dk.dist.env().rank == 1:
        time.sleep(2.2)
        return torch.full((3,), 2.5)  # the rank exits at once (backend=None): sent by value
    start = time.monotonic()
    try:
        dk.dist.barrier()
    except RuntimeError:
        return f"timed out after {time.monotonic() - start:.0f} s"
    return "no timeout"


def test_init_timeout_applies() -> None:
    import torch

    results = dk.launch(barrier_with_timeout, nprocs=2, backend=None, timeout=30)
    assert results[0] in ("timed out after 1 s", "timed out after 2 s")
    assert torch.equal(results[1], torch.full((3,), 2.5))


def not_picklable_result() -> object:
    return lambda: None


def test_bad_arguments() -> None:
    with pytest.raises(dk.InvalidValueError, match="cannot send .*module-level function"):
        dk.launch(lambda: None, nprocs=1)
    with pytest.raises(dk.InvalidValueError, match="timeout=0"):
        dk.launch(train_tiny, 1, nprocs=1, timeout=0)
    with pytest.raises(dk.InvalidValueError, match="nprocs=0"):
        dk.launch(train_tiny, 1, nprocs=0)
    with pytest.raises(dk.InvalidValueError, match="devices='gpu'"):
        dk.launch(train_tiny, 1, devices="gpu")
    with pytest.raises(dk.InvalidValueError, match="min_free_memory='1GiB'.*devices='cpu'"):
        dk.launch(train_tiny, 1, devices="cpu", min_free_memory="1GiB")
    with pytest.raises(dk.InvalidValueError, match="gpus_per_proc=2 with devices='cpu'"):
        dk.launch(train_tiny, 1, devices="cpu", gpus_per_proc=2)
    with pytest.raises(dk.RankFailedError, match="rank 0 returned a value that cannot be sent back"):
        dk.launch(not_picklable_result, nprocs=1, backend=None)


def die_hard_on_rank_one() -> str:
    import signal

    if dk.dist.env().rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # like the kernel's OOM killer
    time.sleep(60)
    return "unreachable"


def test_rank_killed_by_a_signal_is_reported(no_leftover_children: None) -> None:
    with pytest.raises(dk.RankFailedError) as info:
        dk.launch(die_hard_on_rank_one, nprocs=2, backend=None)
    assert info.value.rank == 1
    assert str(info.value) == "rank 1 of 2 died with signal SIGKILL before returning"


def exit_quietly() -> None:
    import sys

    sys.exit(0 if dk.dist.env().rank == 0 else 3)


def test_sys_exit_in_a_rank() -> None:
    with pytest.raises(dk.RankFailedError, match="rank 1 of 2 failed: SystemExit: 3"):
        dk.launch(exit_quietly, nprocs=2, backend=None)


PARENT_SCRIPT = """
import os, sys, time
import devicekit as dk

def sleeper(pid_dir):
    open(os.path.join(pid_dir, f"{dk.dist.env().rank}.pid"), "w").write(str(os.getpid()))
    time.sleep(60)

if __name__ == "__main__":
    dk.launch(sleeper, sys.argv[1], nprocs=2, backend=None)
"""


def test_ranks_die_with_a_killed_parent(tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.ranks import child_env

    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=child_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("*.pid"))) < 2 or not all(
                p.read_text() for p in tmp_path.glob("*.pid")):
            assert time.monotonic() < deadline, "ranks never started"
            time.sleep(0.05)
        ranks = [psutil.Process(int(p.read_text())) for p in tmp_path.glob("*.pid")]
        parent.kill()  # SIGKILL: the parent cannot clean up; the ranks must notice alone
        parent.wait(timeout=10)
        gone, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive, f"orphaned ranks: {[p.pid for p in alive]}"
    finally:
        if parent.poll() is None:
            parent.kill()
        for rank in ranks:
            if rank.is_running():
                rank.kill()


def test_function_the_ranks_cannot_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    module = types.ModuleType("only_in_the_parent")  # like a function typed into a notebook
    exec("def work():\n    return 1\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "only_in_the_parent", module)
    with pytest.raises(dk.RankFailedError, match="cannot load the function to run"):
        dk.launch(module.work, nprocs=1, backend=None)


def test_the_rank_that_failed_first_is_blamed_not_its_peers() -> None:
    """No processes: the supervisor's choice among failures that arrived together."""
    import shutil

    from devicekit.jobs.allocation import plan_processes
    from devicekit.jobs.launch import _Job

    job = _Job(plan_processes("cpu", 3), b"", "gloo", None)
    shutil.rmtree(job.workdir)
    broken = 'File "/x/torch/distributed/distributed_c10d.py", line 1, in barrier\nRuntimeError'
    # rank 0's barrier broke first in time order of arrival, but inside torch.distributed
    job.receive(0, ("error", "RuntimeError: Connection closed by peer", broken, 100.0))
    job.receive(2, ("error", "KeyError: 'x'", "Traceback: in load_batch\nKeyError", 100.2))
    job.receive(1, ("error", "ValueError: bad shard", "Traceback: in step\nValueError", 100.1))
    with pytest.raises(dk.RankFailedError, match="rank 1 of 3 failed: ValueError") as info:
        job.blame()
    assert info.value.rank == 1
    job.failures = {0: job.failures[0]}  # only collective failures: the earliest of them
    job.receive(2, ("error", "RuntimeError: timeout", broken, 99.0))
    with pytest.raises(dk.RankFailedError, match="rank 2 of 3"):
        job.blame()


def flight_recorder_dump_paths() -> list[str | None]:
    import os

    return [os.environ.get("TORCH_FR_DUMP_TEMP_FILE"), os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")]


def test_flight_recorder_dumps_go_to_the_jobs_private_directory(monkeypatch) -> None:
    """torch's default dump path is a predictable /tmp name another user can plant a symlink at."""
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    (paths,) = dk.launch(flight_recorder_dump_paths, nprocs=1, devices="cpu", timeout=60)
    assert paths[0] == paths[1] and "devicekit-launch-" in paths[0]
    assert paths[0].endswith("nccl_trace_rank_")
