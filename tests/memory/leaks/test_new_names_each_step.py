"""A new attribute name every step is a growing container: the object's attribute dict.

``setattr(model, f"act_{step}", h)`` keeps every step's activation under a name of its own, and
``model.add_module(f"probe_{step}", nn.Linear(...))`` every step's parameters: no container of
the user's grows, each name holds one fixed tensor, yet the object's ``__dict__`` (a module's
``_modules``) gains a key every step. The leak finder measures an attribute dict by the names it
gained since it was first seen, so both are named (``model.__dict__``, ``model._modules``), with
the line, a fix that fits and the size; an attribute overwritten under the same name, or a fixed
set of them, stays silent. Through ``dk.find_leaks``, a ``dk.LeakDetector`` hand loop and the
Lightning callback.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import devicekit as dk
from devicekit.memory.leaks.measure import NODE_BYTES

SOURCE = Path(__file__).read_text().splitlines()
ROWS, WIDTH = 32, 256
ACT_BYTES = ROWS * WIDTH * 4  # one activation h: float32 [32, 256]
PROBE_BYTES = (WIDTH * WIDTH + WIDTH) * 4  # one nn.Linear(256, 256): weight and bias


def line_of(marker: str) -> int:
    hits = [i + 1 for i, text in enumerate(SOURCE) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return hits[0]


def storage(leak: dk.Leak) -> float:
    """Bytes per step without the estimate for autograd nodes."""
    return leak.bytes_per_step - leak.nodes_per_step * NODE_BYTES


def make(kind: str) -> Callable[[], None]:
    """One training step that keeps (or not) what it makes under new names; ``kind`` says how."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(ROWS, 64), torch.randint(0, 10, (ROWS,))
    state = types.SimpleNamespace()
    count = [0]

    def step() -> None:
        count[0] += 1
        n = count[0]
        h = model[1](model[0](x))
        loss = F.cross_entropy(model[2](h), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if kind == "module_attr":
            setattr(model, f"act_{n}", h)  # NEW-module_attr
        elif kind == "namespace_attr":
            setattr(state, f"act_{n}", h.detach())  # NEW-namespace_attr
        elif kind == "submodule":
            model.add_module(f"probe_{n}", nn.Linear(WIDTH, WIDTH))  # NEW-submodule
        elif kind == "same_name":
            model.last_act = h.detach()
            state.last_act = h
            model.add_module("probe", nn.Linear(WIDTH, WIDTH))
        elif kind == "fixed_set":
            setattr(model, f"slot_{n % 3}", h.detach())
            setattr(state, f"slot_{n % 3}", h)
            state.loss = loss.item()
    return step


LEAKS = {
    # kind: (holder, verdict kind, words the fix must contain, name added, storage per step)
    "module_attr": ("model.__dict__", "attr_per_step", ("new name", "model.last = x.detach()", "deque"),
                    "act_1", ACT_BYTES),
    "namespace_attr": ("state.__dict__", "attr_per_step", ("new name", "state.last", "deque"), "act_1", ACT_BYTES),
    "submodule": ("model._modules", "module_per_step", ("submodule", "create it once"), "probe_1", PROBE_BYTES),
}


def assert_found(report: dk.LeakReport, kind: str, holder: str | None = None) -> dk.Leak:
    expected, verdict_kind, words, name, size = LEAKS[kind]
    holder = holder or expected
    assert [leak.holder for leak in report.leaks] == [holder], str(report)
    assert not report.ok and not report.minor, str(report)
    leak = report.leaks[0]
    assert leak.kind == verdict_kind, str(report)
    assert leak.filename == __file__ and leak.lineno == line_of(f"NEW-{kind}"), str(report)
    assert name in leak.detail, str(report)
    for word in words:
        assert word in leak.fix, f"{word!r} not in the fix: {leak.fix}"
    assert abs(storage(leak) - size) <= 0.2 * size, (size, str(report))
    return leak


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_find_leaks_names_the_object_that_gains_a_name_every_step(kind: str) -> None:
    report = dk.find_leaks(make(kind), steps=6, warmup=2)
    assert_found(report, kind)
    assert "(no holder found)" not in str(report)


@pytest.mark.parametrize("kind", sorted(LEAKS))
def test_a_hand_loop_names_the_object_that_gains_a_name_every_step(kind: str) -> None:
    step = make(kind)
    with dk.LeakDetector(warmup=2) as ld:
        for _ in range(6):
            step()
            ld.step()
    report = ld.report()
    # the hand loop sees the step function, not `model`: its closure names it the same way
    assert_found(report, kind)


@pytest.mark.parametrize("kind", ["same_name", "fixed_set"])
def test_an_attribute_overwritten_or_a_fixed_set_of_them_is_silent(kind: str) -> None:
    report = dk.find_leaks(make(kind), steps=6, warmup=2)
    assert report.ok and not report.leaks and not report.minor, str(report)
    step = make(kind)
    with dk.LeakDetector(warmup=2) as ld:
        for _ in range(6):
            step()
            ld.step()
    assert ld.report().ok, str(ld.report())


def test_an_object_deeper_than_the_named_walk_is_found_from_the_memory() -> None:
    """``run.a.b.c`` is three attributes deep (the named walk goes two): the tensors that survive
    every step are traced back to the attribute dict that keeps them."""
    torch.manual_seed(0)
    model = nn.Linear(64, WIDTH)
    x = torch.randn(ROWS, 64)
    run = types.SimpleNamespace(a=types.SimpleNamespace(b=types.SimpleNamespace(c=types.SimpleNamespace())))
    count = [0]

    def step() -> None:
        count[0] += 1
        h = model(x).relu()
        h.sum().backward()
        setattr(run.a.b.c, f"act_{count[0]}", h.detach())  # NEW-deep

    report = dk.find_leaks(step, steps=8, warmup=2)
    assert [(leak.holder, leak.kind, leak.lineno) for leak in report.leaks] == [
        ("run.a.b.c.__dict__", "attr_per_step", line_of("NEW-deep"))], str(report)
    assert abs(storage(report.leaks[0]) - ACT_BYTES) <= 0.2 * ACT_BYTES, str(report)


# -- the Lightning callback: the same cases kept on the LightningModule ---------------------------

lightning = pytest.importorskip("lightning")

from tests.integrations.leak_zoo_frameworks import lightning_growth, lightning_report  # noqa: E402
from tests.memory.leaks.owner_zoo import Owner, Spec, relative  # noqa: E402


class NewAttributeEveryStep(Owner):
    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.n = getattr(self, "n", 0) + 1
        out = self.net(x)
        setattr(self, f"act_{self.n}", out.detach())  # NEW-owner_attr
        return F.mse_loss(out, y)


class NewSubmoduleEveryStep(Owner):
    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.n = getattr(self, "n", 0) + 1
        self.add_module(f"probe_{self.n}", nn.Linear(32, 32))  # NEW-owner_submodule
        return F.mse_loss(self.net(x), y)


class SameAttributeEveryStep(Owner):
    def grow(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = self.net(x)
        self.last_out = out.detach()
        self.add_module("probe", nn.Linear(32, 32))
        return F.mse_loss(out, y)


@pytest.mark.parametrize(("spec", "marker"), [
    (Spec(NewAttributeEveryStep, "__dict__", "attr_per_step"), "NEW-owner_attr"),
    (Spec(NewSubmoduleEveryStep, "_modules", "module_per_step"), "NEW-owner_submodule"),
], ids=["attribute", "submodule"])
def test_the_lightning_callback_names_a_new_name_every_step(spec: Spec, marker: str) -> None:
    report = lightning_report(spec)
    assert [(relative(leak.holder), leak.kind, leak.lineno) for leak in report.leaks] == [
        (spec.holder, spec.kind, line_of(marker))], str(report)
    truth = lightning_growth(spec)
    leak = report.leaks[0]
    assert abs(storage(leak) - truth) <= 0.2 * truth, (truth, str(report))


def test_the_lightning_callback_is_silent_on_an_attribute_overwritten_every_step() -> None:
    report = lightning_report(Spec(SameAttributeEveryStep))
    assert report.ok and not report.leaks and not report.minor and not report.notes, str(report)
