"""dk.preempted() / dk.on_preempt(): the flag is set by the signal, the work runs in the loop."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.placement import preemption


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    preemption._reset()
    yield
    preemption._reset()


def _signal_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while preemption._state["signal"] is None and time.monotonic() < deadline:
        time.sleep(0.01)  # the Python-level handler runs between bytecodes


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM])
def test_each_preemption_signal_sets_the_flag_and_kills_nothing(sig: int) -> None:
    assert dk.preempted() is False
    _signal_self(sig)
    assert dk.preempted() is True
    assert preemption.preempt_signal() == signal.Signals(sig).name


def test_a_callback_runs_once_in_the_polling_thread_not_in_the_handler() -> None:
    calls: list[tuple[str, str]] = []
    dk.on_preempt(lambda name: calls.append((name, threading.current_thread().name)))
    _signal_self(signal.SIGUSR1)
    assert calls == []  # the handler only set the flag
    result: list[bool] = []
    worker = threading.Thread(target=lambda: result.append(dk.preempted()), name="loop")
    worker.start()
    worker.join()
    assert result == [True] and calls == [("SIGUSR1", "loop")]
    assert dk.preempted() is True and len(calls) == 1  # once


def test_a_handler_the_program_had_still_runs() -> None:
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        dk.preempted()
        _signal_self(signal.SIGUSR1)
        assert dk.preempted() and seen == [signal.SIGUSR1]
    finally:
        preemption._reset()
        signal.signal(signal.SIGUSR1, previous)


def test_the_marker_devicekit_run_leaves_counts_as_the_signal(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(preemption.PREEMPT_DIR_ENV, str(tmp_path))
    assert dk.preempted() is False
    (tmp_path / preemption.SIGNAL_FILE).write_text("SIGUSR2")
    assert dk.preempted() is True and preemption.preempt_signal() == "SIGUSR2"


def test_a_save_after_the_signal_is_noted_for_requeue(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(preemption.PREEMPT_DIR_ENV, str(tmp_path / "run"))
    monkeypatch.setenv("RANK", "0")
    (tmp_path / "run").mkdir()
    dk.preempted()  # the loop's first poll installs the handlers
    dk.save_checkpoint({"step": 1}, tmp_path / "before.pt")
    assert not Path(preemption.saved_file(str(tmp_path / "run"), 0)).exists()
    _signal_self(signal.SIGUSR1)
    dk.save_checkpoint({"step": 2}, tmp_path / "after.pt")
    note = Path(preemption.saved_file(str(tmp_path / "run"), 0))
    assert note.read_text() == str(tmp_path / "after.pt")
    assert note.stat().st_mode & 0o077 == 0


def test_on_preempt_refuses_what_it_cannot_call() -> None:
    with pytest.raises(dk.InvalidValueError, match="needs a function, got 3"):
        dk.on_preempt(3)  # type: ignore[arg-type]


def _one_rank_is_signalled() -> tuple[bool, str | None, bool]:
    import torch.distributed as tdist

    before = dk.preempted()  # a collective: every rank, at the same point
    if tdist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR2)
        while preemption._state["signal"] is None:
            time.sleep(0.01)
    return before, preemption.preempt_signal() if dk.preempted() else None, dk.preempted(sync=False)


def test_with_a_process_group_every_rank_agrees_when_one_got_the_signal() -> None:
    results = dk.launch(_one_rank_is_signalled, nprocs=2, backend="gloo", devices="cpu",
                        timeout=120)
    assert results == [(False, "SIGUSR2", True), (False, "SIGUSR2", True)]
