"""The queue read from the lease directory: filters decide what a ticket can use and reserve."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import devicekit as dk
from devicekit.hardware.inventory import gpus
from devicekit.selection.choose import select_gpus
from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.leases import read_leases
from devicekit.sharing.queue_state import look
from devicekit.sharing.tickets import Ticket
from tests.conftest import h100


def test_a_filtered_ticket_reserves_only_gpus_it_can_use(simulate: Callable[..., Path]) -> None:
    simulate([h100(uuid="GPU-0"), h100(used="70GiB", uuid="GPU-1")])
    directory = lease_dir()
    both = ["GPU-0", "GPU-1"]
    with select_gpus(1, exclude=["GPU-1"]):  # GPU 0 busy; GPU 1 free with 10 GiB
        big = Ticket.take(directory, {"count": 1, "candidates": both, "min_free": 40 * 2**30,
                                      "filters": "--min-free 40 GiB", "command": "a"})
        any_gpu = Ticket.take(directory, {"count": 1, "candidates": both, "command": "b"})
        two = Ticket.take(directory, {"count": 2, "candidates": both, "min_free": 40 * 2**30,
                                      "command": "c"})
        try:
            view = look(directory, gpus(), read_leases())
            d = {e.record.ticket: e.decision for e in view.waiting}
            assert d[big.ticket].reserved == () and d[big.ticket].reason.startswith("Busy: GPU 0")
            assert d[any_gpu.ticket].grant == ("GPU-1",)  # nobody earlier can use it
            assert d[two.ticket].reason == "Filter: no 2 GPU(s) with 40 GiB free"
            assert view.to_dict()["waiting"][0]["filters"] == "--min-free 40 GiB"
        finally:
            for t in (big, any_gpu, two):
                t.close()


def test_a_view_is_of_one_moment_even_when_a_lease_is_taken_while_it_reads(simulate, monkeypatch):
    """status, queue and serve read leases and tickets at one moment: a lease taken between the
    two reads (here, while the tickets are read) makes the look start again."""
    from devicekit.sharing import queue_state
    from devicekit.sharing.leases import Lease

    simulate([h100(), h100()])
    gpu = dk.gpus()[0]
    directory = lease_dir()
    taken: list[Lease] = []
    real = queue_state.read_ticket_files

    def tickets_while_a_job_starts(*args, **kwargs):
        if not taken:
            taken.append(Lease.acquire([gpu.uuid]))  # the directory changes mid-look
        return real(*args, **kwargs)

    monkeypatch.setattr(queue_state, "read_ticket_files", tickets_while_a_job_starts)
    try:
        leases, files = queue_state.read_moment(directory)
        assert [r.gpu_uuid for r in leases] == [gpu.uuid]  # the second look saw the lease
        assert files.tickets == ()
    finally:
        for lease in taken:
            lease.release()
