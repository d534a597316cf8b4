"""Lock files another user squats (a directory, a FIFO, a symlink, a mode-000 file) are visible:
``status`` marks the GPU blocked and names the owner, ``doctor`` warns with the path, and
``select`` never offers a GPU that ``run`` refuses."""

from __future__ import annotations

import json
import os

import pytest

from devicekit.sharing.device_locks import lock_path
from devicekit.sharing.lease_directory import lease_dir
from tests.conftest import h100
from tests.security.conftest import OTHER_UID, needs_root, src_env


def _squat(how: str, uuid: str) -> None:
    path = lock_path(lease_dir(), uuid)
    if how == "directory":
        path.mkdir()
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "symlink":
        os.symlink("/etc/hostname", path)
    else:  # a file nobody else may open
        path.touch(mode=0o000)
        path.chmod(0o000)
    os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)


@needs_root
@pytest.mark.parametrize("how", ["directory", "fifo", "symlink", "mode-000"])
def test_squatted_gpu_is_blocked_in_status_doctor_and_select(how, simulate, run_cli):
    path = simulate([h100(uuid="GPU-a"), h100(uuid="GPU-b", used="10GiB")])
    _squat(how, "GPU-a")
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=str(lease_dir()))
    if how == "mode-000":  # root opens any file: the user who is refused is another one
        pytest.skip("root can open a mode-000 file; covered for a second user below")
    status = run_cli("status", "--json", env=env)
    doc = json.loads(status.stdout)
    blocked = {g["uuid"]: g["blocked"] for g in doc["gpus"]}
    assert blocked["GPU-b"] is None and "nobody" in blocked["GPU-a"]
    assert any("GPU 0 is blocked" in w and "nobody" in w for w in doc["warnings"])
    refused = run_cli("select", "-n", "2", env=env)
    assert refused.returncode == 3 and "blocked" in refused.stderr
    if how != "directory":
        return  # the rest is the same for every kind of squatting
    table = run_cli("status", env=env).stdout
    assert "blocked" in table and "nobody" in table
    doctor = json.loads(run_cli("doctor", "--json", env=env).stdout)
    check = {c["name"]: c for c in doctor["checks"]}["lease_dir"]
    assert check["status"] == "warn" and "GPU-a.hold" in check["message"]
    chosen = run_cli("select", env=env)  # GPU-a has more free memory but is blocked
    assert chosen.returncode == 0 and chosen.stdout.strip() == "GPU-b", chosen.stderr
    assert "blocked" in chosen.stderr


MODE_000 = """
import json, os, sys
from devicekit.sharing.lock_squatting import blocked_devices
from pathlib import Path
os.setgroups([]); os.setgid(65534); os.setuid(65534)
print(json.dumps(blocked_devices(Path(sys.argv[1]), ["GPU-a", "GPU-b"])))
"""


@needs_root
def test_mode_000_lock_file_blocks_for_another_user(shared_dir):
    import subprocess
    import sys

    path = lock_path(shared_dir, "GPU-a")
    path.touch()
    path.chmod(0o000)
    done = subprocess.run([sys.executable, "-c", MODE_000, str(shared_dir)], env=src_env(),
                          capture_output=True, text=True, timeout=60)
    found = json.loads(done.stdout)
    assert list(found) == ["GPU-a"] and "Permission denied" in found["GPU-a"]
    assert "root" in found["GPU-a"]  # the owner is named


def test_unsquatted_directory_reports_nothing(simulate, run_cli):
    path = simulate([h100(uuid="GPU-a")])
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=str(lease_dir()))
    doc = json.loads(run_cli("status", "--json", env=env).stdout)
    assert doc["gpus"][0]["blocked"] is None and doc["warnings"] == []
