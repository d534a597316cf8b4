"""The memory zoo's leaks kept on the model object, as a framework's user writes them (issue 36).

Each case of :mod:`tests.memory.leaks.owner_zoo` trains through ``dk.find_leaks`` and a
``dk.LeakDetector`` hand loop: both name the same holder below the owner (a closure cell of a
function on the module: ``owner.track.running``; a global the module's method names:
``LAST_OUT``), kind, line and severity, with a size within 20 % of the live storage really kept
per step; clean look-alikes stay silent. The callbacks give the same answers:
``tests/integrations/test_leak_zoo_callbacks.py``.
"""

from __future__ import annotations

import pytest

import devicekit as dk
from devicekit.memory.leaks.measure import NODE_BYTES
from tests.memory.leaks.owner_zoo import (
    OWNER_CLEAN,
    OWNER_LEAKS,
    Spec,
    line_of,
    plain_step,
    relative,
    storage_growth,
)

Verdict = list[tuple[str, str, int, str]]


def verdict(report: dk.LeakReport) -> Verdict:
    """What must agree between entry points: the holder below its root, kind, line, severity."""
    return [(relative(leak.holder), leak.kind, leak.lineno, leak.severity) for leak in [*report.leaks, *report.minor]]


def by_hand(spec: Spec, steps: int = 6) -> dk.LeakReport:
    owner = spec.make()
    step = plain_step(owner)
    with dk.LeakDetector() as ld:
        for _ in range(steps):
            step()
            ld.step()
    return ld.report()


def assert_size(leak: dk.Leak, truth: float) -> None:
    """Storage within 20 % of the truth (nodes are an estimate, not storage: left out)."""
    storage = leak.bytes_per_step - leak.nodes_per_step * NODE_BYTES
    if truth < 64:  # a graph of nodes only (a running value over backpropagated losses)
        assert abs(storage) < 64 and leak.nodes_per_step > 0, (truth, leak)
    else:
        assert abs(storage - truth) <= 0.2 * truth, (truth, storage, leak)


def assert_named(report: dk.LeakReport, spec: Spec) -> dk.Leak:
    """The one leak (or slow growth) the case makes, named as the spec says, with a fix that fits."""
    expected = (spec.holder, spec.kind, line_of(spec.marker or ""), "minor" if spec.minor else "leak")
    assert verdict(report) == [expected], str(report)
    assert report.ok is spec.minor and not report.notes, str(report)
    leak = [*report.leaks, *report.minor][0]
    for words in spec.fix:
        assert any(word in leak.fix for word in words), f"{words} not in the fix: {leak.fix}"
    return leak


@pytest.mark.parametrize("name", sorted(OWNER_LEAKS))
def test_find_leaks_and_a_hand_loop_name_a_leak_kept_on_the_owner(name: str) -> None:
    spec = OWNER_LEAKS[name]
    reports = [dk.find_leaks(plain_step(spec.make())), by_hand(spec)]
    assert verdict(reports[0]) == verdict(reports[1]), f"{reports[0]}\n---\n{reports[1]}"
    truth = storage_growth(spec)
    for report in reports:
        leak = assert_named(report, spec)
        assert_size(leak, truth)
        assert "no_grad" not in leak.fix, leak.fix  # each of these was backpropagated, or is no graph


@pytest.mark.parametrize("name", sorted(OWNER_CLEAN))
def test_clean_owners_are_silent(name: str) -> None:
    spec = OWNER_CLEAN[name]
    for report in (dk.find_leaks(plain_step(spec.make())), by_hand(spec)):
        assert report.ok and not report.leaks and not report.minor and not report.notes, str(report)


def test_the_owner_zoo_holds_the_issues_kinds() -> None:
    kinds = {spec.kind for spec in OWNER_LEAKS.values()}
    assert {"exception_frames", "autograd_graph", "tensor_attributes", "suspended_frames", "numpy_views",
            "hook_per_step"} <= kinds
    assert {"sawtooth_outputs", "detached_mse_cleared", "bounded_deque"} <= set(OWNER_CLEAN)
