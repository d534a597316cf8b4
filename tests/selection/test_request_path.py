"""``devicekit run``'s request passes each room of selection and the queue once or twice.

Before the sharing wing was split off, selection and the queue called each other back and forth
(the issue counted selection.py entered six times, queue_turn.py five, tickets.py four). The
pipeline (request -> look -> candidates -> verdict -> ranking -> grant) enters each of its own
files once or twice; the lease directory's own locking (leases, device_locks, lease_records,
lease_directory) is one mechanism and is not counted against it.
"""

from __future__ import annotations

from tests.selection.request_path import RUN_ONE_GPU, TWO_GPUS, follow, run_request

#: the lease's locking mechanism: files that call each other while one device is locked
LOCKING = {"sharing/leases.py", "sharing/device_locks.py", "sharing/lease_records.py",
           "sharing/lease_directory.py"}
#: the one launcher reader asks each launcher's class in turn (torchrun, dk.launch, Kubeflow,
#: Slurm, MPI: one entry each by construction); it is counted by its reads instead, below
LAUNCHER_READER = "hardware/launchers/"


def test_run_request_enters_selection_and_queue_files_at_most_twice(monkeypatch) -> None:
    import devicekit.hardware.launchers as launchers
    import devicekit.jobs.outer as outer

    reads: list[int] = []
    detect = launchers.detect_environment

    def counted(*args, **kwargs):
        reads.append(1)
        return detect(*args, **kwargs)

    monkeypatch.setattr(outer, "detect_environment", counted)
    path, code = run_request(RUN_ONE_GPU, TWO_GPUS)
    assert code == 0
    rooms = path.rooms
    assert rooms["selection/choose.py"] == 1 and rooms["selection/grant.py"] == 1
    over = {room: n for room, n in rooms.items()
            if n > 2 and room.startswith(("selection/", "sharing/", "hardware/", "jobs/allocation"))
            and room not in LOCKING and not room.startswith(LAUNCHER_READER)}
    assert not over, path.summary()
    assert len(reads) <= 2, f"the launcher variables were read {len(reads)} times for one request"
    assert rooms["sharing/queue_turn.py"] <= 2 and rooms["sharing/tickets.py"] <= 1, path.summary()
    # one inventory snapshot per request: run, allocation and selection share it
    assert rooms["hardware/simulated.py"] == 1, path.summary()


def test_the_tracer_counts_entries_not_returns() -> None:
    from devicekit.hardware.known_gpus import lookup
    from devicekit.units import format_size

    lookup.cache_clear()
    with follow() as path:
        lookup("NVIDIA A100-SXM4-80GB")
        lookup("NVIDIA A100-SXM4-80GB")  # remembered per name: no second call
        format_size(1)  # the ground floor is not a room
    assert path.entries == ["hardware/known_gpus.py"] and path.returns == 0
