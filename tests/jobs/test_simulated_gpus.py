"""launch and ``devicekit run`` on simulated GPUs: per-rank CUDA_VISIBLE_DEVICES and leases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import devicekit as dk
from devicekit.jobs.allocation import allocate
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.leases import read_leases
from devicekit.sharing.tickets import read_tickets
from tests.conftest import h100
from tests.ranks import child_env, devicekit_command, pid_written

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(4)]


@pytest.fixture
def four_gpus(simulate: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return simulate([h100(uuid=UUIDS[0]), h100(used="79GiB", uuid=UUIDS[1]),
                     h100(uuid=UUIDS[2]), h100(uuid=UUIDS[3])])


def test_allocation_splits_gpus_per_process(four_gpus: Path) -> None:
    with pytest.raises(dk.NoDeviceAvailable, match="GPU 1"):  # GPU 1 is full: 3 usable
        allocate(4, gpus_per_proc=2, min_free_memory="10GiB")
    plan = allocate(2, gpus_per_proc=2)
    try:
        assert plan.nprocs == 1 and plan.visible_devices(0).count("GPU-") == 2
    finally:
        plan.release()


def test_allocation_all_with_procs_is_refused_not_ignored(four_gpus: Path) -> None:
    with pytest.raises(dk.InvalidValueError, match="--procs 2"):
        allocate("all", 2)
    assert read_leases() == []


def test_allocation_all_rounds_to_whole_processes(four_gpus: Path) -> None:
    plan = allocate("all", gpus_per_proc=2, min_free_memory="10GiB")
    try:
        assert plan.nprocs == 1 and len(plan.uuids) == 2
        assert UUIDS[1] not in plan.uuids
        assert plan.visible_devices(0) == ",".join(plan.uuids)
        assert any("GPU 1" in line for line in plan.rejected)
        assert {r.gpu_uuid for r in read_leases()} == set(plan.uuids)
    finally:
        plan.release()
    assert read_leases() == []


def rank_view() -> dict[str, object]:
    return {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "leased": sorted(r.gpu_uuid for r in read_leases()),
            "source": dk.dist.env().source, "threads": os.environ.get("OMP_NUM_THREADS")}


def test_launch_gives_each_rank_its_own_leased_gpu(four_gpus: Path) -> None:
    views = dk.launch(rank_view, nprocs=2, backend=None, timeout=60)
    visible = [v["visible"] for v in views]
    assert len(set(visible)) == 2 and set(visible) <= set(UUIDS) - {UUIDS[1]}
    for view in views:
        assert view["leased"] == sorted(visible)  # held while the ranks ran
        assert view["source"] == "devicekit"
    assert read_leases() == []  # and freed afterwards


def test_launch_cpu_ranks_on_a_gpu_machine_lease_nothing(
        four_gpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    views = dk.launch(rank_view, nprocs=2, devices="cpu", backend=None, timeout=60)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for view in views:
        assert view["visible"] == ""      # CUDA hidden: gloo CPU ranks
        assert view["leased"] == []       # and no GPU taken from anyone else
        assert view["threads"] == str(max(1, (cores or 1) // 2))  # the cores are shared


def test_launch_plans_for_each_devices_mode(four_gpus: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.jobs.allocation import plan_processes
    from devicekit.jobs.launch import _Job

    cpu = plan_processes("cpu", None)
    assert (cpu.nprocs, cpu.on_gpu) == (1, False)
    visible = plan_processes("visible", None)  # one rank per visible GPU, nothing leased
    assert (visible.nprocs, visible.on_gpu) == (4, False) and read_leases() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert plan_processes("visible", None).nprocs == 2
    assert plan_processes("visible", None, gpus_per_proc=2).nprocs == 1
    shared = _Job(plan_processes("visible", 2), b"", None, None).variables(1, 29500)
    assert "CUDA_VISIBLE_DEVICES" not in shared        # the caller's GPUs, as under torchrun
    assert "DEVICEKIT_OWN_DEVICES" not in shared       # dk.dist.device(): the rank-th GPU
    hidden = _Job(cpu, b"", None, None, hide_gpus=True).variables(0, 29500)
    assert hidden["CUDA_VISIBLE_DEVICES"] == ""
    auto = plan_processes("auto", 2)
    try:
        assert auto.on_gpu and len(read_leases()) == 2
    finally:
        auto.release()


def test_errors_speak_the_callers_words(simulate: Callable[..., Path],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """dk.launch is told about its own arguments, devicekit run about its flags."""
    from devicekit.jobs.allocation import plan_processes

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    simulate([h100(used="70GiB", util=95), h100(used="75GiB", util=90)])
    with pytest.raises(dk.NoDeviceAvailable) as launch:
        plan_processes("auto", None)
    assert "launch() without nprocs: no GPU is free" in str(launch.value)
    assert "nprocs=N" in str(launch.value) and "--" not in str(launch.value)
    with pytest.raises(dk.NoDeviceAvailable) as run:
        allocate("all")
    assert "--gpus all: no GPU is free" in str(run.value) and "--gpus 0,1" in str(run.value)
    with pytest.raises(dk.InvalidSizeError, match="^min_free_memory '20' has no unit"):
        plan_processes("auto", 2, min_free_memory="20")
    with pytest.raises(dk.InvalidSizeError, match="^--min-free '20' has no unit"):
        allocate(1, min_free_memory="20")
    with pytest.raises(dk.InvalidValueError, match="^gpus_per_proc=0 must be"):
        plan_processes("auto", 1, gpus_per_proc=0)
    simulate([])
    with pytest.raises(dk.InvalidSizeError, match="^min_free_memory '20' has no unit"):
        plan_processes("auto", None, min_free_memory="20")  # checked with no GPU to filter too
    assert read_leases() == []


LEASE_PROBE = textwrap.dedent(
    """
    import json, os
    from devicekit.sharing.leases import read_leases
    print(json.dumps({"visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                      "ranks": [os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")],
                      "leased": [r.gpu_uuid for r in read_leases()],
                      "holder": [r.command for r in read_leases()]}))
    raise SystemExit(7)
    """
)


def test_run_sets_visible_devices_and_holds_the_lease(four_gpus: Path) -> None:
    done = subprocess.run(devicekit_command("run", "--gpus", "1", "--", sys.executable, "-c", LEASE_PROBE),
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 7, done.stderr
    seen = json.loads(done.stdout)
    assert seen["visible"] in (UUIDS[0], UUIDS[2], UUIDS[3])
    assert seen["leased"] == [seen["visible"]]
    assert seen["ranks"] == ["0", "0", "1"]  # torchrun's variables for a world of one
    assert "LEASE_PROBE" not in seen["holder"][0] and "python" in seen["holder"][0]
    assert f"CUDA_VISIBLE_DEVICES={seen['visible']}" in done.stderr
    assert "leased GPU" in done.stderr
    assert read_leases() == []


def test_lease_outlives_a_killed_devicekit_run(four_gpus: Path, tmp_path: Path,
                                               no_leftover_children: None) -> None:
    pid_file = tmp_path / "child.pid"
    stubborn = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                f" open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")
    runner = subprocess.Popen(devicekit_command("run", "--gpus", "1", "--", sys.executable, "-c", stubborn),
                              env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        child = psutil.Process(pid_written(pid_file))
        runner.kill()  # SIGKILL: devicekit run cannot clean up
        runner.wait(timeout=10)
        time.sleep(0.3)
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        assert len(read_leases()) == 1  # the child still holds the GPU it uses
        child.kill()
        child.wait(timeout=10)
        assert read_leases() == []  # free the moment the last holder is gone
    finally:
        if runner.poll() is None:
            runner.kill()
        if child is not None and child.is_running():
            child.send_signal(signal.SIGKILL)


def test_run_all_gpus_under_torchrun_plan(four_gpus: Path) -> None:
    from devicekit.jobs.run import RunRequest, plan_run

    plan = plan_run(RunRequest(gpus="all", min_free_memory="10GiB", command=["python", "train.py"]))
    try:
        assert plan.distributed and plan.allocation.nprocs == 3
        assert plan.argv[plan.argv.index("--nproc-per-node") + 1] == "3"
        assert plan.argv[-2:] == ["python", "train.py"]
        assert plan.env["CUDA_VISIBLE_DEVICES"].count("GPU-") == 3
    finally:
        plan.allocation.release()


def test_run_busy_gpus_is_a_clear_error(four_gpus: Path) -> None:
    done = subprocess.run(devicekit_command("run", "--gpus", "4", "--min-free", "10GiB", "--", sys.executable, "-c", "pass"),
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 3
    assert "GPU 1" in done.stderr and "Traceback" not in done.stderr


def test_run_waits_for_a_leased_gpu(simulate: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    simulate([h100(uuid=UUIDS[0])])
    other_job = dk.select_gpus(1)  # someone else holds the only GPU
    runner = subprocess.Popen(
        devicekit_command("run", "--gpus", "1", "--wait", "30", "--", sys.executable, "-c",
                          "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])"),
        env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60  # queued: its ticket is in the queue (no fixed sleep)
        while not any(t.pid == runner.pid for t in read_tickets(lease_dir(), cleanup=False)):
            assert runner.poll() is None and time.monotonic() < deadline, "never queued"
            time.sleep(0.05)
        assert runner.poll() is None  # still queued behind the other job
        other_job.release()
        out, err = runner.communicate(timeout=30)
    finally:
        other_job.release()
        if runner.poll() is None:
            runner.kill()
            runner.wait()
    assert runner.returncode == 0, err
    assert out.strip() == UUIDS[0]
