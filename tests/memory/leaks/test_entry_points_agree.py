"""The same answers however the detector is driven: ``dk.find_leaks`` on a step, a
``dk.LeakDetector`` in a hand-written loop, and a framework-like callback that never owns the
loop (``start()`` at train start, ``step()`` after each batch, ``report()`` at the end).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import devicekit as dk
from tests.memory.leaks.user_zoo_models import CachingNet, TimeNet, X, small, train


def issue_hook() -> tuple[Callable[[int], None], dict[str, Any], str]:
    model = small()

    def step(index: int) -> None:
        feats: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o: feats.append(o))
        train(model)

    return step, {"model": model}, "model.1._forward_hooks"


def issue_class_attribute() -> tuple[Callable[[int], None], dict[str, Any], str]:
    model = CachingNet()
    CachingNet.cache.clear()
    return (lambda index: train(model)), {"model": model}, "CachingNet.cache"


def issue_deferred_closure() -> tuple[Callable[[int], None], dict[str, Any], str]:
    model = small()
    pending_logs: list[Callable[[], None]] = []

    def step(index: int) -> None:
        out = model(X)
        pending_logs.append(lambda out=out: print(out.mean()))

    return step, {"pending_logs": pending_logs, "model": model}, "pending_logs"


def issue_lru_cache() -> tuple[Callable[[int], None], dict[str, Any], str]:
    model = TimeNet()
    return (lambda index: model(X, 100 + index).sum().backward()), {"model": model}, "TimeNet.time_embedding"


def issue_param_groups() -> tuple[Callable[[int], None], dict[str, Any], str]:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(index: int) -> None:
        opt.add_param_group({"params": [torch.zeros(256, requires_grad=True)]})
        train(model, opt)

    return step, {"opt": opt, "model": model}, "opt.param_groups"


class Callback:
    """How a framework callback drives the detector: it never owns the loop."""

    def __init__(self, **watch: Any) -> None:
        self.detector = dk.LeakDetector(watch=watch)
        self.report: dk.LeakReport | None = None

    def on_train_start(self) -> None:
        self.detector.start()

    def on_train_batch_end(self) -> None:
        self.detector.step()

    def on_train_end(self) -> None:
        self.report = self.detector.report()
        self.detector.stop()


def drive_with_callback(step: Callable[[int], None], watch: dict[str, Any]) -> dk.LeakReport:
    callback = Callback(**watch)
    callback.on_train_start()
    try:
        for index in range(6):
            step(index)
            callback.on_train_batch_end()
    finally:
        callback.on_train_end()
    assert callback.report is not None
    return callback.report


def drive_find_leaks(step: Callable[[int], None], watch: dict[str, Any]) -> dk.LeakReport:
    del watch  # find_leaks sees the step's closure
    return dk.find_leaks(step)


def drive_by_hand(step: Callable[[int], None], watch: dict[str, Any]) -> dk.LeakReport:
    with dk.LeakDetector(watch=watch) as ld:
        for index in range(6):
            step(index)
            ld.step()
    return ld.report()


ISSUE_CASES = {name[len("issue_"):]: fn for name, fn in list(globals().items()) if name.startswith("issue_")}


@pytest.mark.parametrize("case", sorted(ISSUE_CASES))
def test_find_leaks_detector_and_callback_agree(case: str) -> None:
    answers = []
    for drive in (drive_find_leaks, drive_by_hand, drive_with_callback):
        made = ISSUE_CASES[case]()
        holder = made[2]
        report = drive(made[0], made[1])
        del made
        CachingNet.cache.clear()
        leak = report.leak(holder)
        assert leak is not None, f"{drive}: {holder} not reported:\n{report}"
        assert report.leaks[0] is leak, f"{drive}: {report}"
        answers.append((leak.holder, leak.kind, leak.filename, leak.lineno))
    assert answers[0] == answers[1] == answers[2], answers
    assert answers[0][3] > 0
