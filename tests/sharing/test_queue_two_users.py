"""Quota with two users: one beyond its quota waits with reason ``Quota`` while the other starts.

The second user is ``nobody``: as root, the test gives a ticket file to nobody (a ticket's user
is its file's owner), so it needs root and skips without.
"""

from __future__ import annotations

import multiprocessing
import os
import pwd
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devicekit.hardware.inventory import gpus
from devicekit.selection.choose import select_gpus
from devicekit.sharing.lease_directory import lease_dir, user_name
from devicekit.sharing.leases import read_leases
from devicekit.sharing.queue_state import look
from devicekit.sharing.tickets import Ticket, read_tickets
from tests.conftest import h100

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")


def _wait_for_one(done: str) -> None:
    sel = select_gpus(1, wait=60, poll_interval=0.2, progress=False)
    Path(done).write_text(",".join(g.uuid for g in sel.gpus))
    sel.release()
    os._exit(0)


def test_over_quota_user_waits_while_another_users_job_starts(
        simulate: Callable[..., Path], tmp_path: Path) -> None:
    simulate([h100(uuid=f"GPU-{i}") for i in range(3)])
    directory = lease_dir()
    (directory / "policy.toml").write_text("max_gpus_per_user = 1\n")
    me = user_name(os.geteuid())
    nobody = pwd.getpwnam("nobody").pw_uid
    with select_gpus(1):  # root holds its 1 GPU: its next job is over quota
        child = multiprocessing.get_context("fork").Process(
            target=_wait_for_one, args=(str(tmp_path / "done"),))
        child.start()
        other = None
        try:
            deadline = time.monotonic() + 30
            while not any(t.pid == child.pid for t in read_tickets(directory, cleanup=False)):
                assert time.monotonic() < deadline and child.is_alive(), "root's job never queued"
                time.sleep(0.05)
            other = Ticket.take(directory, {"count": 1, "candidates": ["GPU-0", "GPU-1", "GPU-2"],
                                            "command": "python bob.py"})
            os.chown(other.path, nobody, -1)  # now the ticket of another user
            view = look(directory, gpus(), read_leases())
            reasons = {e.record.user: e.decision for e in view.waiting}
            assert reasons[me].reason == f"Quota: {me} uses 1 of 1 GPU(s), asks 1"
            assert reasons[me].reserved == ()
            assert len(reasons["nobody"].grant) == 1  # the other user's job starts
            assert not (tmp_path / "done").exists()
        finally:
            if other is not None:
                other.close()
            child.kill()
            child.join(10)
