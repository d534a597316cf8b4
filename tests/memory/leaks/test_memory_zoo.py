"""The leak finder on leaks only the memory shows (issue 36): every entry point, one answer.

Each case of :mod:`tests.memory.leaks.memory_zoo` goes through ``dk.find_leaks`` and through a
``dk.LeakDetector`` in a hand-written loop over the same step; both must name the same holder,
kind and line, give the fix that fits the code, size it within 20 % of the live storage it
really keeps per step, and stay silent on every clean look-alike.
"""

from __future__ import annotations

import sys

import pytest
import torch

import devicekit as dk
from devicekit.memory.leaks.measure import NODE_BYTES
from tests.memory.leaks import memory_zoo
from tests.memory.leaks.memory_zoo import CLEAN, LEAKS, Case, line_of, storage_growth


def by_hand(case: Case, steps: int = 6) -> dk.LeakReport:
    step = case.step  # the loop's only variable: the finder reads the step's closure from it
    with dk.LeakDetector() as ld:
        for _ in range(steps):
            step()
            ld.step()
    return ld.report()


def answer(report: dk.LeakReport, case: Case) -> tuple[str, str, int, str]:
    found = report.minor if case.minor else report.leaks
    names = [leak.holder for leak in found]
    assert names and names[0] == case.holder, f"{case.holder} not named first:\n{report}"
    leak = found[0]
    assert report.ok is case.minor, str(report)
    return leak.holder, leak.kind, leak.lineno, leak.severity


@pytest.mark.parametrize("name", sorted(LEAKS))
def test_find_leaks_and_a_hand_loop_name_the_same_holder_kind_line_and_fix(name: str) -> None:
    reports = [dk.find_leaks(LEAKS[name]().step), by_hand(LEAKS[name]())]
    case = LEAKS[name]()
    answers = [answer(report, case) for report in reports]
    assert answers[0] == answers[1], answers
    holder, kind, lineno, _ = answers[0]
    assert lineno == line_of(case.marker), str(reports[0])
    if case.kind is not None:
        assert kind == case.kind, str(reports[0])
    for report in reports:
        leak = (report.minor if case.minor else report.leaks)[0]
        for words in case.fix:
            assert any(word in leak.fix for word in words), f"{words} not in the fix: {leak.fix}"
        assert "no_grad" not in leak.fix, leak.fix  # each of these was backpropagated, or is no graph
        assert not any("no holder found" in note for note in report.notes), str(report)


@pytest.mark.parametrize("name", sorted(LEAKS))
def test_sizes_are_within_a_fifth_of_the_storage_really_kept(name: str) -> None:
    truth = storage_growth(LEAKS[name])
    report = dk.find_leaks(LEAKS[name]().step)
    leak = [*report.leaks, *report.minor][0]
    storage = leak.bytes_per_step - leak.nodes_per_step * NODE_BYTES  # nodes are an estimate, not storage
    if truth < 64:  # a graph of nodes only (a running value over backpropagated losses)
        assert abs(storage) < 64 and leak.nodes_per_step > 0, (truth, leak)
    else:
        assert abs(storage - truth) <= 0.2 * truth, (name, truth, storage, leak)


@pytest.mark.parametrize("name", sorted(CLEAN))
def test_clean_look_alikes_are_silent_everywhere(name: str) -> None:
    for report in (dk.find_leaks(CLEAN[name]().step), by_hand(CLEAN[name]())):
        assert report.ok and not report.minor, str(report)
        assert not report.notes, str(report)


def test_the_mse_log_is_minor_and_says_how_to_drop_the_buffer() -> None:
    report = dk.find_leaks(LEAKS["detached_mse_log"]().step)
    (slow,) = report.minor
    assert report.ok and slow.bytes_per_step == 8 * 4 * 4, str(report)  # the 8x4 buffer, not 4 bytes
    assert "buffer" in slow.detail and "not a leak" in str(report)
    assert "loss.detach().clone()" in slow.fix and "loss.item()" in slow.fix


def test_a_holder_emptied_every_epoch_is_not_projected_as_unbounded() -> None:
    class Module(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(16, 16)
            self.training_step_outputs: list[torch.Tensor] = []

        def training_step(self) -> None:
            out = self.fc(memory_zoo.X)
            out.sum().backward()
            self.training_step_outputs.append(out.detach())  # GROW-epoch

        def on_train_epoch_end(self) -> None:  # the window below ends before the epoch does
            self.training_step_outputs.clear()  # EMPTIED-epoch

    module = Module()
    report = dk.find_leaks(module.training_step)
    assert len(report.minor) == 1, str(report)
    slow = report.minor[0]
    here = __file__.rsplit("/", 1)[-1]
    emptied = next(i for i, text in enumerate(open(__file__).read().splitlines(), 1) if text.endswith("# EMPTIED-epoch"))
    assert report.ok and slow.holder == "module.training_step_outputs", str(report)  # the caller's name
    assert slow.cleared_at == f"{here}:{emptied} (on_train_epoch_end)"
    assert "until emptied" in slow.projection and "10,000" not in str(slow), str(slow)


def test_a_big_holder_emptied_every_epoch_is_still_a_leak_up_to_the_epoch() -> None:
    outputs: list[torch.Tensor] = []

    def step() -> None:
        outputs.append(torch.randn(64, 256))  # 64 KiB a step, until the epoch ends
        if len(outputs) > 1000:  # an epoch's worth
            outputs.clear()

    report = dk.find_leaks(step)
    (leak,) = report.leaks
    assert leak.holder == "outputs" and leak.cleared_at.endswith("(step)"), str(report)
    assert "until emptied" in leak.projection and "64 KiB" in leak.fix, str(report)


def test_survivors_no_name_reaches_make_the_report_fail_and_say_what_was_tried() -> None:
    setattr(sys, "_devicekit_zoo_hidden", [])  # noqa: B010 - reachable only through a module

    def step() -> None:
        getattr(sys, "_devicekit_zoo_hidden").append(torch.randn(64))  # noqa: B009

    try:
        reports = [dk.find_leaks(step), by_hand(Case(step))]
    finally:
        delattr(sys, "_devicekit_zoo_hidden")
    for report in reports:
        assert not report.ok, str(report)
        (leak,) = report.leaks
        assert leak.kind == "unnamed" and leak.bytes_per_step == 256, str(report)
        assert "float32 [64]" in leak.detail and "searched from" in leak.fix and "watch=" in leak.fix
