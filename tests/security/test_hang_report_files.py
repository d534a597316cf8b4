"""The hang report in a directory other users can write (``devicekit run --log-dir /tmp/logs``).

The attack: the report used to go to ``DIR/devicekit-hang-<unix time>/hang-report.txt``, the
directory made with ``makedirs(exist_ok=True)`` and the file opened with ``open(path, "w")``.
Bob pre-created those directories for the next minutes with ``hang-report.txt`` a symlink to
alice's file; alice's job hung, her file was overwritten with the report, and bob could read
every stack in it. Now the report goes into a new directory with a random name, mode 0700, and
the file is created new (``O_EXCL | O_NOFOLLOW``), mode 0600.

The report is written by calling :meth:`RunDoctor.report_and_stop` directly (the ranks' answers
replaced by a canned report, the "job" a ``sleep`` in its own process group), not by making a
real job hang; ``tests/jobs/test_hang_doctor.py`` checks the same through ``devicekit run``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from devicekit.jobs import run_doctor
from devicekit.jobs.hang_report import HangReport, save
from devicekit.jobs.private_files import create_private_file, private_directory
from devicekit.jobs.run_doctor import TORCH_DUMP_ENVS, RunDoctor
from tests.security.conftest import OTHER_UID, needs_root, src_env

SECRET = "/home/alice/secret-project/train.py"


def _report() -> HangReport:
    report = HangReport(lines=["devicekit run: hang report (2 ranks)",
                               "  rank 0: waits in all_reduce (seq 4) at train.py:9",
                               "devicekit run: look at rank 1: it never reached all_reduce seq 4"],
                        culprits=[1], answered=True)
    report.answers = {rank: {"answered": True, "records": [],
                             "stack_text": f'Thread 0x1 (most recent call first):\n  File "{SECRET}", line 9'}
                      for rank in (0, 1)}
    return report


@pytest.fixture
def doctor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunDoctor]:
    """A hang doctor whose ranks' directory is ``tmp_path/ranks``; ``log_dir`` set by the test."""
    monkeypatch.setattr(run_doctor, "diagnose", lambda directory, ranks: _report())
    ranks = tmp_path / "ranks"
    ranks.mkdir(mode=0o700)
    yield RunDoctor(str(ranks), [0, 1], 5.0, None)


def _hang(doctor: RunDoctor, capsys: pytest.CaptureFixture[str]) -> tuple[Path | None, str]:
    """Report a hang of a stand-in job; (the path the message names, stderr)."""
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        doctor.report_and_stop(job.pid)
        assert job.wait(timeout=10) == -signal.SIGTERM  # the job is stopped, whatever the save did
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    err = capsys.readouterr().err
    named = [line.rsplit(": ", 1)[1] for line in err.splitlines() if "full dump" in line]
    return (Path(named[0]) if named else None), err


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_report_goes_to_a_new_private_directory_every_time(doctor, tmp_path, capsys) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    logs.chmod(0o1777)  # as /tmp: anyone may create names here
    doctor.log_dir = str(logs)
    old_umask = os.umask(0)  # the modes do not depend on the user's umask
    try:
        first, err = _hang(doctor, capsys)
        doctor.stopped = False
        second, _ = _hang(doctor, capsys)
    finally:
        os.umask(old_umask)
    assert first is not None and second is not None, err
    assert first.parent.parent == logs and first.name == "hang-report.txt"
    assert re.fullmatch(r"devicekit-hang-[a-z0-9_]{8}", first.parent.name), first  # not the time
    assert first.parent != second.parent  # never reused
    assert _mode(first.parent) == 0o700 and _mode(first) == 0o600
    assert os.lstat(first).st_uid == os.geteuid()
    assert SECRET in first.read_text() and "look at rank 1" in first.read_text()
    assert doctor.close() is True
    assert not Path(doctor.directory).exists()  # saved under --log-dir: ours is removed


def test_no_log_dir_keeps_the_report_in_the_private_directory(doctor, capsys) -> None:
    path, err = _hang(doctor, capsys)
    assert path == Path(doctor.directory, "hang-report.txt"), err
    assert _mode(path) == 0o600
    assert doctor.close() is True and path.exists()


def test_missing_log_dir_falls_back_to_the_private_directory(doctor, tmp_path, capsys) -> None:
    doctor.log_dir = str(tmp_path / "gone")
    path, err = _hang(doctor, capsys)
    assert "cannot save the hang report under --log-dir" in err and str(tmp_path / "gone") in err
    assert path == Path(doctor.directory, "hang-report.txt")
    assert doctor.close() is True and path.exists()  # kept: the report is there


def test_a_planted_name_is_never_followed_or_reused(tmp_path) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("alice's notes\n")
    trap = tmp_path / "trap"
    trap.mkdir()
    (trap / "hang-report.txt").symlink_to(victim)
    with pytest.raises(FileExistsError):
        save(_report(), _report().answers, str(trap))
    (trap / "hang-report.txt").unlink()
    (trap / "hang-report.txt").write_text("someone else's\n")
    with pytest.raises(FileExistsError):
        create_private_file(str(trap), "hang-report.txt")
    assert (trap / "hang-report.txt").read_text() == "someone else's\n"
    (tmp_path / "linked").symlink_to(trap)  # the directory itself a symlink
    with pytest.raises(OSError):
        create_private_file(str(tmp_path / "linked"), "other.txt")
    assert victim.read_text() == "alice's notes\n"
    with pytest.raises(ValueError, match="not a plain file name"):
        create_private_file(str(trap), "../escape.txt")
    fresh = private_directory(str(tmp_path), "devicekit-hang-")
    assert _mode(Path(fresh)) == 0o700 and fresh != private_directory(str(tmp_path), "devicekit-hang-")


def test_torch_flight_recorder_dumps_go_to_the_private_directory(capsys) -> None:
    plan = SimpleNamespace(distributed=True, hang_timeout=5.0, env={}, argv=[], log_dir=None,
                           allocation=SimpleNamespace(nprocs=2))
    doctor = RunDoctor.for_plan(plan)
    assert doctor is not None
    try:
        for name in TORCH_DUMP_ENVS:  # not torch's default /tmp/nccl_trace_rank_<N>
            assert plan.env[name] == os.path.join(doctor.directory, "nccl_trace_rank_")
        Path(plan.env[TORCH_DUMP_ENVS[0]] + "0").write_text("{}")  # torch dumped on a timeout
        assert doctor.close() is False
        assert "nccl_trace_rank_0" in capsys.readouterr().err
        assert Path(doctor.directory, "nccl_trace_rank_0").exists()  # kept for the user
    finally:
        shutil.rmtree(doctor.directory, ignore_errors=True)
    own = SimpleNamespace(distributed=True, hang_timeout=5.0, argv=[], log_dir=None,
                          env={"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/scratch/me/fr_"},
                          allocation=SimpleNamespace(nprocs=2))
    doctor = RunDoctor.for_plan(own)
    assert doctor is not None
    doctor.close()
    assert own.env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/scratch/me/fr_"  # the user's choice
    assert "TORCH_FR_DUMP_TEMP_FILE" not in own.env
    assert not Path(doctor.directory).exists()


BOB_PLANTS = """
import json, os, sys, time
os.setgroups([]); os.setgid(UID); os.setuid(UID)
shared, victim = sys.argv[1], sys.argv[2]
now = int(time.time())
for t in range(now - 5, now + 150):  # the names the old code would have used
    d = os.path.join(shared, f"devicekit-hang-{t}")
    os.mkdir(d)
    os.chmod(d, 0o777)
    os.symlink(victim, os.path.join(d, "hang-report.txt"))
print("planted", flush=True)
""".replace("UID", str(OTHER_UID))

BOB_READS = """
import json, os, sys
os.setgroups([]); os.setgid(UID); os.setuid(UID)
found = {}
for what, call in (("read", lambda: open(sys.argv[1]).read()),
                   ("list", lambda: os.listdir(os.path.dirname(sys.argv[1])))):
    try:
        call()
        found[what] = "allowed"
    except OSError as exc:
        found[what] = type(exc).__name__
print(json.dumps(found))
""".replace("UID", str(OTHER_UID))


@needs_root
def test_bobs_planted_symlinks_and_directories_are_not_used(doctor, shared_dir, tmp_path, capsys) -> None:
    victim = tmp_path / "victim.txt"  # alice's ~/victim.txt
    victim.write_text("alice's notes\n")
    planted = subprocess.run([sys.executable, "-c", BOB_PLANTS, str(shared_dir), str(victim)],
                             env=src_env(), capture_output=True, text=True, timeout=60)
    assert planted.stdout.strip() == "planted", planted.stderr
    doctor.log_dir = str(shared_dir)
    path, err = _hang(doctor, capsys)
    assert victim.read_text() == "alice's notes\n"  # untouched
    assert path is not None, err
    assert path.parent.parent == shared_dir
    assert not re.fullmatch(r"devicekit-hang-\d+", path.parent.name)  # none of bob's directories
    info = os.lstat(path.parent)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert os.lstat(path).st_uid == os.geteuid() and _mode(path) == 0o600
    assert stat.S_ISREG(os.lstat(path).st_mode) and SECRET in path.read_text()
    assert str(path) in err  # the message names the new path
    traps = [d for d in shared_dir.iterdir() if re.fullmatch(r"devicekit-hang-\d+", d.name)]
    assert len(traps) == 155
    for bobs in traps:  # bob's traps hold only his symlinks
        assert [p.name for p in bobs.iterdir()] == ["hang-report.txt"]
        assert (bobs / "hang-report.txt").is_symlink()
    tried = subprocess.run([sys.executable, "-c", BOB_READS, str(path)], env=src_env(),
                           capture_output=True, text=True, timeout=60)
    assert json.loads(tried.stdout) == {"read": "PermissionError", "list": "PermissionError"}, tried.stderr
