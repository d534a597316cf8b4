"""Launcher errors are one line, before any GPU is leased or torchrun started."""

from __future__ import annotations

import os

import pytest

from tests.conftest import h100
from tests.security.conftest import src_env


@pytest.mark.parametrize(("args", "code", "needle"), [
    (["--procs", "2", "--", "nosuchcmd"], 127, "cannot start 'nosuchcmd': command not found"),
    (["--gpus", "2", "--", "nosuchcmd"], 127, "cannot start 'nosuchcmd'"),
    (["--", "./not-here.sh"], 127, "not an executable file"),
    (["--procs", "2", "--", "missing_train.py"], 127, "no such file"),
    (["--procs", "2", "--rdzv-id", "--", "true"], 1, "--rdzv-id needs a value, got '--'"),
    (["--procs", "2", "--rdzv-id=", "--", "true"], 1, "--rdzv-id needs a value"),
    (["--procs", "2", "--rdzv-endpoint", "--standalone", "--", "true"], 1, "--rdzv-endpoint needs"),
])
def test_one_line_no_lease_no_torchrun(args, code, needle, simulate, run_cli, tmp_path):
    path = simulate([h100(), h100()])
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=os.environ["DEVICEKIT_LEASE_DIR"])
    done = run_cli("run", *args, env=env, cwd=tmp_path)
    assert done.returncode == code
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], done.stderr
    assert "leased" not in done.stderr and "torchrun" not in done.stderr
