"""Port of torchgpipe tests/test_gpipe.py to dk.Pipeline.

Each test names the upstream test it ports. Where devicekit deliberately differs (auto balance
by default, refusing extra devices, supporting repeated layers, one-line DeviceKitErrors instead
of TypeError) the test shows the difference; docs/model-parallel.md says why.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from copy import deepcopy

import pytest
import torch
from torch import nn

import devicekit as dk


def recompute_counter() -> tuple[nn.Module, list[bool]]:
    """A layer that logs, per call, whether it is a recomputation (checkpointing's backward)."""
    from devicekit.modelparallel.recompute import is_recomputing

    log: list[bool] = []

    class Log(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            log.append(is_recomputing())
            return super().forward(x)

    return Log(1, 1), log


def test_parameters() -> None:
    """upstream test_parameters"""
    pipe = dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=1)
    assert list(pipe.parameters()) != []


def test_public_attrs() -> None:
    """upstream test_public_attrs. Difference: chunks must be an int (42.0 is refused, not
    rounded) and balance lives in the plan (plan.counts)."""
    pipe = dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ("cpu",), chunks=42, balance=(1,), checkpoint="always")
    assert pipe.plan.counts == [1]
    assert pipe.devices == [torch.device("cpu")]
    assert pipe.chunks == 42 and isinstance(pipe.chunks, int)
    assert pipe.checkpoint == "always"
    with pytest.raises(dk.InvalidValueError, match="chunks 42.0"):
        dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=42.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("balance", [[2], [1, 1]])
def test_sequential_like(balance: list[int]) -> None:
    """upstream test_sequential_like. Difference: the Pipeline is not itself a Sequential; the
    model is pipe.module (unchanged) and the parts are pipe.parts."""
    a, b = nn.Linear(1, 1), nn.Linear(1, 1)
    pipe = dk.Pipeline(nn.Sequential(a, b), ["cpu"] * len(balance), chunks=1, balance=balance)
    assert len(pipe.module) == 2 and list(pipe.module) == [a, b]
    assert pipe.module[0] is a and pipe.module[-1] is b and pipe.module[-2] is a
    assert [layer for part in pipe.parts for layer in part] == [a, b]
    with pytest.raises(IndexError):
        _ = pipe.module[2]
    with pytest.raises(TypeError):
        _ = pipe[0]  # type: ignore[index]


def test_balance_wrong_length() -> None:
    """upstream test_balance_wrong_length"""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    for balance in ([1], [3]):
        with pytest.raises(ValueError):
            dk.Pipeline(model, ["cpu"], chunks=1, balance=balance)


def test_balance_less_than_1() -> None:
    """upstream test_balance_less_than_1"""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    for balance in ([0, 2], [-1, 3]):
        with pytest.raises(ValueError, match="positive"):
            dk.Pipeline(model, ["cpu", "cpu"], chunks=1, balance=balance)


def test_chunks_less_than_1() -> None:
    """upstream test_chunks_less_than_1"""
    for chunks in (0, -1):
        with pytest.raises(ValueError, match="chunks"):
            dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=chunks)


def test_too_few_devices() -> None:
    """upstream test_too_few_devices. Difference: a ValueError naming the mismatch, not IndexError."""
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in range(4)])
    with pytest.raises(dk.InvalidValueError, match="4 entries for 1 device"):
        dk.Pipeline(model, ["cpu"], chunks=1, balance=[1, 1, 1, 1])


@pytest.mark.parametrize("batch", [7, 2])
def test_batch_size_indivisible_and_small(batch: int) -> None:
    """upstream test_batch_size_indivisible, test_batch_size_small: legal, no warning."""
    pipe = dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pipe(torch.rand(batch, 1)).shape == (batch, 1)
    assert pipe.last_run is not None and pipe.last_run.microbatches == min(batch, 4)


def test_checkpoint_mode() -> None:
    """upstream test_checkpoint_mode. Difference: torch's non-reentrant checkpoint leaves no
    CheckpointBackward node, so the recomputations are counted instead."""
    for mode, recomputed in [("always", 2), ("except_last", 1), ("never", 0)]:
        layer, log = recompute_counter()
        pipe = dk.Pipeline(nn.Sequential(layer), ["cpu"], chunks=2, checkpoint=mode)
        pipe(torch.rand(2, 1)).sum().backward()
        assert log.count(True) == recomputed, mode


def test_checkpoint_mode_invalid() -> None:
    """upstream test_checkpoint_mode_invalid"""
    with pytest.raises(ValueError, match="checkpoint 'INVALID_CHECKPOINT' is unknown"):
        dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=2, checkpoint="INVALID_CHECKPOINT")


def test_checkpoint_mode_when_chunks_1() -> None:
    """upstream test_checkpoint_mode_when_chunks_1: every mode is fine."""
    for mode in ("except_last", "always", "never"):
        pipe = dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=1, checkpoint=mode)
        pipe(torch.rand(2, 1)).sum().backward()


def test_checkpoint_eval() -> None:
    """upstream test_checkpoint_eval: checkpointing in train(), none in eval()."""
    layer, log = recompute_counter()
    pipe = dk.Pipeline(nn.Sequential(layer), ["cpu"], chunks=2)
    pipe.train()
    pipe(torch.rand(2, 1)).sum().backward()
    assert True in log
    log.clear()
    pipe.eval()
    pipe(torch.rand(2, 1)).sum().backward()
    assert log == [False, False]


def test_no_grad() -> None:
    """upstream test_no_grad"""
    pipe = dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=2)
    latent: list[torch.Tensor] = []
    pipe.parts[0].register_forward_hook(lambda module, inp, out: latent.append(out))
    with torch.no_grad():
        pipe(torch.rand(2, 1))
    assert latent and all(t.grad_fn is None for t in latent)


class ExpectedException(Exception):
    pass


class Raise(nn.Module):
    def forward(self, *_: object) -> torch.Tensor:
        raise ExpectedException()


class Pass(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_exception() -> None:
    """upstream test_exception"""
    pipe = dk.Pipeline(nn.Sequential(Raise()), ["cpu"], chunks=1)
    with pytest.raises(ExpectedException):
        pipe(torch.rand(1))


def test_exception_early_stop_asap() -> None:
    """upstream test_exception_early_stop_asap: the stage before a failed one stops at once."""
    counter = 0

    class Counter(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            nonlocal counter
            time.sleep(0.1)
            counter += 1
            return x

    pipe = dk.Pipeline(nn.Sequential(Pass(), Pass(), Counter(), Raise()), ["cpu"] * 4, chunks=3,
                       balance=[1, 1, 1, 1])
    with pytest.raises(ExpectedException):
        pipe(torch.rand(3))
    assert counter == 2  # without the early stop it would be 3


def test_input_pair() -> None:
    """upstream test_input_pair"""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc_a, self.fc_b = nn.Linear(1, 1), nn.Linear(1, 1)

        def forward(self, a_and_b: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            a, b = a_and_b
            return self.fc_a(a), self.fc_b(b)

    pipe = dk.Pipeline(nn.Sequential(Two()), ["cpu"], chunks=2)
    a = torch.rand(10, 1, requires_grad=True)
    b = torch.rand(10, 1, requires_grad=True)
    a_out, b_out = pipe((a, b))
    (a_out + b_out).mean().backward()
    assert a.grad is not None and b.grad is not None


def test_input_singleton() -> None:
    """upstream test_input_singleton"""

    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(1, 1)

        def forward(self, only_a: tuple[torch.Tensor]) -> tuple[torch.Tensor]:
            (a,) = only_a
            return (self.fc(a),)

    pipe = dk.Pipeline(nn.Sequential(One()), ["cpu"], chunks=2)
    a = torch.rand(10, 1, requires_grad=True)
    (a_out,) = pipe((a,))
    a_out.mean().backward()
    assert all(p.grad is not None for p in pipe.parameters()) and a.grad is not None


def test_input_varargs() -> None:
    """upstream test_input_varargs"""
    pipe = dk.Pipeline(nn.Sequential(nn.Linear(1, 1)), ["cpu"], chunks=1)
    with pytest.raises(TypeError):
        pipe(torch.rand(1), torch.rand(1))  # type: ignore[call-arg]


def test_non_tensor() -> None:
    """upstream test_non_tensor. Difference: one-line InvalidValueErrors, not TypeErrors."""

    class NonTensor(nn.Module):
        def forward(self, _: object) -> str:
            return "hello"

    pipe = dk.Pipeline(nn.Sequential(NonTensor()), ["cpu"], chunks=2)
    with pytest.raises(dk.InvalidValueError, match="no tensor"):
        pipe(torch.rand(2))
    with pytest.raises(dk.InvalidValueError, match="holds no tensor"):
        pipe("hello")


def test_non_tensor_tuple() -> None:
    """upstream test_non_tensor_tuple. Difference: values that are not tensors ride along in
    any structure (a flag, a string), handed to every micro-batch; upstream refuses them."""

    class NonTensorTuple(nn.Module):
        def forward(self, x: object) -> tuple[object, str]:
            return x, "hello"

    pipe = dk.Pipeline(nn.Sequential(NonTensorTuple()), ["cpu"], chunks=2)
    x = torch.rand(2)
    out, word = pipe(x)
    assert torch.equal(out, x) and word == "hello"
    (inner, _), word = pipe((x, "hello"))
    assert torch.equal(inner, x) and word == "hello"


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_batch_norm(checkpoint: str) -> None:
    """upstream test_deferred_batch_norm"""
    bn = nn.BatchNorm2d(3)
    pipe = dk.Pipeline(nn.Sequential(deepcopy(bn)), ["cpu"], chunks=2, checkpoint=checkpoint)
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x).mean().backward()
    torch.testing.assert_close(pipe.module[0].running_mean, bn.running_mean, atol=1e-4, rtol=0)
    torch.testing.assert_close(pipe.module[0].running_var, bn.running_var, atol=1e-4, rtol=0)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_deferred_batch_norm_params(checkpoint: str) -> None:
    """upstream test_deferred_batch_norm_params"""
    bn = nn.BatchNorm2d(3)
    pipe = dk.Pipeline(nn.Sequential(deepcopy(bn)), ["cpu"], chunks=1, checkpoint=checkpoint)
    x = torch.rand(4, 3, 10, 10)
    pipe(x).mean().backward()
    bn(x).mean().backward()
    got = pipe.module[0]
    assert got.weight.grad is not None and got.bias.grad is not None
    torch.testing.assert_close(got.weight.grad, bn.weight.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(got.bias.grad, bn.bias.grad, atol=1e-4, rtol=0)


def test_devices() -> None:
    """upstream test_devices. Difference: extra devices are refused, not silently dropped
    (a list of five devices for three parts is more likely a mistake than a wish)."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 1))
    with pytest.raises(dk.InvalidValueError, match="3 entries for 5 device"):
        dk.Pipeline(model, ["cpu"] * 5, chunks=1, balance=[1, 1, 1])
    assert dk.Pipeline(model, ["cpu"] * 3, chunks=1, balance=[1, 1, 1]).devices == [torch.device("cpu")] * 3


def test_partitions() -> None:
    """upstream test_partitions. Difference: the parts are pipe.parts (nn.Sequential each) and
    the state_dict keeps the model's own keys under "module." (loadable into the unsplit model)."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=1, balance=[1, 1])
    assert all(isinstance(part, nn.Sequential) for part in pipe.parts) and len(pipe.parts) == 2
    assert "module.0.weight" in pipe.state_dict()
    nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)).load_state_dict(pipe.module.state_dict())


def test_deny_moving() -> None:
    """upstream test_deny_moving. Difference: a one-line dk.PlacementError (not TypeError), and a
    move to where every part already is is a no-op, allowed (frameworks call model.to(device))."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    pipe = dk.Pipeline(model, ["cpu", "meta"], chunks=1, balance=[1, 1])
    moves = [lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to(torch.device("cuda")),
             lambda: pipe.to(0), lambda: pipe.to("cuda"), lambda: pipe.to(device=0),
             lambda: pipe.to(torch.rand(1)), lambda: pipe.to(tensor=torch.rand(1))]
    for move in moves:
        with pytest.raises(dk.PlacementError):
            move()
    # casting is allowed
    pipe.half()
    pipe.to(torch.double)
    pipe.to(dtype=torch.float)
    assert model[0].weight.dtype == torch.float and model[1].weight.device.type == "meta"
    on_cpu = dk.Pipeline(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), ["cpu", "cpu"], chunks=1)
    assert on_cpu.cpu() is on_cpu and on_cpu.to("cpu") is on_cpu


def test_empty_module() -> None:
    """upstream test_empty_module. Difference: an empty Sequential is refused (nothing to split)."""
    with pytest.raises(dk.SplitError, match="no layers"):
        dk.Pipeline(nn.Sequential(), ["cpu"], chunks=1)


def test_named_children() -> None:
    """upstream test_named_children. Difference: modules keep the model's names under "module."."""
    model = nn.Sequential(OrderedDict([("a", nn.Linear(1, 1)), ("b", nn.Linear(1, 1))]))
    pipe = dk.Pipeline(model, ["cpu", "cpu"], chunks=1, balance=[1, 1])
    names = {n for n, _ in pipe.named_modules()}
    assert "module.a" in names and "module.b" in names
    assert pipe.parts[0][0] is model.a and pipe.parts[1][0] is model.b
    with pytest.raises(AttributeError):
        _ = pipe.a


def test_recommend_auto_balance() -> None:
    """upstream test_recommend_auto_balance. Difference: balance is optional (by size, or
    balance="time"); a wrong explicit balance names the layer count."""
    assert dk.Pipeline(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), ["cpu", "cpu"], chunks=1).plan.counts == [1, 1]
    with pytest.raises(dk.InvalidValueError, match="sums to 1 but the model has 2 layers"):
        dk.Pipeline(nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)), ["cpu"], chunks=1, balance=[1])


def test_verify_module_non_sequential() -> None:
    """upstream test_verify_module_non_sequential. Difference: any module whose forward traces is
    pipelined (tests/modelparallel/test_pipeline_any_module.py); a module with no forward, or a
    ModuleList (no order of execution), is refused."""
    with pytest.raises(dk.SplitError, match="has no forward"):
        dk.Pipeline(nn.Module(), ["cpu"], chunks=1)
    with pytest.raises(dk.SplitError, match="nn.ModuleList"):
        dk.Pipeline(nn.ModuleList([nn.Linear(1, 1)]), ["cpu"], chunks=1)


def test_verify_module_duplicate_children() -> None:
    """upstream test_verify_module_duplicate_children. Difference: a repeated layer is supported;
    it runs twice and both uses stay on one device (refused, naming it, if a cut would split them)."""
    conv = nn.Conv2d(3, 3, 1)
    x = torch.rand(2, 3, 4, 4)
    pipe = dk.Pipeline(nn.Sequential(conv, conv), ["cpu", "cpu"], chunks=2, balance=[1, 1])
    torch.testing.assert_close(pipe(x), conv(conv(x)))
    with pytest.raises(dk.SplitError, match="layer '0' repeats as '1'"):
        dk.Pipeline(nn.Sequential(conv, conv), ["cpu", "meta"], chunks=2, balance=[1, 1])


def test_verify_module_duplicate_parameters_in_distinct_children() -> None:
    """upstream test_verify_module_duplicate_parameters_in_distinct_children. Difference: shared
    parameters are supported on one device and refused across devices, naming the parameter."""

    class Surrogate(nn.Module):
        def __init__(self, module: nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

    conv = nn.Conv2d(3, 3, 1)
    x = torch.rand(2, 3, 4, 4)
    pipe = dk.Pipeline(nn.Sequential(Surrogate(conv), Surrogate(conv)), ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(x), conv(conv(x)))
    with pytest.raises(dk.SplitError, match="parameter '0.module.weight' is shared"):
        dk.Pipeline(nn.Sequential(Surrogate(conv), Surrogate(conv)), ["cpu", "meta"], chunks=2)
