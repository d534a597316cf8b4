"""What a wait says where stderr is no terminal (issue 46, item 2): a line when it begins, one
on every change of reason, one every so often in between; nothing when asked for silence."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.hardware.gpu import GPU
from devicekit.selection.candidates import Candidate
from devicekit.selection.waiting import WaitDisplay
from tests.conftest import h100


@pytest.fixture
def four(simulate: Callable[..., Path]) -> list[GPU]:
    simulate([h100() for _ in range(4)])
    return dk.gpus()


def candidates(gpus: list[GPU], why: str) -> list[Candidate]:
    return [Candidate(gpus[0], 0, (why,)), Candidate(gpus[1], 1, ())]


def test_plain_lines_on_start_on_each_change_and_every_so_often(four: list[GPU]) -> None:
    stream = io.StringIO()
    display = WaitDisplay(2, 600, stream=stream, every=0.3)
    busy = candidates(four, "leased by bob (pid 7, python big.py)")
    display.update(busy, 600)
    display.update(busy, 599)  # nothing new, too soon: no line
    lines = stream.getvalue().splitlines()
    assert lines == ["devicekit: waiting for 2 GPU(s) (1 eligible), up to 600 s: "
                     "GPU 0: leased by bob (pid 7, python big.py)"]
    display.update(candidates(four, "10 GiB free < 20 GiB asked"), 598)  # the reason changed
    time.sleep(0.35)
    display.update(candidates(four, "10 GiB free < 20 GiB asked"), 597)  # `every` has passed
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[1].startswith("devicekit: still waiting for 2 GPU(s) (1 eligible), 0 s so far, 598 s left: ")
    assert lines[1].endswith("GPU 0: 10 GiB free < 20 GiB asked") and lines[2].endswith("asked")
    display.close()


def test_silent_when_disabled(four: list[GPU]) -> None:
    stream = io.StringIO()
    display = WaitDisplay(2, 60, stream=stream, enabled=False)
    display.update(candidates(four, "busy"), 10)
    assert stream.getvalue() == ""


def test_a_huge_wait_is_said_in_days_not_in_300_digits(four: list[GPU]) -> None:
    # `select --wait 1e308` printed "up to 1000000000000000010979063629440455417404923...": the
    # finite float in full; past a million seconds the line gives days instead
    stream = io.StringIO()
    display = WaitDisplay(2, 1e308, stream=stream)
    display.update(candidates(four, "busy"), 1e308)
    display.update(candidates(four, "still busy"), 1e7)
    first, second = stream.getvalue().splitlines()
    assert first.startswith("devicekit: waiting for 2 GPU(s) (1 eligible), up to >9999d: ")
    assert ", 115d17h left: " in second and len(second) < 120, second
    display.close()
