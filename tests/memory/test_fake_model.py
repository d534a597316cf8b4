"""The fake copy of a model keeps its weights the parameters its forward uses."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from devicekit.memory.fake_step import LiveBytes, _fake_model


@pytest.mark.parametrize("rnn", [torch.nn.GRU(8, 16, 2, batch_first=True), torch.nn.LSTM(8, 16)])
def test_an_rnn_keeps_its_weights_as_parameters_that_get_gradients(rnn: torch.nn.Module) -> None:
    """An RNN lists its weights again in ``_flat_weights``; copying that list as plain tensors
    left the fake weights without gradients (and Adam without their state: 8 % low on a GRU LM)."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = _fake_model(rnn, torch.device("cpu"), LiveBytes("cpu"))
        assert all(w is p for w, p in zip(fake._flat_weights, fake.parameters(), strict=True))
        fake(torch.empty(4, 3, 8, requires_grad=True))[0].sum().backward()
        assert all(p.grad is not None for p in fake.parameters())


def test_the_copy_counts_each_weight_once_even_before_the_garbage_collector_runs() -> None:
    """No second fake copy of a weight is made (one would count as weights until collected:
    an LSTM's estimate read its weights twice, +17 %, depending on when the collector ran)."""
    import gc

    lstm = torch.nn.LSTM(8, 16, 2)
    tracker = LiveBytes("cpu")
    gc.disable()
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            fake = _fake_model(lstm, torch.device("cpu"), tracker)
            assert tracker.live["weights"] == sum(p.numel() * p.element_size() for p in lstm.parameters())
            del fake
    finally:
        gc.enable()
