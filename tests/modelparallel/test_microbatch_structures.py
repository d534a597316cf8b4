"""Micro-batches of what models take and return: PackedSequence, batch-second outputs, fx's lists."""

from __future__ import annotations

import torch
from torch import fx, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

import devicekit as dk
from devicekit.modelparallel.microbatch import gather, move, scatter
from devicekit.placement.walk import map_tensors


def _packed(n: int = 6) -> PackedSequence:
    torch.manual_seed(0)
    x = torch.randn(n, 5, 3)
    lengths = torch.tensor([5, 2, 4, 1, 3, 5][:n])
    return pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)


def test_a_packed_sequence_is_cut_by_sequences_and_joined_back() -> None:
    seq = _packed()
    parts = scatter((seq, torch.arange(6)), 3)
    assert len(parts) == 3
    whole, lengths = pad_packed_sequence(seq, batch_first=True)
    for i, (piece, index) in enumerate(parts):
        assert isinstance(piece, PackedSequence)
        got, got_lengths = pad_packed_sequence(piece, batch_first=True)
        torch.testing.assert_close(got_lengths, lengths[2 * i:2 * i + 2])
        torch.testing.assert_close(got, whole[2 * i:2 * i + 2, :got.size(1)])
        torch.testing.assert_close(index, torch.arange(2 * i, 2 * i + 2))
    joined = gather([p[0] for p in parts])
    again, again_lengths = pad_packed_sequence(joined, batch_first=True)
    torch.testing.assert_close(again, whole)
    torch.testing.assert_close(again_lengths, lengths)


def test_a_packed_sequence_moves_with_its_lengths_on_the_cpu() -> None:
    moved = move({"seq": _packed()}, torch.device("meta"))["seq"]
    assert isinstance(moved, PackedSequence)
    assert moved.data.device.type == "meta" and moved.batch_sizes.device.type == "cpu"


def test_outputs_join_on_their_batch_dimension_or_are_taken_once() -> None:
    outs = [(torch.full((2, 3), float(i)), torch.full((4, 2, 5), float(i)), torch.ones(3)) for i in range(3)]
    logits, h_n, shared = gather(outs, dims=[0, 1, None])
    assert logits.shape == (6, 3) and h_n.shape == (4, 6, 5) and shared.shape == (3,)
    torch.testing.assert_close(h_n[:, 2:4], torch.ones(4, 2, 5))


def test_fx_immutable_lists_are_rebuilt_not_mutated() -> None:
    args = fx.immutable_collections.immutable_list([torch.ones(2), torch.zeros(2)])
    out = map_tensors(args, lambda t: t + 1)
    assert type(out) is type(args) and torch.equal(out[1], torch.ones(2))


def test_fx_immutable_dicts_are_rebuilt_not_mutated() -> None:
    """A node's kwargs (``x.mean(dim=(2, 3))``) used to raise fx's "'immutable_dict' object does not
    support mutation" from a pipeline with chunks > 1 (issue 45, item 5)."""
    kwargs = fx.immutable_collections.immutable_dict({"dim": (2, 3), "t": torch.zeros(2)})
    out = map_tensors(kwargs, lambda t: t + 1)
    assert type(out) is type(kwargs) and out["dim"] == (2, 3) and torch.equal(out["t"], torch.ones(2))
    assert torch.equal(kwargs["t"], torch.zeros(2))

    class MeanPool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = nn.Conv2d(3, 4, 3), nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.conv(x).mean(dim=(2, 3)))

    model, x = MeanPool(), torch.randn(4, 3, 8, 8)
    with dk.Pipeline(model, ["cpu", "cpu"], chunks=2, sample=x) as pipe:
        torch.testing.assert_close(pipe(x), model(x))
