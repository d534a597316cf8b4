"""The op memo of the fake step (devicekit.memory.fake_memo): every replayed op gives what the
real fake dispatch gives, and the estimate is the same with it as without it, byte for byte."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import devicekit as dk
from devicekit.memory import fake_memo
from devicekit.memory.fake_memo import OpMemo
from tests.memory.zoo import ZOO

aten = torch.ops.aten


class _Memoized(TorchDispatchMode):
    """A dispatch mode above ``fake_mode`` that replays through an OpMemo, as the tracker does."""

    def __init__(self, fake_mode: FakeTensorMode) -> None:
        super().__init__()
        self.memo = OpMemo(fake_mode)
        self.replayed: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = self.memo.replay(func, args, kwargs)
        if out is not OpMemo.MISS:
            self.replayed.append(str(func))
            return out
        out = func(*args, **kwargs)
        self.memo.remember(func, args, kwargs, out)
        return out


def _run(fn: Any) -> tuple[Any, _Memoized]:
    fake_mode = FakeTensorMode()
    memo_mode = _Memoized(fake_mode)
    with fake_mode, memo_mode:
        out = fn()
    return out, memo_mode


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def test_a_new_tensor_op_is_replayed_at_any_storage_offset() -> None:
    def fn() -> Any:
        states = torch.empty(4, 3, 8).unbind(0)     # four views at offsets 0, 24, 48, 72
        w = torch.empty(8, 8)
        return [s @ w for s in states]

    outs, mode = _run(fn)
    assert mode.replayed.count("aten.mm.default") == 3     # the first is dispatched, then replayed
    assert all(o.shape == (3, 8) and o.storage_offset() == 0 for o in outs)
    assert len({_storage(o) for o in outs}) == 4              # each a storage of its own


def test_an_in_place_op_gives_back_its_argument() -> None:
    def fn() -> Any:
        a, b = torch.empty(5, 6), torch.empty(5, 6)
        first = a.add_(b)
        return a, first, a.add_(b)

    (a, first, second), mode = _run(fn)
    assert "aten.add_.Tensor" in mode.replayed
    assert first is a and second is a


def test_a_view_lies_on_its_arguments_storage() -> None:
    def fn() -> Any:
        x, y = torch.empty(6, 4), torch.empty(6, 4)
        return x, y, x.t(), y.t()

    (x, y, xt, yt), mode = _run(fn)
    assert "aten.t.default" in mode.replayed
    assert _storage(yt) == _storage(y) and _storage(xt) == _storage(x)
    assert yt.shape == (4, 6) and yt.stride() == (1, 4)


def test_a_view_its_schema_does_not_name_is_found_out_and_keyed_by_offset() -> None:
    """``unsafe_split`` returns views with no alias annotation: the first call tells, and the
    views then built lie on the right storage at the right offsets."""
    def fn() -> Any:
        rows = [torch.empty(2, 12) for _ in range(3)] + list(torch.empty(2, 2, 12).unbind(0))
        return rows, [torch.ops.aten.unsafe_split.Tensor(r, 4, 1) for r in rows]

    (rows, splits), mode = _run(fn)
    assert aten.unsafe_split.Tensor in mode.memo._offsets
    # replayed for the third fresh row and the first unbound one (offset 0 as well), not the second
    assert mode.replayed.count("aten.unsafe_split.Tensor") == 2
    for row, parts in zip(rows, splits, strict=True):
        assert [p.storage_offset() for p in parts] == [row.storage_offset() + 4 * i for i in range(3)]
        assert all(_storage(p) == _storage(row) for p in parts)


@pytest.mark.parametrize("func, why", [
    (aten.nonzero.default, "data-dependent shape"),
    (aten.add.out, "writes its out= argument"),
    (aten.t_.default, "an in-place view"),
    (aten.resize_.default, "changes its argument's shape"),
    (aten._resize_output_.default, "changes its argument's shape, though not tagged a view"),
])
def test_ops_it_must_not_replay_are_never_keyed(func: Any, why: str) -> None:
    assert fake_memo._classify(func) == fake_memo._SKIP, why


def test_a_constant_argument_is_not_keyed() -> None:
    """A small constant made in the step carries its value (a comparison reads it): such an op
    always goes to torch, which keeps the value."""
    def fn() -> Any:
        c = torch.tensor(3.0)                # one element: torch keeps its value
        return c * 2, c * 2

    (a, b), mode = _run(fn)
    assert mode.replayed == []
    assert a.constant is not None and b.constant is not None


class _BiLSTM(torch.nn.Module):
    """Two bidirectional layers with dropout between them (oneDNN's LSTM, four calls a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(32, 64, 2, bidirectional=True, batch_first=True, dropout=0.1)
        self.head = torch.nn.Linear(128, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0][:, -1])


class _GRUCellLoop(torch.nn.Module):
    """A hand-written recurrence: the same cell over each time step's slice (views at offsets)."""

    def __init__(self) -> None:
        super().__init__()
        self.cell, self.head = torch.nn.GRUCell(16, 32), torch.nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 32)
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.head(h)


def _inplace_cnn() -> torch.nn.Module:
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                         nn.Conv2d(16, 16, 3, groups=4), nn.GroupNorm(4, 16), nn.SiLU(inplace=True),
                         nn.ConvTranspose2d(16, 8, 2, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(8, 4))


#: models the memo was not built with: name -> (build, sample)
_OTHERS: dict[str, tuple[Any, Any]] = {
    "bilstm-dropout": (_BiLSTM, lambda: torch.randn(4, 20, 32)),
    "grucell-loop": (_GRUCellLoop, lambda: torch.randn(4, 30, 16)),
    "inplace-cnn": (_inplace_cnn, lambda: torch.randn(4, 3, 16, 16)),
    "nn.Transformer": (lambda: torch.nn.Transformer(32, 2, 1, 1, 64, batch_first=True),
                       lambda: (torch.randn(4, 10, 32), torch.randn(4, 7, 32))),
}


def _zoo_model(name: str) -> tuple[torch.nn.Module, Any, Any, Any]:
    torch.manual_seed(0)
    if name in _OTHERS:
        build, sample = _OTHERS[name]
        return build(), sample(), None, None
    case = ZOO[name]
    return case.build(), case.sample(4), case.loss, case.precision


#: the zoo (but the MoE routed by values: sized by real steps) and the others
_CASES = sorted(n for n in ZOO if n != "moe-routed") + sorted(_OTHERS)


@pytest.mark.parametrize("name", _CASES)
def test_every_replayed_op_matches_the_real_dispatch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, sample, loss, precision = _zoo_model(name)
    replay = OpMemo.replay
    wrong: Counter[str] = Counter()
    hits = Counter[str]()

    def checked(self: OpMemo, func: Any, args: Any, kwargs: Any) -> Any:
        out = replay(self, func, args, kwargs)
        if out is not OpMemo.MISS:
            hits[str(func)] += 1
            if not fake_memo._same(out, func(*args, **kwargs), fake_memo._tensors(args)):
                wrong[str(func)] += 1
        return out

    monkeypatch.setattr(OpMemo, "replay", checked)
    dk.estimate_memory(model, sample, loss_fn=loss, precision=precision)
    assert sum(hits.values()) > 0
    assert not wrong, wrong


@pytest.mark.parametrize("name", _CASES)
def test_the_estimate_is_the_same_without_the_memo(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """...and the same whether torch's own fake-tensor cache (one for the process) has seen the
    ops or not: an op whose meta kernel and cached replay differed (oneDNN's LSTM backward gave
    one bias gradient tensor twice, then two) made the first estimate in a process differ."""
    model, sample, loss, precision = _zoo_model(name)
    FakeTensorMode.cache.clear()
    first = dk.estimate_memory(model, sample, loss_fn=loss, precision=precision)
    again = dk.estimate_memory(model, sample, loss_fn=loss, precision=precision)
    monkeypatch.setattr(OpMemo, "replay", lambda self, *a: OpMemo.MISS)
    without = dk.estimate_memory(model, sample, loss_fn=loss, precision=precision)
    FakeTensorMode.cache.clear()
    cold = dk.estimate_memory(model, sample, loss_fn=loss, precision=precision)
    assert len({(e.peak, tuple(e.parts.items()), e.peak_phase) for e in (first, again, without, cold)}) == 1


@pytest.mark.parametrize("name", ["gru-lm", "gpt-tied"])
def test_the_estimate_does_not_depend_on_when_the_garbage_collector_runs(name: str) -> None:
    """A reference cycle in the step's own machinery (a recursive closure that saw tensors) keeps
    them counted until a collection: the estimate then depends on when the collector ran."""
    import gc

    model, sample, loss, precision = _zoo_model(name)
    peaks = []
    threshold = gc.get_threshold()
    try:
        for eager in (False, True):
            gc.collect()
            gc.enable()
            gc.set_threshold(*((5, 1, 1) if eager else threshold))
            if not eager:
                gc.disable()
            peaks.append(dk.estimate_memory(model, sample, loss_fn=loss, precision=precision).peak)
    finally:
        gc.set_threshold(*threshold)
        gc.enable()
    assert peaks[0] == peaks[1]
