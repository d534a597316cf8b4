"""What a check costs stays flat while a leak grows, and what makes it so never changes the answer.

A dict that gains an entry every step (a module's hook dict, ``outputs[step] = ...``) is measured
by what was added and by what each earlier hook's list gained since; a list whose inner list
grows is measured afresh (never an error); a small container of tensors without a graph that
holds the same tensors (an optimizer's state) keeps its size; a list whose last item is replaced
(``head[0] = out``) is charged to that line; a module's function keeps its closure cells as
holders (``owner.track.running``), and the globals a module's methods name are holders too.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from torch import nn

import devicekit as dk
from devicekit.memory.leaks.lines import extends, fingerprint
from devicekit.memory.leaks.measure import measure
from devicekit.memory.leaks.resume import measure_appended
from tests.memory.leaks.user_zoo_models import X, small, train

HEAD: list[torch.Tensor | None] = [None]


def test_a_hook_dict_is_resumed_and_sized_as_a_fresh_walk_would() -> None:
    model = small()
    hooks = model[1]._forward_hooks
    state = None
    for _ in range(5):
        feats: list[torch.Tensor] = []
        model[1].register_forward_hook(lambda m, i, o, feats=feats: feats.append(o.detach().clone()))
        model(X)
        size, state = measure_appended(hooks, state)
        assert state is not None
        fresh = measure(hooks)
        assert size.bytes == fresh.bytes and size.items == len(hooks), (size, fresh)  # no graphs: no grads either


def test_an_inner_list_that_grows_is_measured_afresh_not_an_error() -> None:
    history: list[list[torch.Tensor]] = [[]]
    state = None
    for step in range(1, 5):
        history[0].append(torch.randn(64))
        size, state = measure_appended(history, state)
        assert size.bytes == 256 * step


def test_a_growing_list_inside_a_list_is_found() -> None:
    history: list[list[torch.Tensor]] = [[]]

    def step() -> None:
        history[0].append(torch.randn(64))

    report = dk.find_leaks(step)
    assert report.leaks and report.leaks[0].bytes_per_step == 256, str(report)


def test_an_optimizers_state_keeps_its_size_while_it_holds_the_same_tensors() -> None:
    model = small()
    opt = torch.optim.Adam(model.parameters())
    cached: list[bool] = []
    with dk.LeakDetector() as ld:
        for _ in range(6):
            train(model, opt)
            ld.step()
            cached.append(ld._sizes.cached("opt.state"))  # noqa: SLF001 - the cache under test
    assert cached[-1] and ld.report().ok, (cached, str(ld.report()))


def test_a_list_whose_last_item_is_replaced_is_charged_to_that_line() -> None:
    kept = [torch.zeros(1)]
    before = fingerprint(kept)
    assert not extends(before, fingerprint(kept))
    kept[0] = torch.zeros(1)
    assert extends(before, fingerprint(kept))
    model = small()

    def step() -> None:
        out = model(X)
        out.prev = HEAD[0]  # type: ignore[attr-defined]  # the line that links the chain
        HEAD[0] = out

    try:
        report = dk.find_leaks(step)
    finally:
        HEAD[0] = None
    (leak,) = report.leaks
    assert leak.holder == "HEAD" and leak.kind == "tensor_attributes", str(report)
    assert leak.lineno == step.__code__.co_firstlineno + 2, str(report)  # `out.prev = HEAD[0]`


class Tracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4)
        total: torch.Tensor | float = 0.0

        def add(loss: torch.Tensor) -> None:
            nonlocal total
            total = total + loss

        self.add = add
        self.seen = collections.deque(maxlen=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        self.add(out.pow(2).mean())
        return out


def test_a_closure_cell_of_a_modules_function_is_a_holder() -> None:
    model = Tracked()

    def step() -> None:
        model(X)

    report = dk.find_leaks(step)
    (leak,) = report.leaks
    assert (leak.holder, leak.kind) == ("model.add.total", "autograd_graph"), str(report)


def test_a_chain_linked_lines_before_its_head_moves_is_charged_to_the_link() -> None:
    """Issue 45, item 11: the line that links the chain, not the one that renames its head."""
    model = small()
    kept: list[Any] = [None]

    def step() -> None:
        out = model(X)
        out.note = torch.zeros(1)  # type: ignore[attr-defined]  # a tensor attribute that links nothing
        out.prev = kept[0]  # type: ignore[attr-defined]  # the link
        loss = out.pow(2).mean()
        loss.backward()
        kept[0] = out

    report = dk.find_leaks(step)
    (leak,) = report.leaks
    assert leak.kind == "tensor_attributes", str(report)
    assert leak.lineno == step.__code__.co_firstlineno + 3, str(report)
