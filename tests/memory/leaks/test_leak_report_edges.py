"""Leak reports at their edges: slow growth ranked below a leak, a log of scalars alone, memory no
name reaches, a callback's old frames let go, and odd objects (dead weak proxies, ``__getattr__``
that raises) that must never break the user's loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import devicekit as dk
from tests.memory.leaks.user_zoo_models import X, small, train

SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def test_a_log_of_detached_scalars_is_slow_growth_ranked_below_a_leak() -> None:
    model = small()
    loss_curve: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []

    def step() -> None:
        loss = train(model)
        loss_curve.append(loss.detach().cpu())  # SLOW-loss-curve
        outputs.append(model(X).detach())  # LEAK-beside-the-log

    report = dk.find_leaks(step)
    assert [leak.holder for leak in report.leaks] == ["outputs"], str(report)
    assert report.leaks[0].lineno == line_of("LEAK-beside-the-log")
    slow = report.minor[0]
    assert (slow.holder, slow.severity, slow.bytes_per_step) == ("loss_curve", "minor", 4)
    assert slow.lineno == line_of("SLOW-loss-curve")
    assert "not a leak" in str(report) and "4 B/step" in str(report)
    assert "128 B/step = 1.2 MiB after 10,000 steps" in str(report.leaks[0])


def test_only_a_log_of_scalars_reports_no_leak() -> None:
    loss_curve: list[torch.Tensor] = []

    def step() -> None:
        loss_curve.append(torch.tensor(0.5))

    report = dk.find_leaks(step)
    assert report.ok and report.minor and report.minor[0].holder == "loss_curve", str(report)


def test_memory_no_name_reaches_is_reported_as_unnamed_growth() -> None:
    import sys

    setattr(sys, "_devicekit_test_hidden", [])  # noqa: B010 - reachable only through a module

    def step() -> None:
        getattr(sys, "_devicekit_test_hidden").append(torch.randn(64))  # noqa: B009

    try:
        report = dk.find_leaks(step)
    finally:
        delattr(sys, "_devicekit_test_hidden")
    notes = [note for note in report.notes if "no holder found" in note]
    assert notes and "+256 B/step" in notes[0], str(report)


def test_a_callback_step_keeps_no_old_frame_alive() -> None:
    import weakref

    model = small()
    ld = dk.LeakDetector()
    ld.start()
    refs = []

    def on_train_batch_end(model: nn.Module, batch: torch.Tensor) -> None:  # a callback's frame
        ld.step()

    try:
        for _ in range(6):
            feats: list[torch.Tensor] = []
            model[1].register_forward_hook(lambda m, i, o, feats=feats: feats.append(o))
            batch = torch.randn(8, 16)
            train(model)
            refs.append(weakref.ref(batch))
            on_train_batch_end(model, batch)
            del batch
        report = ld.report()
        alive = [ref() is not None for ref in refs[:-1]]
    finally:
        ld.stop()
    assert report.leaks[0].holder == "model.1._forward_hooks", str(report)
    assert not any(alive), alive  # earlier callback frames (and their batches) were let go


class Odd:
    """Runs code on attribute access, as proxies and lazy objects do."""

    def __getattr__(self, name: str) -> Any:
        raise RuntimeError(f"no {name}")


def test_dead_weak_proxies_and_odd_objects_never_break_the_loop() -> None:
    import weakref

    class Gone:
        pass

    gone = Gone()
    things: list[Any] = [weakref.proxy(gone), Odd()]
    del gone
    proxy = things[0]
    odd = Odd()
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o: feats.append(o))
        train(model)

    report = dk.find_leaks(step)
    assert report.leaks[0].holder == "model.1._forward_hooks", str(report)
    del proxy, odd, things
