"""A job stopped with Ctrl-Z / SIGSTOP holds its GPUs: ``status`` says so, and since when."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import h100
from tests.security.conftest import src_env
from tests.security.test_process_tree import _alive, _pids

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


def _status(run_cli, env):
    done = run_cli("status", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _leases(doc):
    return [lease for g in doc["gpus"] for lease in g["leases"]]


def test_stopped_job_is_reported_with_its_start(simulate, tmp_path, run_cli):
    path = simulate([h100(uuid="GPU-a")])
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"])
    shell = tmp_path / "shell.pid"
    run = subprocess.Popen([sys.executable, "-m", "devicekit", "run", "--", "sh", "-c",
                            f"echo $$ > {shell}; sleep 60 & wait"],
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        (pid,) = _pids([shell])
        assert [lease["stopped_since"] for lease in _leases(_status(run_cli, env))] == [None]
        before = time.time()
        os.killpg(pid, signal.SIGSTOP)  # what Ctrl-Z does: the command's group, not run
        time.sleep(1.0)  # run's supervision loop looks every 0.2 s
        doc = _status(run_cli, env)
        (lease,) = _leases(doc)
        assert lease["stopped_since"] is not None
        assert before - 1 <= lease["stopped_since"] <= time.time()
        assert any("is stopped since" in w and "kill -CONT" in w for w in doc["warnings"])
        table = run_cli("status", env=env).stdout
        assert "stopped" in table
        os.killpg(pid, signal.SIGCONT)
        time.sleep(0.5)
        assert [lease["stopped_since"] for lease in _leases(_status(run_cli, env))] == [None]
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(timeout=60)
    assert not _alive(pid)
