"""RunningMean and MetricLog match a plain computation and accept tensors and numbers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import devicekit as dk


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(-1e3, 1e3), st.integers(1, 64)), min_size=1, max_size=40))
def test_running_mean_matches_weighted_mean(values: list[tuple[float, int]]) -> None:
    mean = dk.RunningMean()
    for i, (value, n) in enumerate(values):
        mean.update(torch.tensor(value, dtype=torch.float64) if i % 2 else value, n=n)
    expected = sum(v * n for v, n in values) / sum(n for _, n in values)
    assert mean.value == pytest.approx(expected, rel=1e-9, abs=1e-9)
    assert mean.count == sum(n for _, n in values)


def test_running_mean_of_vectors_counts_each_element() -> None:
    mean = dk.RunningMean()
    mean.update(torch.tensor([1.0, 2.0, 3.0]))
    mean.update(torch.tensor(10.0, dtype=torch.float16))
    result = mean.compute()
    assert isinstance(result, torch.Tensor) and result.device.type == "cpu"
    assert mean.item() == pytest.approx(4.0)
    assert mean.count == 4


def test_running_mean_detaches_and_resets() -> None:
    mean = dk.RunningMean()
    w = torch.ones((), requires_grad=True)
    mean.update(w * 3)
    assert not mean.compute().requires_grad
    mean.reset()
    with pytest.raises(dk.InvalidValueError, match="no values"):
        mean.compute()


def test_running_mean_rejects_bad_input() -> None:
    mean = dk.RunningMean()
    with pytest.raises(dk.InvalidValueError, match="'3'"):
        mean.update("3")  # type: ignore[arg-type]
    with pytest.raises(dk.InvalidValueError, match="-1"):
        mean.update(1.0, n=-1)
    with pytest.raises(dk.InvalidValueError, match="elements"):
        dk.MetricLog().append(x=torch.ones(2, device="meta"))


def test_metric_log_matches_plain_lists_across_growth() -> None:
    log = dk.MetricLog()
    losses = [float(i) / 7 for i in range(300)]  # grows the buffer past 64, 128, 256
    for i, loss in enumerate(losses):
        log.append(loss=torch.tensor(loss), step=i)
    history = dict(log)
    assert history["loss"] == pytest.approx(losses)
    assert history["step"] == list(map(float, range(300)))
    assert log.means()["loss"] == pytest.approx(sum(losses) / len(losses))
    computed = log.compute()
    assert computed["loss"].shape == (300,) and computed["loss"].device.type == "cpu"
    assert log.steps("loss") == 300 and len(log) == 2 and set(log) == {"loss", "step"}


def test_metric_log_frobenius_norm_exercise() -> None:
    """The seeds' exercise, small: log the norm of each product on the device, read once."""
    torch.manual_seed(0)
    a = torch.randn(20, 20)
    log = dk.MetricLog()
    plain = []
    x = torch.eye(20)
    for _ in range(50):
        x = (a @ x) / 5
        norm = torch.linalg.matrix_norm(x)
        log.append(norm=norm)
        plain.append(norm.item())
    assert log["norm"] == pytest.approx(plain, rel=1e-6)


def test_metric_log_errors_and_reset() -> None:
    log = dk.MetricLog()
    with pytest.raises(dk.InvalidValueError, match="'loss' has 3 elements"):
        log.append(loss=torch.ones(3))
    with pytest.raises(dk.InvalidValueError, match="None"):
        log.append(loss=None)  # type: ignore[arg-type]
    log.append(loss=1.0)
    with pytest.raises(KeyError):
        log["missing"]
    log.reset()
    assert dict(log) == {} and log.means() == {}


def test_device_history_chunks_keep_order_across_numbers_and_dtypes() -> None:
    """The accelerator path of MetricLog (list of 0-d tensors stacked in chunks), driven with
    CPU tensors since this machine has no accelerator."""
    from devicekit.placement.metric_log import _CHUNK, _History

    history = _History()
    expected: list[float] = [0.5, 1.5]
    history.append_number(0.5)
    history.append_number(1.5)  # numbers before the first device tensor move along with it
    for i in range(2 * _CHUNK + 10):
        value = float(i)
        if i % 7 == 0:
            history.append_number(value)
        else:
            dtype = torch.float16 if i % 5 == 0 else torch.float32
            history.append_tensor(torch.tensor(value, dtype=dtype), "m")
        expected.append(value)
    assert history.size == len(expected)
    assert len(history.chunks) == 2 and history.dtype == torch.float32
    view = history.view()
    assert view.dtype == torch.float32 and view.tolist() == expected
    assert history.values() == expected  # reading twice gives the same
    with pytest.raises(dk.InvalidValueError, match="'m' on meta"):
        history.append_tensor(torch.tensor(1.0, device="meta"), "m")
