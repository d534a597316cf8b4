"""devicekit run's start-up hook: a plain-torch rank records its collectives, nothing else changes.

``src/devicekit/parallel/boot`` leads a rank's PYTHONPATH under ``devicekit run``; its
``sitecustomize`` wraps torch's ``init_process_group``. These tests run one-rank gloo groups in
subprocesses with that directory on the path, as devicekit run sets it up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from devicekit.parallel import boot, collective_log
from tests.ranks import child_env

PLAIN = textwrap.dedent(
    """
    import datetime, json, os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=42))
    t = torch.ones(3)
    dist.all_reduce(t)
    from devicekit.parallel import collective_log
    print(json.dumps({"records": collective_log.records(),
                      "timeout": collective_log._state.timeout if collective_log._state else None,
                      "fr": os.environ.get("TORCH_FR_BUFFER_SIZE"),
                      "modules": sorted(m for m in sys.modules if m == "sitecustomize")}))
    dist.destroy_process_group()
    """
)


def run(tmp_path: Path, script: str, pythonpath: list[str], **extra: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "job.py"
    path.write_text(script)
    env = child_env(**extra)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, env["PYTHONPATH"]])
    return subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)


def test_a_plain_torch_rank_records_its_collectives(tmp_path: Path) -> None:
    hang_dir = tmp_path / "hang"
    hang_dir.mkdir()
    done = run(tmp_path, PLAIN, [boot.DIRECTORY], DEVICEKIT_HANG_DIR=str(hang_dir),
               DEVICEKIT_FLIGHT_RECORDER="256")
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    [entry] = facts["records"]
    assert (entry["op"], entry["seq"], entry["shapes"], entry["state"]) == ("all_reduce", 1, [[3]], "completed")
    assert entry["where"].endswith("job.py:6")  # the user's line, not torch's or the hook's
    assert facts["timeout"] == 42.0  # the group's own timeout: the watch stays below it
    assert facts["fr"] is None  # gloo: no Flight Recorder (it costs several percent there)
    assert (hang_dir / "rank0.pid").read_text().strip().isdigit()


def test_without_the_hang_directory_the_hook_does_nothing(tmp_path: Path) -> None:
    done = run(tmp_path, PLAIN, [boot.DIRECTORY])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["records"] == []


def test_a_sitecustomize_of_the_environment_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text(
        "import os\nopen(os.environ['MARKER'], 'w').write('ran')\n")
    hang_dir = tmp_path / "hang"
    hang_dir.mkdir()
    marker = tmp_path / "marker"
    done = run(tmp_path, PLAIN, [boot.DIRECTORY, str(theirs)], DEVICEKIT_HANG_DIR=str(hang_dir),
               MARKER=str(marker))
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "ran"
    assert len(json.loads(done.stdout.strip().splitlines()[-1])["records"]) == 1


@pytest.mark.parametrize(("backend", "env", "expected"), [
    ("nccl", {"DEVICEKIT_FLIGHT_RECORDER": "256"}, "256"),
    ("cpu:gloo,cuda:nccl", {"DEVICEKIT_FLIGHT_RECORDER": "64"}, "64"),
    ("gloo", {"DEVICEKIT_FLIGHT_RECORDER": "256"}, None),
    ("nccl", {}, None),  # the launcher did not ask
    ("nccl", {"DEVICEKIT_FLIGHT_RECORDER": "256", "TORCH_FR_BUFFER_SIZE": "2000"}, "2000"),  # the user's
    ("nccl", {"DEVICEKIT_FLIGHT_RECORDER": "lots"}, None),
])
def test_flight_recorder_only_on_nccl_groups_and_never_over_the_users_choice(
        monkeypatch: pytest.MonkeyPatch, backend: str, env: dict[str, str], expected: str | None) -> None:
    for name in ("DEVICEKIT_FLIGHT_RECORDER", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    collective_log.flight_recorder_for(backend)
    assert os.environ.get("TORCH_FR_BUFFER_SIZE") == expected


def test_group_timeout_reads_the_given_one_or_torchs_default() -> None:
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    assert collective_log.group_timeout(timedelta(seconds=90)) == 90.0
    assert collective_log.group_timeout(15) == 15.0
    assert collective_log.group_timeout(None, "gloo") == c10d.default_pg_timeout.total_seconds()
