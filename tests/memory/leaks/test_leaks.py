"""The leak finder names the holder, the line that extended it, and stays quiet on warm-up."""

from __future__ import annotations

import collections
import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import devicekit as dk

SOURCE = Path(__file__).read_text().splitlines()


def line_of(marker: str) -> int:
    """The line number of the source line carrying ``# <marker>``."""
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def make_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


X = torch.randn(8, 16)
Y = torch.randn(8, 1)


def assert_leak(report: dk.LeakReport, holder: str, kind: str, marker: str) -> dk.Leak:
    leak = report.leak(holder)
    assert leak is not None, f"{holder} not reported: {report}"
    assert leak.kind == kind
    assert leak.filename == __file__
    assert leak.lineno == line_of(marker), str(report)
    assert leak.bytes_per_step > 0
    assert leak.fix
    return leak


# -- leaks ------------------------------------------------------------------------------------

total_loss: object = 0


def test_global_total_loss_keeps_the_graph() -> None:
    model, opt = make_model()

    def step() -> None:
        global total_loss
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        total_loss += loss  # LEAK-global-total-loss

    report = dk.find_leaks(step, steps=6, warmup=2)
    leak = assert_leak(report, "total_loss", "autograd_graph", "LEAK-global-total-loss")
    assert ".item()" in leak.fix
    assert leak.nodes_per_step > 0
    assert [lk.holder for lk in report.leaks] == ["total_loss"]


def test_loop_local_total_loss_with_detector() -> None:
    model, opt = make_model()
    running = 0
    with dk.LeakDetector(warmup=2) as ld:
        for _ in range(6):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(X), Y)
            loss.backward()
            opt.step()
            running += loss  # LEAK-local-running
            ld.step()
    report = ld.report()
    assert_leak(report, "running", "autograd_graph", "LEAK-local-running")
    assert len(report.leaks) == 1


def test_evaluation_without_no_grad_keeps_activations() -> None:
    model, _ = make_model()
    score = torch.zeros(())
    with dk.LeakDetector() as ld:
        for _ in range(6):
            score = score + model(X).sum()  # LEAK-eval
            ld.step()
    leak = assert_leak(ld.report(), "score", "autograd_graph", "LEAK-eval")
    assert "no_grad" in leak.fix


def test_evaluation_outputs_kept_with_graphs_advise_no_grad() -> None:
    model, _ = make_model()
    predictions: list[torch.Tensor] = []
    with dk.LeakDetector() as ld:
        for _ in range(6):
            predictions.append(model(X))  # LEAK-eval-list
            ld.step()
    leak = assert_leak(ld.report(), "predictions", "growing_container", "LEAK-eval-list")
    assert "no_grad" in leak.fix


def test_growing_list_in_closure() -> None:
    model, _ = make_model()
    outputs: list[torch.Tensor] = []

    def step() -> None:
        out = model(X)
        outputs.append(out)  # LEAK-closure-list

    leak = assert_leak(dk.find_leaks(step), "outputs", "growing_container", "LEAK-closure-list")
    assert leak.items_per_step == 1.0
    assert "detach" in leak.fix


def test_growing_dict_cache_of_detached_tensors() -> None:
    cache: dict[int, torch.Tensor] = {}

    def step(index: int) -> None:
        value = torch.randn(64, 64)
        cache[index] = value  # LEAK-dict-cache

    leak = assert_leak(dk.find_leaks(step), "cache", "growing_container", "LEAK-dict-cache")
    assert leak.bytes_per_step == 64 * 64 * 4
    assert "bound" in leak.fix


def test_nested_container_is_named_by_its_key() -> None:
    stats: dict[str, list[torch.Tensor]] = {"losses": [], "names": []}

    def step() -> None:
        stats["losses"].append(torch.ones(100))  # LEAK-nested

    report = dk.find_leaks(step)
    assert_leak(report, "stats['losses']", "growing_container", "LEAK-nested")
    assert report.leak("stats") is None


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.history: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        self.history.append(h)  # LEAK-module-history
        return h.relu()


def test_tensors_cached_on_a_module() -> None:
    model = nn.Sequential(Recorder(), nn.Linear(16, 1))

    def step() -> None:
        model(X).sum().backward()

    report = dk.find_leaks(step)
    leak = assert_leak(report, "model.0.history", "module_cache", "LEAK-module-history")
    assert "deque" in leak.fix


class Node:
    def __init__(self) -> None:
        self.me = self
        self.payload = torch.randn(256)


def test_reference_cycle_holding_tensors() -> None:
    was_enabled = gc.isenabled()
    frozen = gc.get_freeze_count()  # not 0 where the program (or torch, on a GPU machine) froze

    def step() -> None:
        node = Node()  # LEAK-cycle
        assert node.payload.numel() == 256

    report = dk.find_leaks(step)
    leak = assert_leak(report, "Node.payload", "reference_cycle", "LEAK-cycle")
    assert leak.bytes_per_step == 256 * 4
    assert gc.isenabled() == was_enabled
    assert gc.get_freeze_count() == frozen  # a freeze it did not make is left as it was


def test_growing_tensor_by_cat() -> None:
    state = {"buffer": torch.zeros(0, 8)}

    def step() -> None:
        state["buffer"] = torch.cat([state["buffer"], torch.randn(4, 8)])  # LEAK-cat

    assert_leak(dk.find_leaks(step), "state['buffer']", "growing_tensor", "LEAK-cat")


# -- clean loops ------------------------------------------------------------------------------

def test_clean_loop_with_adam_warmup_has_no_leak() -> None:
    model, opt = make_model()  # Adam creates its state on step 1: warm-up, not a leak
    total = 0.0
    with dk.LeakDetector(warmup=2) as ld:
        for _ in range(6):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(X), Y)
            loss.backward()
            opt.step()
            total += loss.item()
            ld.step()
    report = ld.report()
    assert report.ok, str(report)
    assert report.holders_tracked >= 3
    assert "no leak" in str(report)


def test_cache_that_fills_to_a_fixed_size_has_no_leak() -> None:
    cache: dict[int, torch.Tensor] = {}

    def step(index: int) -> None:
        key = index % 3
        if key not in cache:
            cache[key] = torch.randn(32, 32)

    report = dk.find_leaks(step, steps=8, warmup=2)
    assert report.ok, str(report)


def test_bounded_deque_and_float_history_have_no_leak() -> None:
    model, opt = make_model()
    recent: collections.deque[torch.Tensor] = collections.deque(maxlen=2)
    losses: list[float] = []

    def step() -> None:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(X), Y)
        loss.backward()
        opt.step()
        recent.append(loss.detach())
        losses.append(loss.item())

    report = dk.find_leaks(step, steps=7, warmup=2)
    assert report.ok, str(report)


def test_evaluation_under_no_grad_has_no_leak() -> None:
    model, _ = make_model()
    score = torch.zeros(())
    with dk.LeakDetector() as ld, torch.no_grad():
        for _ in range(6):
            score = score + model(X).sum()
            ld.step()
    assert ld.report().ok


# -- report and input -------------------------------------------------------------------------

def test_report_prints_and_converts_to_json() -> None:
    history: list[torch.Tensor] = []

    def step() -> None:
        history.append(torch.ones(10, requires_grad=True) * 2)

    report = dk.find_leaks(step, lines=False)
    data = json.loads(report.to_json())
    assert data["leaks"][0]["holder"] == "history"
    assert data["leaks"][0]["lineno"] == 0
    assert "line attribution off" in " ".join(data["notes"])
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report)
    assert "history" in console.export_text()
    assert "history: growing container" in str(report)


def test_line_tracer_is_removed_after_the_run() -> None:
    def step() -> None:
        pass

    before = sys.gettrace()
    dk.find_leaks(step)
    assert sys.gettrace() is before


@pytest.mark.parametrize("kwargs", [{"steps": 3, "warmup": 2}, {"steps": -1}, {"warmup": True}])
def test_bad_arguments_are_one_line_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(dk.InvalidValueError) as err:
        dk.find_leaks(lambda: None, **kwargs)
    assert "\n" not in str(err.value)


def test_step_after_stop_is_an_error() -> None:
    ld = dk.LeakDetector()
    with ld:
        ld.step()
    with pytest.raises(dk.InvalidValueError, match="after stop"):
        ld.step()


def test_big_unchanged_container_is_not_rewalked_but_a_growing_one_is() -> None:
    dataset = [torch.ones(4) for _ in range(300)]  # big and constant: measured once
    seen: list[torch.Tensor] = []

    def step() -> None:
        seen.append(dataset[len(seen)] * 2)  # LEAK-big

    report = dk.find_leaks(step)
    assert report.leak("dataset") is None
    assert_leak(report, "seen", "growing_container", "LEAK-big")


def test_detector_without_with_never_pauses_gc() -> None:
    ld = dk.LeakDetector()
    kept: list[torch.Tensor] = []
    for _ in range(6):
        kept.append(torch.ones(10))
        assert gc.isenabled()
        ld.step()
    report = ld.report()
    assert sys.gettrace() is None  # reporting pauses the line tracer
    assert report.leak("kept") is not None
    assert any("reference cycles not checked" in note for note in report.notes)
    ld.stop()


def test_leak_fields_match_the_contract() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.ones(5))

    leak = dk.find_leaks(step).leaks[0]
    for name, kind in (("holder", str), ("kind", str), ("filename", str), ("lineno", int),
                       ("bytes_per_step", int), ("fix", str)):
        assert isinstance(getattr(leak, name), kind), name


def test_another_tracer_is_never_replaced() -> None:
    kept: list[torch.Tensor] = []

    def step() -> None:
        kept.append(torch.ones(5))  # LEAK-beside-tracer

    def other_tracer(frame, event, arg):  # a debugger or coverage stand-in
        return None

    previous = sys.gettrace()
    sys.settrace(other_tracer)
    try:
        report = dk.find_leaks(step)
        assert sys.gettrace() is other_tracer  # never replaced
    finally:
        sys.settrace(previous)
    leak = report.leak("kept")
    assert leak is not None
    if hasattr(sys, "monitoring"):  # 3.12+: sys.monitoring runs beside the other tracer
        assert leak.lineno == line_of("LEAK-beside-tracer")
    else:
        assert leak.lineno == 0
        assert any("another tracer" in note for note in report.notes)


def test_stopped_detector_keeps_nothing_alive() -> None:
    import weakref

    def loop() -> tuple[dk.LeakDetector, weakref.ref[torch.Tensor]]:
        big = torch.ones(1000)
        with dk.LeakDetector() as ld:
            for _ in range(4):
                ld.step()
        return ld, weakref.ref(big)

    ld, ref = loop()
    gc.collect()
    assert ref() is None  # the loop's frame and its tensors are gone although ld lives on
    assert ld.report().ok


def test_partial_and_callable_objects_are_followed() -> None:
    import functools

    class Step:
        def __init__(self) -> None:
            self.cache: list[torch.Tensor] = []

        def __call__(self) -> None:
            self.cache.append(torch.ones(8))  # LEAK-callable

    def add(store: list[torch.Tensor]) -> None:
        store.append(torch.ones(8))  # LEAK-partial

    assert_leak(dk.find_leaks(Step()), "self.cache", "growing_container", "LEAK-callable")
    assert_leak(dk.find_leaks(functools.partial(add, [])), "args[0]", "growing_container", "LEAK-partial")


def test_watch_must_be_a_dict() -> None:
    with pytest.raises(dk.InvalidValueError, match="watch=3"):
        dk.LeakDetector(watch=3)  # type: ignore[arg-type]
