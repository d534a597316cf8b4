"""Leases carry a job id: ``devicekit run --name NAME`` (else a generated one), handed to the
job's processes as ``DEVICEKIT_JOB_ID``, shown by ``status`` (table and JSON)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.cli.main import main
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.lease_records import JOB_ENV, check_job_name, current_job, read_leases
from devicekit.sharing.leases import Lease
from tests.conftest import h100

SRC = str(Path(dk.__file__).parents[1])
#: the job's command: what it sees of its own job id and of its leases
PROBE = ("import os; from devicekit.sharing.lease_records import read_leases; "
         "print(os.environ.get('DEVICEKIT_JOB_ID'), [r.job for r in read_leases()])")


def run_job(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=SRC)
    env.pop(JOB_ENV, None)
    return subprocess.run([sys.executable, "-m", "devicekit", "run", *args, "--",
                           sys.executable, "-c", PROBE], env=env, capture_output=True,
                          text=True, timeout=120)


def test_run_name_is_the_leases_job_and_the_jobs_variable(simulate):
    simulate([h100(), h100()])
    done = run_job("--name", "bert-lr3e-4", "--gpus", "2", "--procs", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bert-lr3e-4 ['bert-lr3e-4', 'bert-lr3e-4']"


def test_run_without_a_name_generates_one(simulate):
    simulate([h100()])
    done = run_job("--gpus", "1")
    assert done.returncode == 0, done.stderr
    job, jobs = done.stdout.strip().split(" ", 1)
    assert len(job) == 6 and int(job, 16) >= 0 and jobs == f"['{job}']"


@pytest.mark.parametrize("name", ["two words", "-x", "a" * 65, "semi;colon", "\x1b[2J",
                                  "trailing\n"])
def test_a_bad_name_is_one_line(simulate, capsys, name):
    simulate([h100()])
    with pytest.raises(SystemExit) as done:
        main(["run", "--name", name, "--dry-run", "--", "true"])
    out, err = capsys.readouterr()
    assert done.value.code == 1 and out == "" and err.count("\n") == 1, err
    assert "--name" in err and "\x1b" not in err
    assert JOB_ENV not in os.environ and not read_leases()


def test_lease_files_carry_the_job_bounded(simulate, capsys, monkeypatch):
    gpus = simulate([h100(), h100()]) and dk.gpus()
    assert check_job_name("nightly.eval-2") == "nightly.eval-2"
    monkeypatch.delenv(JOB_ENV, raising=False)
    assert current_job() == current_job() and len(current_job()) == 6
    monkeypatch.setenv(JOB_ENV, "from-env")
    assert current_job() == "from-env"
    with Lease.acquire([gpus[0].uuid], job="eval-7"), Lease.acquire([gpus[1].uuid]):
        assert sorted(r.job for r in read_leases()) == ["eval-7", "from-env"]
        with pytest.raises(SystemExit):
            main(["status", "--json"])
        doc = json.loads(capsys.readouterr().out)
        assert [g["leases"][0]["job"] for g in doc["gpus"]] == ["eval-7", "from-env"]
        with pytest.raises(SystemExit):
            main(["status"])
        out = capsys.readouterr().out
        assert "Job" in out and "eval-7" in out and "from-env" in out
    # another user's lease file says anything: a job id is kept only in run --name's format
    # (or a Slurm job id); any other makes the file ignored, with the reason
    from devicekit.hardware.document_fields import BadDocument
    from devicekit.sharing.lease_records import _read_record

    path = lease_dir() / f"{gpus[0].uuid}.1.x.lease"
    record = {"gpu_uuid": gpus[0].uuid, "pid": 1, "host": "h", "command": "c", "since": 1.0,
              "memory": None, "share": False}
    for job in ("812", "812_3", "a1b2c3", "eval-7"):
        path.write_text(json.dumps({**record, "job": job}))
        assert _read_record(path, path.stat()).job == job
    for job, why in ((123, "Expected `str | null`, got `int`"), ("j" * 500, "matching regex"),
                     ("\x1b[2J", "matching regex")):
        path.write_text(json.dumps({**record, "job": job}))
        with pytest.raises(BadDocument, match=re.escape(why) if "`" in why else why):
            _read_record(path, path.stat())
