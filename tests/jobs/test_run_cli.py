"""``devicekit run`` end to end on the CPU: exit codes, signals, two nodes, the example."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tests.ranks import child_env, devicekit_command, pid_written, rendezvous_port

pytestmark = pytest.mark.slow


def run_cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(devicekit_command("run", *args), env=child_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def test_plan_for_cpu_processes_under_torchrun() -> None:
    from devicekit.jobs.run import RunRequest, plan_run

    outer = {"PATH": "/usr/bin", "DEVICEKIT_OWN_DEVICES": "1", "DEVICEKIT_LAUNCH": "1"}
    plan = plan_run(RunRequest(procs=2, command=["train.py", "--lr", "3"]), environ=outer)
    assert plan.distributed and not plan.allocation.on_gpu
    assert plan.argv[plan.argv.index("--nproc-per-node") + 1] == "2"
    assert plan.argv[-5:] == [sys.executable, "-u", "train.py", "--lr", "3"]
    assert "DEVICEKIT_OWN_DEVICES" not in plan.env and "DEVICEKIT_LAUNCH" not in plan.env
    single = plan_run(RunRequest(command=["python", "-c", "pass"]), environ={"PATH": "/usr/bin"})
    assert single.argv == ["python", "-c", "pass"]
    assert (single.env["RANK"], single.env["WORLD_SIZE"], single.env["LOCAL_RANK"]) == ("0", "1", "0")


def test_failed_rank_exit_code_passes_through_torchrun() -> None:
    done = run_cli("--procs", "2", "--", "sh", "-c", 'exit $((5 + RANK))', timeout=90)
    assert done.returncode in (5, 6), done.stderr  # the rank that failed first; torchrun says 1
    assert "Traceback" not in done.stderr
    assert f"exited with code {done.returncode} first; exiting {done.returncode}" in done.stderr


def test_exit_code_passes_through_and_cpu_is_announced() -> None:
    done = run_cli("--", sys.executable, "-c", "import sys; print('child ran'); sys.exit(3)")
    assert done.returncode == 3
    assert "child ran" in done.stdout
    assert "no GPU" in done.stderr and "CPU" in done.stderr


def test_child_killed_by_signal_gives_128_plus_n() -> None:
    done = run_cli("--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert done.returncode == 128 + signal.SIGTERM


def test_missing_command_is_one_line_and_exits_127() -> None:
    done = run_cli("--", "/nonexistent/tool")
    assert done.returncode == 127  # as a shell says "command not found"
    assert done.stderr.strip().splitlines()[-1].startswith("devicekit: cannot start '/nonexistent/tool'")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "2"], "no GPU"),
        (["--nnodes", "2", "--node-rank", "0"], "--master-addr"),
        (["--nnodes", "2", "--node-rank", "5", "--master-addr", "h"], "--node-rank 5"),
        (["--gpus", "many"], "'many'"),
        (["--min-free", "10XB"], "'10XB'"),
        (["--min-free", "20"], "--min-free '20' has no unit"),
        # torchrun printed 'gai error -2' every few seconds until its rendezvous timeout
        (["--nnodes", "2", "--node-rank", "1", "--master-addr", "no-such-node.invalid"],
         "--master-addr 'no-such-node.invalid' does not resolve"),
    ],
)
def test_bad_flags_are_one_line(args: list[str], needle: str) -> None:
    done = run_cli(*args, "--", sys.executable, "-c", "pass", timeout=30)
    assert done.returncode != 0
    assert needle in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_sigint_stops_the_child(tmp_path: Path, no_leftover_children: None) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    proc = subprocess.Popen(devicekit_command("run", "--", sys.executable, "-c", script),
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        child = pid_written(pid_file)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signal.SIGINT
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_forwarded_signal_gives_128_plus_n_for_torchrun() -> None:
    """torchrun exits 1 after a SIGTERM (SignalException); devicekit run reports 128 + 15."""
    import threading

    from devicekit.jobs.allocation import Allocation
    from devicekit.jobs.run import TORCHRUN_ENTRY, RunPlan, execute

    # stands in for torchrun: exits 1 on SIGTERM (TORCHRUN_ENTRY marks the plan distributed)
    script = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(1));"
              " print('up', flush=True); time.sleep(30)")
    argv = [sys.executable, "-c", script, TORCHRUN_ENTRY]
    plan = RunPlan(argv, child_env(), Allocation(nprocs=2, gpus_per_proc=1), [])
    assert plan.distributed
    timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        code = execute(plan)
    finally:
        timer.cancel()
    assert code == 128 + signal.SIGTERM


def test_ranks_orphaned_by_their_launcher_are_stopped(tmp_path: Path) -> None:
    """torchrun starts every rank in a session of its own; if torchrun dies (killed after the
    grace period, OOM killer) its ranks must not outlive devicekit run."""
    from devicekit.jobs.allocation import Allocation
    from devicekit.jobs.run import RunPlan, execute

    pid_file = tmp_path / "rank.pid"
    rank = "import time; time.sleep(60)"
    launcher = ("import os, subprocess, sys, time;"
                f" p = subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True);"
                f" open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(1.5); os._exit(3)")
    plan = RunPlan([sys.executable, "-c", launcher], child_env(), Allocation(nprocs=1, gpus_per_proc=1), [])
    try:
        assert execute(plan) == 3
        orphan = int(pid_file.read_text())
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE
    finally:
        if pid_file.exists():
            with contextlib.suppress(psutil.Error):
                psutil.Process(int(pid_file.read_text())).kill()


def test_child_stops_when_devicekit_run_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    runner = subprocess.Popen(devicekit_command("run", "--", sys.executable, "-c", script),
                              env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    child = None
    try:
        child = psutil.Process(pid_written(pid_file))
        runner.kill()  # SIGKILL: no handler runs; the kernel's parent-death signal must do it
        runner.wait(timeout=10)
        gone, alive = psutil.wait_procs([child], timeout=10)
        assert not alive, "the child outlived devicekit run"
    finally:
        if runner.poll() is None:
            runner.kill()
        if child is not None and child.is_running():
            child.kill()


NODE_SCRIPT = textwrap.dedent(
    """
    import sys, torch, devicekit as dk
    from torch import nn
    device = dk.dist.init(timeout=60)
    facts = dk.dist.env()
    torch.manual_seed(facts.rank)
    model = nn.parallel.DistributedDataParallel(nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(5, 3)
        opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    params = ",".join(f"{v:.8f}" for v in torch.cat([p.detach().flatten() for p in model.parameters()]).tolist())
    open(sys.argv[1] + f"/rank{facts.rank}.txt", "w").write(
        f"{facts.source} {facts.rank} {facts.world_size} {facts.node_rank} {facts.nnodes} {params}")
    dk.dist.destroy()
    """
)


def test_two_nodes_rendezvous_on_loopback(tmp_path: Path, no_leftover_children: None) -> None:
    script = tmp_path / "node.py"
    script.write_text(NODE_SCRIPT)
    port = str(rendezvous_port())  # not an ephemeral port: see rendezvous_port
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = []
    for rank in (0, 1):
        with logs[rank].open("w") as log:  # files, not pipes: nothing to drain, kept on failure
            nodes.append(subprocess.Popen(
                devicekit_command("run", "--procs", "1", "--nnodes", "2", "--node-rank", str(rank),
                                  "--master-addr", "127.0.0.1", "--master-port", port, "--",
                                  sys.executable, str(script), str(tmp_path)),
                env=child_env(), stdout=log, stderr=subprocess.STDOUT,
            ))
    try:
        deadline = time.monotonic() + 120
        for node in nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.send_signal(signal.SIGTERM)  # forwarded to torchrun, which stops its ranks
                try:
                    node.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    node.kill()
                    node.wait()
    outputs = [log.read_text() for log in logs]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert "loopback" in outputs[0]
    lines = [(tmp_path / f"rank{r}.txt").read_text().split() for r in (0, 1)]
    assert lines[0][:5] == ["torchrun", "0", "2", "0", "2"]
    assert lines[1][:5] == ["torchrun", "1", "2", "1", "2"]
    assert lines[0][5] == lines[1][5]  # identical parameters after DDP training


def test_no_command_runs_the_example_on_cpu() -> None:
    done = run_cli(timeout=90, DEVICEKIT_EXAMPLE_SECONDS="0.5")
    assert done.returncode == 0, done.stderr
    assert "device: cpu" in done.stdout
    assert "steps/s" in done.stdout and "peak process memory" in done.stdout
    assert "final loss" in done.stdout
    assert "running on the CPU (1 process)" in done.stderr


def test_ctrl_c_on_a_terminal_stops_every_process(tmp_path: Path, no_leftover_children: None) -> None:
    """On a terminal the command is the foreground group: Ctrl-C reaches it, and run exits 130."""
    import os
    import pty
    import select

    info = tmp_path / "child.txt"
    script = ("import os, time; fg = os.tcgetpgrp(0) == os.getpgrp();"
              f" open({str(info)!r}, 'w').write(f'{{os.getpid()}} {{fg}}'); time.sleep(60)")
    argv = devicekit_command("run", "--", sys.executable, "-c", script)
    env = child_env()
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session leader whose controlling terminal is the pty
        os.execve(argv[0], argv, env)
    output = b""
    status: int | None = None
    try:
        deadline = time.monotonic() + 30
        while not info.exists() or " " not in info.read_text():
            assert time.monotonic() < deadline, "child never started"
            time.sleep(0.05)
        child, foreground = info.read_text().split()
        os.write(fd, b"\x03")  # Ctrl-C typed on the terminal
        deadline = time.monotonic() + 20
        while status is None:
            assert time.monotonic() < deadline, f"devicekit run did not stop: {output!r}"
            done, raw = os.waitpid(pid, os.WNOHANG)
            if done:
                status = raw
            elif select.select([fd], [], [], 0.1)[0]:
                try:
                    output += os.read(fd, 4096)
                except OSError:
                    pass
    finally:
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    assert foreground == "True"  # the command owns the terminal (pdb, input() work)
    assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGINT, output
    assert not psutil.pid_exists(int(child)) or psutil.Process(int(child)).status() == psutil.STATUS_ZOMBIE


def test_omp_threads_set_deliberately_for_several_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.jobs.run import RunRequest, plan_run
    from devicekit.jobs.threads import omp_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)), raising=False)
    plan = plan_run(RunRequest(procs=2, command=["train.py"]), environ={"PATH": "/usr/bin"})
    assert plan.env["OMP_NUM_THREADS"] == "4" == str(omp_threads(2))
    assert [n for n in plan.notes if "OMP_NUM_THREADS" in n] == [
        "OMP_NUM_THREADS=4 (8 usable cores / 2 processes; set OMP_NUM_THREADS to choose)"]
    mine = plan_run(RunRequest(procs=2, command=["train.py"]),
                    environ={"PATH": "/usr/bin", "OMP_NUM_THREADS": "3"})
    assert mine.env["OMP_NUM_THREADS"] == "3"
    assert not any("OMP_NUM_THREADS" in n for n in mine.notes)


def test_no_torchrun_omp_banner_and_the_ranks_get_the_value() -> None:
    env = child_env()
    env.pop("OMP_NUM_THREADS", None)
    # one write() per rank: both ranks share the stdout pipe, and print()'s pieces from two
    # ranks interleaved once in CI ("threadsthreads  11"); a write under PIPE_BUF is atomic
    done = subprocess.run(
        devicekit_command("run", "--procs", "2", "--", sys.executable, "-c",
                          "import os; os.write(1, f\"threads {os.environ['OMP_NUM_THREADS']}\\n\".encode())"),
        env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "Setting OMP_NUM_THREADS" not in done.stderr and "*****" not in done.stderr
    assert done.stderr.count("devicekit run: OMP_NUM_THREADS=") == 1
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert done.stdout.split().count(str(expected)) == 2, done.stdout
