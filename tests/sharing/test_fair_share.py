"""Fair share: recent GPU-hours per user, decayed with a half-life, order waiting users."""

from __future__ import annotations

import os
import pwd
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devicekit.hardware.inventory import gpus
from devicekit.selection.choose import select_gpus
from devicekit.sharing.fair_share import factors, read_usage, record_usage
from devicekit.sharing.lease_directory import lease_dir, user_name
from devicekit.sharing.leases import read_leases
from devicekit.sharing.queue_state import look
from devicekit.sharing.tickets import Ticket
from tests.conftest import h100

WEEK = 7 * 86400.0


def test_usage_decays_with_the_half_life_and_lowers_the_factor() -> None:
    directory = lease_dir()
    me = user_name(os.geteuid())
    record_usage(directory, 10.0, WEEK)
    now = read_usage(directory, WEEK)[me]
    assert 9.99 < now <= 10.0
    later = read_usage(directory, WEEK, now=time.time() + WEEK)[me]
    assert 4.99 < later <= 5.0
    shares = factors(directory, ["someone-else"], WEEK)
    assert shares["someone-else"] == 1.0 and shares[me] == pytest.approx(0.25)


def test_a_usage_file_named_for_another_uid_is_ignored() -> None:
    directory = lease_dir()
    (directory / "usage.4242.json").write_text('{"gpu_hours": 0, "at": 0}')  # owned by us
    assert user_name(4242) not in read_usage(directory, WEEK)


def test_released_selection_adds_its_gpu_hours(simulate: Callable[..., Path]) -> None:
    simulate([h100(uuid="GPU-0")])
    directory = lease_dir()
    (directory / "policy.toml").write_text('fair_share_half_life = "7d"\n')
    with select_gpus(1):
        pass
    assert user_name(os.geteuid()) in read_usage(directory, WEEK)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_a_light_user_goes_before_a_heavy_one(simulate: Callable[..., Path]) -> None:
    simulate([h100(uuid="GPU-0")])
    directory = lease_dir()
    (directory / "policy.toml").write_text('fair_share_half_life = "7d"\n')
    record_usage(directory, 50.0, WEEK)  # we (root) used the GPU a lot this week
    fields = {"count": 1, "candidates": ["GPU-0"], "command": "python x.py"}
    with select_gpus(1):  # the GPU is busy: both wait
        heavy = Ticket.take(directory, fields)
        light = Ticket.take(directory, fields)
        os.chown(light.path, pwd.getpwnam("nobody").pw_uid, -1)
        try:
            view = look(directory, gpus(), read_leases())
            assert [e.record.ticket for e in view.waiting] == [light.ticket, heavy.ticket]
            (directory / "policy.toml").write_text("")  # without fair share: arrival order
            view = look(directory, gpus(), read_leases())
            assert [e.record.ticket for e in view.waiting] == [heavy.ticket, light.ticket]
        finally:
            heavy.close()
            light.close()
