"""to_device / pin_memory / device_of: the cases the property tests do not generate."""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.placement import devices


def test_module_moves_in_place_and_is_returned() -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    out = dk.to_device(model, "meta")
    assert out is model
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"meta"}


def test_module_inside_a_batch_is_the_same_object() -> None:
    model = nn.Linear(2, 2)
    out = dk.to_device({"model": model, "x": torch.ones(2)}, "meta")
    assert out["model"] is model and model.weight.device.type == "meta"


def test_tensor_on_target_is_returned_without_copy() -> None:
    t = torch.ones(3)
    assert dk.to_device(t, "cpu") is t
    assert dk.to_device([t], torch.device("cpu"))[0] is t


def test_same_container_twice_stays_shared_and_cycles_terminate() -> None:
    shared = [torch.ones(2)]
    batch: dict[str, Any] = {"a": shared, "b": shared}
    batch["self"] = batch
    out = dk.to_device(batch, "meta")
    assert out["a"] is out["b"]
    assert out["self"] is out
    assert out["a"][0].device.type == "meta"


def test_defaultdict_keeps_factory_and_still_defaults() -> None:
    batch = defaultdict(list, {"x": torch.ones(1)})
    out = dk.to_device(batch, "meta")
    assert isinstance(out, defaultdict) and out.default_factory is list
    assert out["missing"] == []


def test_frozen_dataclass_with_init_false_field() -> None:
    @dataclasses.dataclass(frozen=True)
    class Item:
        x: torch.Tensor
        derived: int = dataclasses.field(init=False, default=7)

    out = dk.to_device(Item(torch.ones(2)), "meta")
    assert out.x.device.type == "meta" and out.derived == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.x = torch.ones(1)  # type: ignore[misc]


def test_torch_size_and_return_types_are_handled() -> None:
    values = torch.max(torch.arange(6.0).reshape(2, 3), dim=1)
    out = dk.to_device({"shape": torch.Size([2, 3]), "max": values}, "meta")
    assert out["shape"] == torch.Size([2, 3]) and type(out["shape"]) is torch.Size
    assert type(out["max"]) is type(values) and out["max"].values.device.type == "meta"


class OldStyle:
    """A .to() that does not take non_blocking (like old third-party batch classes)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def to(self, device: Any) -> OldStyle:
        self.calls.append(device)
        return self


def test_to_object_without_non_blocking_still_moves() -> None:
    obj = OldStyle()
    assert dk.to_device(obj, "meta", non_blocking=True) is obj
    assert obj.calls == [torch.device("meta")]


def test_to_object_type_error_of_its_own_is_not_hidden() -> None:
    class Broken:
        def to(self, device: Any, non_blocking: bool = False) -> Any:
            raise TypeError("bad shape")

    with pytest.raises(TypeError, match="bad shape"):
        dk.to_device(Broken(), "meta", non_blocking=True)


def test_readonly_mapping_that_cannot_be_rebuilt_is_a_clear_error() -> None:
    from collections.abc import Mapping

    class Odd(Mapping):
        def __init__(self, a: Any, b: Any) -> None:
            self._d = {"a": a}

        def __getitem__(self, k: Any) -> Any:
            return self._d[k]

        def __iter__(self) -> Any:
            return iter(self._d)

        def __len__(self) -> int:
            return 1

    with pytest.raises(dk.PlacementError, match="Odd"):
        dk.to_device(Odd(torch.ones(1), 2), "meta")


def test_bad_device_is_rejected_before_anything_moves() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(dk.InvalidDeviceError, match="gpu:1"):
        dk.to_device(model, "gpu:1")
    assert model.weight.device.type == "cpu"


def test_unhashable_skip_keys_is_a_one_line_error() -> None:
    with pytest.raises(dk.InvalidValueError, match=r"skip_keys=\[\['meta'\]\]"):
        dk.to_device({"meta": torch.ones(1)}, "cpu", skip_keys=[["meta"]])


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """cuda:0 'exists' and Tensor.to/is_pinned are recorded instead of run."""
    monkeypatch.setattr(devices, "_count", lambda kind: 1)
    monkeypatch.setattr(devices, "_KNOWN_GOOD", {})
    calls: list[tuple[str, Any]] = []
    pinned: set[int] = set()

    def fake_to(self: torch.Tensor, device: Any, non_blocking: bool = False) -> torch.Tensor:
        calls.append((str(device), non_blocking))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: id(self) in pinned)
    calls.append(("pinned", pinned))
    return calls


def test_non_blocking_auto_is_async_to_cuda_without_asking_each_tensor(
        fake_cuda: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 38: on the H200 a nested pinned batch took 2.90 ms against accelerate's 2.01 ms;
    one per-tensor cost was ``is_pinned()`` (CUDA driver calls on a GPU machine). Host to CUDA
    is asynchronous for pinned and pageable memory alike (CUDA stages pageable memory before
    returning), so the question is never asked."""
    _, pinned = fake_cuda.pop(0)
    asked: list[int] = []
    monkeypatch.setattr(torch.Tensor, "is_pinned",
                        lambda self: asked.append(id(self)) or id(self) in pinned)
    fast, slow = torch.ones(2), torch.ones(2)
    pinned.add(id(fast))
    out = dk.to_device({"a": [fast, slow], "b": (fast,)}, "cuda:0")
    assert fake_cuda == [("cuda:0", True), ("cuda:0", True)]  # one copy of `fast`: aliasing kept
    assert out["a"][0] is out["b"][0] and asked == []
    fake_cuda.clear()
    dk.to_device([fast, slow], "cuda:0", non_blocking=False)
    assert fake_cuda == [("cuda:0", False), ("cuda:0", False)]
    fake_cuda.clear()
    dk.to_device([slow], "cuda:0", non_blocking=True)
    assert fake_cuda == [("cuda:0", True)]
    fake_cuda.clear()
    dk.to_device([torch.ones(2, device="meta")], "cpu")  # to the host: the host reads it next
    assert fake_cuda == [("cpu", False)] and asked == []


def test_a_moved_tensor_costs_one_python_call() -> None:
    """The per-leaf cost of a batch, counted instead of timed: each tensor that moves costs the
    move itself and nothing more in Python (no dispatch, memo or policy layers per tensor)."""
    import sys
    from collections import Counter

    batch = {"samples": [{"x": torch.ones(1), "pair": (torch.ones(1), torch.ones(1)), "id": i,
                          "name": f"s{i}"} for i in range(50)],
             "extra": [torch.ones(1) for _ in range(50)], "lengths": list(range(8))}
    python: Counter[str] = Counter()
    builtin: Counter[str] = Counter()

    def count(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            python[frame.f_code.co_name] += 1
        elif event == "c_call":
            builtin[getattr(arg, "__name__", "?")] += 1

    sys.setprofile(count)
    try:
        out = dk.to_device(batch, "meta")
    finally:
        sys.setprofile(None)
    assert out["samples"][3]["pair"][1].device.type == "meta" and out["samples"][3]["id"] == 3
    tensors, containers = 200, 1 + 2 + 50 * 2 + 1
    assert python["_move_tensor"] == tensors and builtin["to"] == tensors
    assert builtin["is_pinned"] == 0
    # per container: its handler, the dispatch to it, Walk.each and its comprehension (Python);
    # its memo lookups and its items (C); per tensor: id, the memo entry and the copy (C)
    assert sum(python.values()) <= tensors + 4 * containers + 10, python.most_common(6)
    assert sum(builtin.values()) <= 3 * tensors + 6 * containers + 10, builtin.most_common(6)


def test_pin_memory_without_accelerator_returns_input(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "accelerator_type", lambda: None)
    from devicekit.placement import transfer

    monkeypatch.setattr(transfer, "accelerator_type", lambda: None)
    batch = {"x": torch.ones(2)}
    assert dk.pin_memory(batch) is batch


def test_pin_memory_pins_every_host_tensor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.placement import transfer

    monkeypatch.setattr(transfer, "accelerator_type", lambda: "cuda")
    pinned: list[int] = []

    def fake_pin(self: torch.Tensor) -> torch.Tensor:
        pinned.append(id(self))
        return self.clone()

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)
    t = torch.ones(2)
    model = nn.Linear(1, 1)
    out = dk.pin_memory({"a": t, "b": (t, "text"), "model": model, "meta": torch.ones(1, device="meta")})
    assert pinned == [id(t)]
    assert out["a"] is out["b"][0] and out["b"][1] == "text" and out["model"] is model


def test_device_of_tensor_module_and_batch() -> None:
    assert dk.device_of(torch.ones(1)) == torch.device("cpu")
    assert dk.device_of(nn.Linear(2, 2)) == torch.device("cpu")
    assert dk.device_of({"x": [torch.ones(1), (torch.ones(1), "s")]}) == torch.device("cpu")


def test_device_of_spread_module_names_the_devices() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(dk.PlacementError) as info:
        dk.device_of(model)
    message = str(info.value)
    assert "Sequential" in message and "cpu, meta" in message and "\n" not in message


def test_device_of_without_tensors_is_an_error() -> None:
    with pytest.raises(dk.PlacementError, match="no tensors"):
        dk.device_of(nn.ReLU())
    with pytest.raises(dk.PlacementError, match="no tensors"):
        dk.device_of({"a": 1})


def test_packed_sequence_and_counter() -> None:
    from collections import Counter

    from torch.nn.utils.rnn import pack_sequence

    packed = pack_sequence([torch.ones(3), torch.ones(2)])
    out = dk.to_device({"seq": packed, "counts": Counter(a=2)}, "meta")
    assert type(out["seq"]) is type(packed) and out["seq"].data.device.type == "meta"
    assert type(out["counts"]) is Counter and out["counts"]["a"] == 2


# -- ported from Lightning's tests_fabric/utilities/test_apply_func.py (move_data_to_device)


@pytest.mark.parametrize("should_return", [False, True])
def test_wrongly_implemented_transferable_data_type(should_return: bool) -> None:
    # Lightning's test of the same name: a .to() that works in place and forgets `return self`
    class TensorObject:
        def __init__(self, tensor: torch.Tensor, should_return: bool = True) -> None:
            self.tensor = tensor
            self.should_return = should_return

        def to(self, device: Any) -> Any:
            self.tensor = self.tensor.to(device)
            if self.should_return:
                return self
            return None

    obj = TensorObject(torch.tensor(0.1), should_return)
    assert dk.to_device(obj, torch.device("cpu")) is obj
    batch = dk.to_device({"x": obj, "y": [obj]}, "meta")  # was {"x": None, "y": [None]}
    assert batch["x"] is obj and batch["y"][0] is obj and obj.tensor.device.type == "meta"
    other = TensorObject(torch.tensor(0.1), should_return)
    assert dk.to_device([other], "cpu", non_blocking=True)[0] is other


@dataclasses.dataclass(frozen=True)
class Scaled:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


@dataclasses.dataclass
class PlainScaled:
    x: torch.Tensor

    @functools.cached_property
    def doubled(self) -> torch.Tensor:
        return self.x * 2


@pytest.mark.parametrize("cls", [Scaled, PlainScaled])
def test_cached_property_is_not_left_on_the_old_device(cls: type) -> None:
    obj = cls(torch.ones(3))
    assert obj.doubled.device.type == "cpu"  # computed and cached on the CPU
    moved = dk.to_device(obj, "meta")
    assert moved.x.device.type == "meta"
    assert moved.doubled.device.type == "meta"  # was the stale CPU tensor
    assert obj.doubled.device.type == "cpu"  # the original keeps its own cache


def test_map_tensors_keeps_every_container_type_and_sharing() -> None:
    """The package's one tree map (estimates, layer profiles): structures come back as they were."""
    import collections
    import dataclasses

    from devicekit.placement.walk import map_tensors

    Pair = collections.namedtuple("Pair", "x y")

    @dataclasses.dataclass(frozen=True)
    class Box:
        t: torch.Tensor
        name: str

    shared = torch.ones(2)
    batch = {"pair": Pair(shared, 3), "box": Box(shared, "b"), "list": [shared, "s"],
             "dd": collections.defaultdict(list, a=[torch.zeros(1)])}
    calls = []

    def double(t: torch.Tensor) -> torch.Tensor:
        calls.append(t)
        return t * 2

    out = map_tensors(batch, double)
    assert isinstance(out["pair"], Pair) and out["pair"].y == 3
    assert isinstance(out["box"], Box) and out["box"].name == "b"
    assert isinstance(out["dd"], collections.defaultdict) and out["dd"].default_factory is list
    assert torch.equal(out["pair"].x, torch.full((2,), 2.0))
    assert out["pair"].x is out["box"].t is out["list"][0]  # one tensor, mapped once
    assert len(calls) == 2
