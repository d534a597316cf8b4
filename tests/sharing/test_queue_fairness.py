"""The fair queue against the starvation case of issue 21, with real (forked) processes.

A 4-GPU job asks while 1-GPU jobs keep arriving on 4 simulated GPUs: with polling it waited
until the stream ended; with the queue it starts within about one small job's length, and no
small job that arrived after it starts before it. A killed waiter leaves the queue at once.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from devicekit.sharing.lease_directory import lease_dir
from devicekit.sharing.tickets import read_tickets
from tests.conftest import h100

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(4)]


def _job(name: str, count: int, hold: float, out: str) -> None:
    from devicekit.selection.choose import select_gpus

    sel = select_gpus(count, wait=120, poll_interval=0.25, progress=False)
    start = time.monotonic()
    time.sleep(hold)
    Path(out, f"{name}.json").write_text(json.dumps({"start": start, "end": time.monotonic()}))
    sel.release()
    os._exit(0)


def _queued_or_started(pid: int, done: Path, timeout: float = 30.0) -> bool:
    """Wait until ``pid`` holds a ticket or has run; False when neither within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        if done.exists() or any(t.pid == pid for t in read_tickets(lease_dir(), cleanup=False)):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


@pytest.mark.slow
def test_a_4_gpu_job_is_not_starved_by_a_stream_of_1_gpu_jobs(
        simulate: Callable[..., Path], tmp_path: Path) -> None:
    simulate([h100(uuid=u) for u in UUIDS])
    out = tmp_path / "jobs"
    out.mkdir()
    ctx = multiprocessing.get_context("fork")
    procs = []
    hold, every, stream = 2.5, 0.5, 9.0  # more work arrives than 4 GPUs can do
    origin = time.monotonic()
    arrived: dict[str, float] = {}
    big_asked = seen = None
    try:
        k = 0
        while time.monotonic() - origin < stream:
            now = time.monotonic() - origin
            if big_asked is None and now >= 2.0:
                big = ctx.Process(target=_job, args=("big", 4, 0.5, str(out)))
                big.start()
                procs.insert(0, big)
                big_asked = time.monotonic()
            if big_asked is not None and seen is None and _queued_or_started(
                    procs[0].pid, out / "big.json", timeout=0.0):
                seen = time.monotonic()  # arrivals from now on came after its ticket
            name = f"small{k}"
            p = ctx.Process(target=_job, args=(name, 1, hold, str(out)))
            p.start()
            procs.append(p)
            arrived[name] = time.monotonic()
            k += 1
            time.sleep(max(origin + k * every - time.monotonic(), 0.0))
        stream_end = time.monotonic()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0, "a job failed or never got its GPUs"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert big_asked is not None
    runs = {f.stem: json.loads(f.read_text()) for f in out.iterdir()}
    big_start = runs["big"]["start"]
    # starts within about one small job's length (2.5 s; a margin for a loaded machine),
    # not when the stream ends
    assert big_start - big_asked < 2 * hold
    assert big_start < stream_end
    later = [n for n, t in arrived.items() if t > (seen or big_asked)]
    assert later, "the stream must go on after the big job asks"
    for name in later:  # first come, first served: nobody who came later went first
        assert runs[name]["start"] >= big_start, f"{name} started before the 4-GPU job"


def test_a_killed_waiter_leaves_the_queue_at_once(simulate: Callable[..., Path],
                                                  tmp_path: Path) -> None:
    simulate([h100(uuid=u) for u in UUIDS[:1]])
    from devicekit.selection.choose import select_gpus

    ctx = multiprocessing.get_context("fork")
    with select_gpus(1):  # the only GPU is held: the child must queue
        child = ctx.Process(target=_job, args=("w", 1, 0.0, str(tmp_path)))
        child.start()
        try:
            assert _queued_or_started(child.pid, tmp_path / "w.json")
            assert [t.pid for t in read_tickets(lease_dir())] == [child.pid]
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
            assert read_tickets(lease_dir()) == []  # gone at once, no waiting for a timeout
            assert not [n for n in os.listdir(lease_dir()) if n.endswith(".ticket")]
        finally:
            if child.is_alive():
                child.kill()
                child.join(5)
