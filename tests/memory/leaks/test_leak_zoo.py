"""A zoo of leaks as users write them, and clean look-alikes: every leak named, every clean loop silent.

Each leak case marks the line the finder must name with ``# LEAK-<case>``; each returns the
report, the holder it must name, and the kind (None: any kind). Clean cases return the report
only. Every case grows by a few KB per step and runs in well under a second.
"""

from __future__ import annotations

import collections
import functools
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk

SOURCE = Path(__file__).read_text().splitlines()
X = torch.randn(8, 16)


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def train(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> torch.Tensor:
    loss = model(X).pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()
    else:
        model.zero_grad(set_to_none=True)
    return loss


# -- module-level classes (where users define them) -------------------------------------------

class CachingNet(nn.Module):
    cache: list[torch.Tensor] = []

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        CachingNet.cache.append(out)  # LEAK-class-attribute
        return out


class TimeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 16)

    @functools.lru_cache  # noqa: B019 - the leak under test
    def time_embedding(self, t: int) -> torch.Tensor:
        return self.fc(torch.full((1, 1), float(t))).expand(8, 16)

    def forward(self, x: torch.Tensor, t: int) -> torch.Tensor:
        return x + self.time_embedding(t)  # LEAK-lru-cache


class Meter:
    """A metrics object as users write them."""

    def __init__(self) -> None:
        self.values: list[torch.Tensor] = []

    def update(self, value: torch.Tensor) -> None:
        self.values.append(value)  # LEAK-metrics-object


class CachedDataset(torch.utils.data.Dataset[torch.Tensor]):
    def __init__(self) -> None:
        self.cache: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> torch.Tensor:
        if index not in self.cache:
            self.cache[index] = torch.randn(16)  # LEAK-dataset-cache
        return self.cache[index]


class Node:
    def __init__(self) -> None:
        self.me = self
        self.payload = torch.randn(256)


OUTPUTS: dict[int, torch.Tensor] = {}


# -- leaks ------------------------------------------------------------------------------------

Case = tuple[dk.LeakReport, str, str | None]


def leak_hook_per_step() -> Case:
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o: feats.append(o))  # LEAK-hook-per-step
        train(model)

    return dk.find_leaks(step), "model.1._forward_hooks", "hook_per_step"


def leak_class_attribute() -> Case:
    model = CachingNet()
    CachingNet.cache.clear()
    try:
        return dk.find_leaks(lambda: train(model)), "CachingNet.cache", "class_attribute"
    finally:
        CachingNet.cache.clear()


def leak_deferred_closure() -> Case:
    model = small()
    pending_logs: list[Callable[[], None]] = []

    def step() -> None:
        out = model(X)
        out.pow(2).mean().backward()
        pending_logs.append(lambda out=out: print(out.mean()))  # LEAK-deferred-closure

    return dk.find_leaks(step), "pending_logs", "deferred_closure"


def leak_lru_cache() -> Case:
    model = TimeNet()

    def step(index: int) -> None:
        model(X, index).pow(2).mean().backward()

    return dk.find_leaks(step), "TimeNet.time_embedding", "lru_cache"


def leak_param_groups() -> Case:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        extra = torch.zeros(256, requires_grad=True)
        opt.add_param_group({"params": [extra]})  # LEAK-param-groups
        train(model, opt)

    return dk.find_leaks(step), "opt.param_groups", "param_groups"


def leak_defaultdict_history() -> Case:
    model = small()
    history: collections.defaultdict[str, list[torch.Tensor]] = collections.defaultdict(list)

    def step() -> None:
        history["loss"].append(train(model))  # LEAK-defaultdict-history

    return dk.find_leaks(step), "history['loss']", None


def leak_total_plus_loss() -> Case:
    model = small()
    state: dict[str, Any] = {"total": 0}

    def step() -> None:
        loss = model(X).pow(2).mean()
        state["total"] = state["total"] + loss  # LEAK-total-plus-loss

    return dk.find_leaks(step), "state['total']", "autograd_graph"


def leak_gradient_clones() -> Case:
    model = small()
    grads: list[list[torch.Tensor]] = []

    def step() -> None:
        train_no_zero = model(X).pow(2).mean()
        train_no_zero.backward()
        grads.append([p.grad.clone() for p in model.parameters()])  # LEAK-gradient-clones
        model.zero_grad()

    return dk.find_leaks(step), "grads", "growing_container"


def leak_metrics_object() -> Case:
    model = small()
    meter = Meter()

    def step() -> None:
        meter.update(train(model))

    return dk.find_leaks(step), "meter.values", None


errors: list[Exception] = []


def leak_exception_frames() -> Case:
    model = small()
    errors.clear()

    def step() -> None:
        activation = model(X)
        try:
            raise ValueError(f"bad batch {activation.shape}")
        except ValueError as error:
            errors.append(error)  # LEAK-exception-frames

    try:
        return dk.find_leaks(step), "errors", "exception_frames"
    finally:
        errors.clear()


def leak_anomaly_mode_outputs() -> Case:
    model = small()
    kept: list[torch.Tensor] = []

    def step() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.set_detect_anomaly(True):
                loss = model(X).pow(2).mean()
        kept.append(loss)  # LEAK-anomaly-mode-outputs

    return dk.find_leaks(step), "kept", "growing_container"


def leak_dataset_cache() -> Case:
    model = small()
    loader = torch.utils.data.DataLoader(CachedDataset(), batch_size=8, shuffle=False)
    batches = iter(loader)

    def step() -> None:
        batch = next(batches)
        model(batch).pow(2).mean().backward()

    return dk.find_leaks(step), "loader.dataset.cache", "growing_container"


def leak_buffer_per_step() -> Case:
    model = small()

    def step(index: int) -> None:
        model.register_buffer(f"seen_{index}", torch.randn(64))  # LEAK-buffer-per-step
        train(model)

    return dk.find_leaks(step), "model._buffers", "buffer_per_step"


def leak_retained_hidden_state() -> Case:
    cell = nn.Linear(16, 16)
    state = {"h": torch.zeros(8, 16)}

    def step() -> None:
        state["h"] = torch.tanh(cell(X) + state["h"])  # LEAK-retained-hidden-state
        state["h"].sum().backward(retain_graph=True)

    return dk.find_leaks(step), "state['h']", "autograd_graph"


def leak_global_dict_by_step() -> Case:
    model = small()
    OUTPUTS.clear()

    def step(index: int) -> None:
        OUTPUTS[index] = model(X).detach()  # LEAK-global-dict-by-step

    try:
        return dk.find_leaks(step), "OUTPUTS", "growing_container"
    finally:
        OUTPUTS.clear()


def leak_growing_cat() -> Case:
    state = {"buffer": torch.zeros(0, 16)}

    def step() -> None:
        state["buffer"] = torch.cat([state["buffer"], X])  # LEAK-growing-cat

    return dk.find_leaks(step), "state['buffer']", "growing_tensor"


def leak_set_of_outputs() -> Case:
    model = small()
    seen: set[torch.Tensor] = set()

    def step() -> None:
        seen.add(model(X).detach())  # LEAK-set-of-outputs

    return dk.find_leaks(step), "seen", "growing_container"


def leak_unbounded_deque() -> Case:
    model = small()
    recent: collections.deque[torch.Tensor] = collections.deque()

    def step() -> None:
        recent.append(model(X).detach())  # LEAK-unbounded-deque

    return dk.find_leaks(step), "recent", "growing_container"


def leak_eval_without_no_grad() -> Case:
    model = small()
    predictions: list[torch.Tensor] = []
    with dk.LeakDetector() as ld:
        for _ in range(6):
            predictions.append(model(X))  # LEAK-eval-without-no-grad
            ld.step()
    return ld.report(), "predictions", "growing_container"


def leak_reference_cycle() -> Case:
    def step() -> None:
        node = Node()  # LEAK-reference-cycle
        assert node.payload.numel() == 256

    return dk.find_leaks(step), "Node.payload", "reference_cycle"


def leak_mutable_default() -> Case:
    model = small()

    def log_output(out: torch.Tensor, _seen: list[torch.Tensor] = []) -> None:  # noqa: B006
        _seen.append(out)  # LEAK-mutable-default

    def step() -> None:
        log_output(model(X).detach())

    return dk.find_leaks(step), "log_output.__defaults__[0]", "growing_container"


def leak_hook_in_hand_written_loop() -> Case:
    model = small()
    with dk.LeakDetector() as ld:
        for _ in range(6):
            captured: list[torch.Tensor] = []
            hook = functools.partial(lambda store, m, i, o: store.append(o), captured)
            model[0].register_forward_hook(hook)  # LEAK-hook-in-hand-written-loop
            train(model)
            ld.step()
    return ld.report(), "model.0._forward_hooks", "hook_per_step"


LEAKS = {name[len("leak_"):]: fn for name, fn in list(globals().items()) if name.startswith("leak_")}


@pytest.mark.parametrize("case", sorted(LEAKS))
def test_leak_is_named_with_holder_and_line(case: str) -> None:
    report, holder, kind = LEAKS[case]()
    leak = report.leak(holder)
    assert leak is not None, f"{holder} not reported:\n{report}"
    if kind is not None:
        assert leak.kind == kind, str(report)
    marker = f"LEAK-{case.replace('_', '-')}"
    assert (leak.filename, leak.lineno) == (__file__, line_of(marker)), str(report)
    assert leak.bytes_per_step > 0 and leak.fix
    assert leak.severity == "leak"
    assert report.leaks[0].bytes_per_step >= leak.bytes_per_step  # ranked by rate
    assert not report.ok
    assert not [note for note in report.notes if "no holder found" in note], str(report)


# -- clean look-alikes ------------------------------------------------------------------------

def clean_bounded_dict_cache() -> dk.LeakReport:
    cache: dict[int, torch.Tensor] = {}

    def step(index: int) -> None:
        cache.setdefault(index % 3, torch.randn(32, 32))

    return dk.find_leaks(step, steps=8)


def clean_ema_in_place() -> dk.LeakReport:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ema = {name: p.detach().clone() for name, p in model.named_parameters()}

    def step() -> None:
        train(model, opt)
        with torch.no_grad():
            for name, p in model.named_parameters():
                ema[name].mul_(0.9).add_(p, alpha=0.1)

    return dk.find_leaks(step)


def clean_big_temporaries_freed() -> dk.LeakReport:
    def step() -> None:
        big = torch.randn(256, 256)
        assert (big @ big).sum().item() != 1.5

    return dk.find_leaks(step)


def clean_deque_with_maxlen() -> dk.LeakReport:
    model = small()
    recent: collections.deque[torch.Tensor] = collections.deque(maxlen=2)

    def step() -> None:
        recent.append(train(model).detach())

    return dk.find_leaks(step, steps=7)


def clean_hook_registered_once() -> dk.LeakReport:
    model = small()
    feats: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, i, o: feats.append(o.detach()))

    def step() -> None:
        train(model)
        feats.clear()

    return dk.find_leaks(step)


def clean_hook_removed_every_step() -> dk.LeakReport:
    model = small()

    def step() -> None:
        feats: list[torch.Tensor] = []
        handle = model[1].register_forward_hook(lambda m, i, o: feats.append(o))
        train(model)
        handle.remove()

    return dk.find_leaks(step)


@functools.lru_cache(maxsize=4)
def positions(n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32)


def clean_lru_cache_same_key() -> dk.LeakReport:
    model = small()

    def step(index: int) -> None:
        (model(X) + positions(4 + index % 2)[:4]).sum().backward()

    return dk.find_leaks(step)


def clean_adam_state_and_float_losses() -> dk.LeakReport:
    model = small()
    opt = torch.optim.Adam(model.parameters())
    losses: list[float] = []
    with dk.LeakDetector() as ld:
        for _ in range(6):
            losses.append(train(model, opt).item())
            ld.step()
    return ld.report()


def clean_param_group_added_once() -> dk.LeakReport:
    model = small()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt.add_param_group({"params": [torch.zeros(4, requires_grad=True)]})

    def step() -> None:
        train(model, opt)

    return dk.find_leaks(step)


def clean_exception_handled_not_kept() -> dk.LeakReport:
    model = small()
    skipped = {"count": 0}

    def step() -> None:
        activation = model(X)
        try:
            raise ValueError(f"bad batch {activation.shape}")
        except ValueError:
            skipped["count"] += 1

    return dk.find_leaks(step)


CLEAN = {name[len("clean_"):]: fn for name, fn in list(globals().items()) if name.startswith("clean_")}


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_clean_look_alike_is_silent(case: str) -> None:
    report = CLEAN[case]()
    assert report.ok, str(report)
    assert not report.minor, str(report)
    assert not [note for note in report.notes if "no holder found" in note], str(report)


def test_zoo_is_big_enough() -> None:
    assert len(LEAKS) >= 20 and len(CLEAN) >= 8


# -- the same answers however the detector is driven ------------------------------------------

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
