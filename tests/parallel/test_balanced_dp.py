"""BalancedDataParallel on the CPU: the plain path, the chunk-loss reduction, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import devicekit as dk
from devicekit.parallel.balanced_dp import _ModelWithLoss, combine_losses


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _batch(n: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def test_cpu_plain_path_equals_model_plus_loss_and_gradients_match() -> None:
    x, y = _batch()
    reference, wrapped_net = _net(), _net()
    loss_fn = nn.CrossEntropyLoss()
    expected = loss_fn(reference(x), y)
    expected.backward()

    model = dk.BalancedDataParallel(wrapped_net, loss_fn)
    assert model.device_ids == [] and model.output_device is None
    loss = model(x, y)
    loss.backward()
    assert loss.shape == ()
    torch.testing.assert_close(loss, expected)
    for (name, p), q in zip(reference.named_parameters(), wrapped_net.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_return_outputs_gives_the_outputs_per_device() -> None:
    x, y = _batch()
    net = _net()
    loss, outputs = dk.BalancedDataParallel(net, nn.CrossEntropyLoss())(x, y, return_outputs=True)
    assert len(outputs) == 1
    torch.testing.assert_close(outputs[0], net(x))
    torch.testing.assert_close(loss, nn.functional.cross_entropy(net(x), y))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunk_losses_reduce_to_the_full_batch_loss_and_gradients(reduction: str) -> None:
    """The reduction used across GPUs, exercised on CPU chunks of unequal size (4, 3, 3)."""
    x, y = _batch(10)
    net = _net()
    loss_fn = nn.CrossEntropyLoss(reduction=reduction)
    assert dk.BalancedDataParallel(net, loss_fn).reduction == reduction   # "auto" read it
    pair = _ModelWithLoss(net, loss_fn, dim=0)
    chunks = [pair(xc, yc) for xc, yc in zip(x.tensor_split(3), y.tensor_split(3), strict=True)]
    assert [size for _, size, _ in chunks] == [4, 3, 3]
    loss = combine_losses([c[0] for c in chunks], [c[1] for c in chunks], reduction)
    loss.backward()
    grads = [p.grad.clone() for p in net.parameters()]

    net.zero_grad()
    full = loss_fn(net(x), y)
    full.backward()
    torch.testing.assert_close(loss, full)
    for got, want in zip(grads, [p.grad for p in net.parameters()], strict=True):
        torch.testing.assert_close(got, want)


def test_state_dict_is_dataparallel_shaped_and_parameters_not_duplicated() -> None:
    net = _net()
    model = dk.BalancedDataParallel(net, nn.CrossEntropyLoss())
    assert set(model.state_dict()) == {f"module.{k}" for k in net.state_dict()}
    assert len(list(model.parameters())) == len(list(net.parameters()))


def test_loss_fn_must_return_a_scalar() -> None:
    x, y = _batch()
    model = dk.BalancedDataParallel(_net(), nn.CrossEntropyLoss(reduction="none"))
    with pytest.raises(dk.InvalidValueError, match="scalar"):
        model(x, y)


@pytest.mark.parametrize("bad", [["cpu"], ["gpu:0"]])
def test_non_cuda_device_ids_are_rejected(bad: list[str]) -> None:
    with pytest.raises(dk.InvalidDeviceError, match=repr(bad[0])):
        dk.BalancedDataParallel(_net(), nn.MSELoss(), device_ids=bad)


def test_cuda_index_that_does_not_exist_is_named() -> None:
    with pytest.raises(dk.InvalidDeviceError, match="cuda:7"):
        dk.BalancedDataParallel(_net(), nn.MSELoss(), device_ids=["cuda:7"])


def test_bad_reduction_is_named() -> None:
    with pytest.raises(dk.InvalidValueError, match="'max'"):
        dk.BalancedDataParallel(_net(), nn.MSELoss(), reduction="max")


def test_bad_model_and_loss_are_named() -> None:
    with pytest.raises(dk.InvalidValueError, match="str"):
        dk.BalancedDataParallel("net", nn.MSELoss())  # type: ignore[arg-type]
    with pytest.raises(dk.InvalidValueError, match="not callable"):
        dk.BalancedDataParallel(_net(), 3)  # type: ignore[arg-type]


def test_device_ids_without_any_cuda_device_say_why(monkeypatch) -> None:
    # was "pick an index below 0"
    import devicekit as dk
    from devicekit.errors import InvalidDeviceError

    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(InvalidDeviceError, match="sees no CUDA device .torch .* CPU-only build") as info:
        dk.BalancedDataParallel(torch.nn.Linear(2, 2), torch.nn.MSELoss(), device_ids=[0, 1])
    assert "below 0" not in str(info.value) and "device_ids=None" in str(info.value)
