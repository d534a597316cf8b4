"""The hang doctor end to end: gloo ranks under dk.launch and devicekit run that hang, disagree or die.

Each job uses a short ``hang_timeout`` (3 s); the ranks that sleep do so for far longer than
the test waits, so a report that came only from the sleep ending would fail the test. The rank
that starts the hang writes the time it did so, and each report must come within the hang
timeout + 15 s of it (start-up time, which a loaded machine stretches, is not counted).
"""

from __future__ import annotations

import importlib
import inspect
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import devicekit as dk
from tests.ranks import child_env

pytestmark = pytest.mark.slow

#: how long a job may take to be reported: start-up of the ranks on a loaded machine + timeout
BOUND = 150
#: the hang timeout the jobs use, and how soon after a hang began its report must be out
HANG_TIMEOUT = 3
REPORTED_WITHIN = HANG_TIMEOUT + 15


def mark_hang(path: str | None) -> None:
    """Write when this rank started the hang (wall clock: the test reads it in another process)."""
    if path:
        Path(path).write_text(repr(time.time()))


def assert_reported_in_time(mark: Path) -> None:
    late = time.time() - float(mark.read_text())
    assert late < REPORTED_WITHIN, f"reported {late:.1f} s after the hang began"


def stuck_before_fourth(rank_to_stick: int, mark: str | None = None) -> str:
    import torch
    import torch.distributed as tdist

    t = torch.ones(4)
    for step in range(6):
        if step == 3 and tdist.get_rank() == rank_to_stick:
            mark_hang(mark)
            time.sleep(300)
        tdist.all_reduce(t)
    return "done"


LINE_STUCK = stuck_before_fourth.__code__.co_firstlineno + next(
    i for i, line in enumerate(inspect.getsource(stuck_before_fourth).splitlines()) if "sleep(300)" in line)


def skips_one(mark: str) -> str:
    import torch
    import torch.distributed as tdist

    t = torch.ones(4)
    for step in range(3):
        if step == 1 and tdist.get_rank() == 2:
            continue  # rank 2 skips the second all_reduce
        tdist.all_reduce(t)
    if tdist.get_rank() == 2:
        mark_hang(mark)
    time.sleep(300)
    return "done"


def mismatched_ops(mark: str) -> str:
    import torch
    import torch.distributed as tdist

    t = torch.ones(4)
    tdist.all_reduce(t)
    if tdist.get_rank() == 1:
        mark_hang(mark)
        tdist.broadcast(t, 0)
    else:
        tdist.all_reduce(t)
    return "done"


def mismatched_shapes() -> str:
    import torch
    import torch.distributed as tdist

    tdist.all_reduce(torch.ones(4 + tdist.get_rank()))  # gloo aborts a rank on this
    return "done"


def dies() -> str:
    import torch
    import torch.distributed as tdist

    tdist.all_reduce(torch.ones(4))
    if tdist.get_rank() == 1:
        raise ValueError("bad batch")
    tdist.all_reduce(torch.ones(4))
    return "done"


def healthy_with_a_slow_phase() -> float:
    import torch
    import torch.distributed as tdist
    from torch import nn

    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    for step in range(3):
        model(torch.randn(8, 4)).sum().backward()
        if step == 1:
            time.sleep(4)  # every rank computes for longer than the hang timeout: not a hang
    t = torch.ones(1)
    tdist.all_reduce(t)
    return float(t[0])


def test_launch_names_the_stuck_rank_and_its_line(tmp_path: Path, no_leftover_children: None) -> None:
    start = time.monotonic()
    mark = tmp_path / "hang-began"
    with pytest.raises(dk.RankHangError) as info:
        dk.launch(stuck_before_fourth, 1, str(mark), nprocs=2, devices="cpu", hang_timeout=HANG_TIMEOUT)
    assert_reported_in_time(mark)
    assert time.monotonic() - start < BOUND
    err = info.value
    assert err.stuck_ranks == [1]
    assert "rank 0: waits in all_reduce (seq 4)" in err.report
    assert f"test_hang_doctor.py:{LINE_STUCK + 1}" in err.report  # the all_reduce rank 0 waits in
    assert f"rank 1: not in a collective; now at test_hang_doctor.py:{LINE_STUCK} in stuck_before_fourth" in err.report
    assert err.report.splitlines()[-1].startswith("dk.launch: look at rank 1: it never reached all_reduce seq 4")


JOB_IN_A_TORCH_FOLDER = """\
import torch
import torch.distributed as tdist

import stuck_in_a_devicekit_folder


def stuck_before_fourth(rank_to_stick, mark):
    t = torch.ones(4)
    for step in range(6):
        if step == 3 and tdist.get_rank() == rank_to_stick:
            stuck_in_a_devicekit_folder.stick(mark)
        tdist.all_reduce(t)  # the collective rank 0 waits in
    return "done"
"""
STUCK_IN_A_DEVICEKIT_FOLDER = """\
import time
from pathlib import Path


def stick(mark):
    Path(mark).write_text(repr(time.time()))
    time.sleep(300)  # where rank 1 is
"""


def test_a_user_project_in_folders_named_devicekit_and_torch_is_still_the_users_code(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_leftover_children: None) -> None:
    """A clone's folder is named ``devicekit``, a project lives in one named ``torch``: the
    report names the user's lines, not a multiprocessing frame (issue 46, item 1). One job covers
    both: rank 0 waits in a collective called from the ``torch`` folder (the line a collective is
    recorded at), rank 1 is stuck in the ``devicekit`` folder (where a rank is now)."""
    job_dir, helper_dir = tmp_path / "torch", tmp_path / "devicekit"
    for folder, name, text in ((job_dir, "job_in_a_torch_folder", JOB_IN_A_TORCH_FOLDER),
                               (helper_dir, "stuck_in_a_devicekit_folder", STUCK_IN_A_DEVICEKIT_FOLDER)):
        folder.mkdir()
        (folder / f"{name}.py").write_text(text)
        monkeypatch.syspath_prepend(str(folder))  # the spawned ranks get the parent's sys.path
    job = importlib.import_module("job_in_a_torch_folder")
    wait_line = JOB_IN_A_TORCH_FOLDER.splitlines().index(
        "        tdist.all_reduce(t)  # the collective rank 0 waits in") + 1
    stuck_line = STUCK_IN_A_DEVICEKIT_FOLDER.splitlines().index("    time.sleep(300)  # where rank 1 is") + 1
    mark = tmp_path / "hang-began"
    try:
        with pytest.raises(dk.RankHangError) as info:
            dk.launch(job.stuck_before_fourth, 1, str(mark), nprocs=2, devices="cpu", hang_timeout=HANG_TIMEOUT)
    finally:
        sys.modules.pop("job_in_a_torch_folder", None)
        sys.modules.pop("stuck_in_a_devicekit_folder", None)
    report = info.value.report
    assert f"job_in_a_torch_folder.py:{wait_line}" in report, report  # rank 0's all_reduce
    assert f"rank 1: not in a collective; now at stuck_in_a_devicekit_folder.py:{stuck_line} in stick" in report
    advice = report.splitlines()[-1]
    assert advice.startswith("dk.launch: look at rank 1: it never reached all_reduce seq 4"), report
    assert advice.endswith(f"is at stuck_in_a_devicekit_folder.py:{stuck_line} in stick"), report


def test_launch_names_the_rank_that_skipped_a_collective(tmp_path: Path, no_leftover_children: None) -> None:
    mark = tmp_path / "hang-began"
    with pytest.raises(dk.RankHangError) as info:
        dk.launch(skips_one, str(mark), nprocs=3, devices="cpu", hang_timeout=HANG_TIMEOUT)
    assert_reported_in_time(mark)
    err = info.value
    assert err.stuck_ranks == [2]
    assert "rank 0: waits in all_reduce (seq 3)" in err.report
    assert "rank 1: waits in all_reduce (seq 3)" in err.report
    assert "last collective: all_reduce (seq 2)" in err.report  # rank 2 made one fewer


def test_launch_reports_mismatched_collectives(tmp_path: Path, no_leftover_children: None) -> None:
    mark = tmp_path / "hang-began"
    with pytest.raises(dk.RankHangError) as info:
        dk.launch(mismatched_ops, str(mark), nprocs=2, devices="cpu", hang_timeout=HANG_TIMEOUT)
    assert_reported_in_time(mark)
    err = info.value
    assert "mismatch at seq 2: rank 0 all_reduce [[4]] vs rank 1 broadcast [[4]]" in err.report
    assert err.stuck_ranks == [0, 1]


def test_launch_reports_mismatched_shapes_when_gloo_aborts_a_rank(no_leftover_children: None) -> None:
    with pytest.raises((dk.RankFailedError, dk.RankHangError)) as info:
        dk.launch(mismatched_shapes, nprocs=2, devices="cpu", hang_timeout=HANG_TIMEOUT)
    assert "mismatch at seq 1: rank 0 all_reduce [[4]] vs rank 1 all_reduce [[5]]" in str(info.value)


def test_launch_names_a_rank_that_died_as_before(no_leftover_children: None) -> None:
    with pytest.raises(dk.RankFailedError) as info:
        dk.launch(dies, nprocs=2, devices="cpu", hang_timeout=HANG_TIMEOUT)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 of 2 failed: ValueError: bad batch")


def test_launch_healthy_job_with_a_slow_phase_is_not_a_hang(no_leftover_children: None) -> None:
    assert dk.launch(healthy_with_a_slow_phase, nprocs=2, devices="cpu", hang_timeout=2) == [2.0, 2.0]


#: the job under devicekit run; INIT is dk.dist.init's or torch's own (a plain torchrun script)
RUN_SCRIPT = """
import datetime, sys, time, torch, torch.distributed as tdist
import devicekit as dk
INIT
t = torch.ones(4)
for step in range(6):
    if step == 3 and tdist.get_rank() == int(sys.argv[1]):
        open(sys.argv[2], "w").write(repr(time.time()))
        time.sleep(300)
    tdist.all_reduce(t)
tdist.destroy_process_group()
"""
INITS = {
    "dk.dist.init": "dk.dist.init(timeout=120)",
    "init_process_group": 'tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))',
}

#: four ranks, plain torch: rank 3 skips the second all_reduce, then every rank waits
SKIP_SCRIPT = """
import datetime, sys, time, torch, torch.distributed as tdist
tdist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
t = torch.ones(2)
for step in range(3):
    if step == 1 and tdist.get_rank() == 3:
        continue
    tdist.all_reduce(t)
if tdist.get_rank() == 3:
    open(sys.argv[1], "w").write(repr(time.time()))
time.sleep(300)
"""


def run_cli(tmp_path: Path, script_text: str, *args: str, procs: int = 2) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "job.py"
    script.write_text(script_text)
    return subprocess.run(
        [sys.executable, "-m", "devicekit", "run", "--procs", str(procs), "--hang-timeout",
         str(HANG_TIMEOUT), "--log-dir", str(tmp_path / "logs"), "--", str(script), *args],
        env=child_env(), capture_output=True, text=True, timeout=BOUND,
    )


@pytest.mark.parametrize("init", sorted(INITS))
def test_run_reports_the_stuck_rank_exits_124_and_saves_the_dump(
        tmp_path: Path, init: str, no_leftover_children: None) -> None:
    mark = tmp_path / "hang-began"
    done = run_cli(tmp_path, RUN_SCRIPT.replace("INIT", INITS[init]), "1", str(mark))
    assert done.returncode == 124, done.stderr
    assert_reported_in_time(mark)
    assert "rank 0: waits in all_reduce (seq 4) shapes [[4]] float32 at job.py:10" in done.stderr
    assert "rank 1: not in a collective; now at job.py:9 in <module>" in done.stderr
    verdict = [line for line in done.stderr.splitlines() if "look at rank" in line]
    assert verdict == ["devicekit run: look at rank 1: it never reached all_reduce seq 4 that"
                       " rank(s) [0] wait in; it is at job.py:9 in <module>"]
    saved = list((tmp_path / "logs").glob("devicekit-hang-*/hang-report.txt"))
    assert len(saved) == 1
    # a new directory with a random name, only for its owner (tests/security/test_hang_report_files.py)
    assert f"all thread stacks): {saved[0]}" in done.stderr
    assert not saved[0].parent.name.removeprefix("devicekit-hang-").isdigit()
    assert stat.S_IMODE(saved[0].parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(saved[0].stat().st_mode) == 0o600
    text = saved[0].read_text()
    assert "===== rank 1 =====" in text and "job.py" in text
    assert "Thread" in text  # every thread's stack


def test_run_names_which_of_four_plain_torch_ranks_skipped_a_collective(
        tmp_path: Path, no_leftover_children: None) -> None:
    mark = tmp_path / "hang-began"
    done = run_cli(tmp_path, SKIP_SCRIPT, str(mark), procs=4)
    assert done.returncode == 124, done.stderr
    assert_reported_in_time(mark)
    for rank in (0, 1, 2):
        assert f"rank {rank}: waits in all_reduce (seq 3)" in done.stderr
    assert "last collective: all_reduce (seq 2)" in done.stderr
    verdict = [line for line in done.stderr.splitlines() if "look at rank" in line]
    assert len(verdict) == 1 and verdict[0].startswith("devicekit run: look at rank 3:"), done.stderr


def test_run_healthy_job_has_no_report(tmp_path: Path, no_leftover_children: None) -> None:
    done = run_cli(tmp_path, RUN_SCRIPT.replace("INIT", INITS["init_process_group"]), "-1",
                   str(tmp_path / "unused"))
    assert done.returncode == 0, done.stderr
    assert "hang report" not in done.stderr
    assert not list((tmp_path / "logs").glob("devicekit-hang-*"))
