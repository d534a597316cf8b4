"""Ending a rank cleanly: exit_without_teardown keeps atexit, output and the exit code;
devicekit.teardown's settle_backend_threads waits for torch's gloo workers to free their works."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from devicekit import teardown
from tests.ranks import child_env

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import devicekit as dk
    atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
    sys.stdout.write("unflushed line")          # no newline, no flush: must still come out
    dk.dist.exit_without_teardown(3)
    print("never reached")
    """
)


def test_exit_without_teardown_runs_atexit_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, str(script), str(marker)], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed line"
    assert marker.read_text() == "atexit ran"


SETTLE_SCRIPT = textwrap.dedent(
    """
    import atexit, json, sys
    hooks = []
    register = atexit.register
    atexit.register = lambda fn, *a, **k: (hooks.append(getattr(fn, "__name__", "?")), register(fn, *a, **k))[1]
    import torch, torch.distributed as tdist
    import devicekit as dk
    from devicekit import teardown
    dk.dist.init()                                   # one rank: gloo on a HashStore
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()        # DDP's bucket all-reduce on a gloo worker
    t = torch.ones(3)
    tdist.all_reduce(t)
    workers = teardown._worker_threads()
    dk.dist.destroy()
    dk.dist.init()
    dk.dist.destroy()
    print(json.dumps({"hooks": hooks.count("settle_backend_threads"), "workers": len(workers),
                      "settled": teardown.settle_backend_threads(timeout=5)}))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_gloo_workers_are_found_and_settle_after_the_last_collective(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SETTLE_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["workers"] >= 1  # torch's pt_gloo_runloop threads, by name
    assert facts["settled"] is True
    assert facts["hooks"] == 1  # the wait at exit: registered once (import, then two inits)


class FakeThreads:
    """Scripted /proc looks: each thread id maps to the (state, switches) of successive looks."""

    def __init__(self, looks: dict[str, list[tuple[str, int]]]) -> None:
        self.looks = looks
        self.count = {tid: 0 for tid in looks}

    def look(self, tid: str) -> tuple[str, int]:
        index = min(self.count[tid], len(self.looks[tid]) - 1)
        self.count[tid] += 1
        return self.looks[tid][index]


def test_settle_waits_while_a_worker_wakes_for_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    # worker 7 wakes twice (switches change: it took the GIL to free a work), then sleeps
    fake = FakeThreads({"7": [("S", 10), ("R", 11), ("S", 12), ("S", 12)], "8": [("S", 5)]})
    monkeypatch.setattr(teardown, "_worker_threads", lambda: ["7", "8"])
    monkeypatch.setattr(teardown, "_look", fake.look)
    assert teardown.settle_backend_threads(timeout=5) is True
    assert fake.count["7"] == 4  # it did not stop looking before the two quiet looks in a row


def test_settle_gives_up_on_a_worker_that_keeps_running(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeThreads({"7": [("R", 1)]})
    monkeypatch.setattr(teardown, "_worker_threads", lambda: ["7"])
    monkeypatch.setattr(teardown, "_look", fake.look)
    start = time.monotonic()
    assert teardown.settle_backend_threads(timeout=0.1) is False
    assert time.monotonic() - start < 5


def test_settle_returns_at_once_without_gloo_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(teardown, "_worker_threads", lambda: [])
    assert teardown.settle_backend_threads(timeout=0) is True


def test_a_thread_that_ended_counts_as_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeThreads({"7": [("S", 3), ("gone", 0), ("gone", 0)]})
    monkeypatch.setattr(teardown, "_worker_threads", lambda: ["7"])
    monkeypatch.setattr(teardown, "_look", fake.look)
    assert teardown.settle_backend_threads(timeout=5) is True
