"""A lease directory another (non-root) user owns is refused everywhere, even at mode 1777.

Its owner could delete everyone's lease files and take their GPUs while their jobs run: the
attack this file replays is exactly that, and it must end with no GPU held twice.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.errors import LeaseError
from tests.conftest import h100
from tests.security.conftest import OTHER_UID, needs_root, src_env

pytestmark = needs_root


@pytest.fixture
def foreign_dir(monkeypatch):
    """A mode-1777 lease directory made first by the unprivileged user ``nobody``."""
    base = Path(tempfile.mkdtemp(prefix="devicekit-foreign-", dir="/tmp"))
    os.chmod(base, 0o755)
    directory = base / "leases"
    directory.mkdir()
    os.chmod(directory, 0o1777)
    os.chown(directory, OTHER_UID, OTHER_UID)  # as if nobody had leased first
    assert os.stat(directory).st_uid == OTHER_UID
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(directory))
    yield directory
    subprocess.run(["rm", "-rf", str(base)], check=False, timeout=30)


def _owner() -> str:
    import pwd

    return pwd.getpwuid(OTHER_UID).pw_name


def test_select_gpus_refuses_it_naming_owner_and_fix(foreign_dir, simulate):
    simulate([h100(), h100()])
    with pytest.raises(LeaseError) as info:
        dk.select_gpus(1)
    message = str(info.value)
    assert _owner() in message and "sudo install -d -m 1777" in message
    assert "DEVICEKIT_LEASE_DIR" in message and "\n" not in message


def test_cli_run_select_refuse_and_doctor_fails(foreign_dir, simulate, run_cli):
    path = simulate([h100(), h100()])
    env = src_env(DEVICEKIT_SIMULATE=str(path), DEVICEKIT_LEASE_DIR=str(foreign_dir))
    for args in (["select"], ["run", "--", "true"]):
        done = run_cli(*args, env=env)
        assert done.returncode != 0, args
        assert done.stdout == ""
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and _owner() in lines[0] and "Traceback" not in done.stderr, lines
    doctor = run_cli("doctor", "--json", env=env)
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["lease_dir"]["status"] == "fail" and _owner() in checks["lease_dir"]["message"]


ATTACK = """
import os, sys, time
from devicekit.sharing.leases import Lease, lease_dir
os.setgroups([]); os.setgid(65534); os.setuid(65534)
taken = []
for name in os.listdir(lease_dir()):       # the owner deletes every lease file ...
    if name.endswith(".lease"):
        os.unlink(lease_dir() / name)
        taken.append(name)
try:                                        # ... and takes the victim's GPU
    Lease.acquire(["GPU-victim"])
    print("taken", flush=True)
except Exception as exc:
    print("refused", type(exc).__name__, flush=True)
"""


def test_owner_cannot_double_book_a_victims_gpu(foreign_dir):
    """Today's victim never gets a lease there, so the owner's attack finds nothing to steal."""
    from devicekit.sharing.leases import Lease

    with pytest.raises(LeaseError, match="owned by"):
        Lease.acquire(["GPU-victim"])
    done = subprocess.run([sys.executable, "-c", ATTACK], env=src_env(), capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == "taken"  # the owner leases freely in their own directory ...
    with pytest.raises(LeaseError):        # ... and the victim is still refused: no double hold
        Lease.acquire(["GPU-victim"])


def test_root_owned_shared_directory_still_works(shared_dir, monkeypatch):
    from devicekit.sharing.leases import Lease, read_leases

    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(shared_dir))
    with Lease.acquire(["GPU-x"]):
        assert [r.gpu_uuid for r in read_leases()] == ["GPU-x"]
