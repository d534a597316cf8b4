"""Checkpoints another user can write: nothing in them runs, bad files are one-line errors."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import devicekit as dk
from devicekit.errors import CheckpointError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class Payload:
    """Unpickling this touches a file: the proof that code ran."""

    marker = ""

    def __reduce__(self) -> tuple[object, ...]:
        return (os.system, (f"touch {self.marker}",))


def _payload(marker: Path) -> Payload:
    p = Payload()
    p.marker = str(marker)
    return p


class TiedLM(nn.Module):
    """A small transformer language model whose output layer shares the embedding weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight


class ResBlock(nn.Module):
    """A ResNet basic block (conv, batch norm, skip) with running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 3, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(3)


@pytest.fixture
def good_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "ck"
    dcp.save({"model": ResBlock().state_dict(), "step": 7, "note": "x"}, checkpoint_id=str(directory))
    return directory


@pytest.mark.parametrize("model_type", [ResBlock, TiedLM])
def test_real_models_round_trip_through_the_safe_reader(tmp_path, model_type):
    torch.manual_seed(0)
    model = model_type()
    if isinstance(model, ResBlock):  # running statistics that are not parameters
        model.bn1.running_mean.add_(1.5)
    directory = tmp_path / "ck"
    dcp.save({"model": model.state_dict(), "step": 3}, checkpoint_id=str(directory))
    fresh = model_type()
    into = {"model": fresh, "step": 0}
    dk.load_checkpoint(directory, into=into)
    assert into["step"] == 3
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    whole = dk.load_checkpoint(directory)
    assert whole["step"] == 3
    assert set(whole["model"]) == set(model.state_dict())
    if isinstance(fresh, TiedLM):
        assert fresh.head.weight is fresh.embed.weight  # still tied after loading


@pytest.mark.parametrize("into", [False, True])
def test_malicious_metadata_never_runs(good_dir, tmp_path, into):
    marker = tmp_path / "pwned"
    (good_dir / ".metadata").write_bytes(pickle.dumps(_payload(marker)))
    kwargs = {"into": {"model": ResBlock(), "step": 0, "note": ""}} if into else {}
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*system"):
        dk.load_checkpoint(good_dir, **kwargs)
    assert not marker.exists()


def test_payload_hidden_inside_allowed_metadata_never_runs(good_dir, tmp_path):
    """The real metadata object, with a payload as one of its fields: refused as a whole."""
    marker = tmp_path / "pwned"
    from devicekit.placement.safe_dcp import read_metadata

    metadata = read_metadata(good_dir / ".metadata")
    metadata.planner_data = {"x": _payload(marker)}
    (good_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError):
        dk.load_checkpoint(good_dir)
    assert not marker.exists()


@pytest.mark.parametrize("into", [False, True])
def test_malicious_non_tensor_item_never_runs(tmp_path, into):
    """DCP stores non-tensors with torch.save and its planner loads them weights_only=False."""
    marker = tmp_path / "pwned"
    directory = tmp_path / "ck"
    dcp.save({"w": torch.ones(2), "obj": _payload(marker)}, checkpoint_id=str(directory))
    assert not marker.exists()
    kwargs = {"into": {"w": torch.zeros(2), "obj": None}} if into else {}
    with pytest.raises(UnsafeCheckpointError, match=r"'obj'.*system"):
        dk.load_checkpoint(directory, **kwargs)
    assert not marker.exists()


def test_data_file_outside_the_directory_refused(good_dir):
    from devicekit.placement.safe_dcp import read_metadata

    metadata = read_metadata(good_dir / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../etc/passwd"
    (good_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="outside"):
        dk.load_checkpoint(good_dir)


def test_metadata_that_is_a_fifo_does_not_hang(good_dir):
    (good_dir / ".metadata").unlink()
    os.mkfifo(good_dir / ".metadata")
    with pytest.raises(CheckpointError):  # is_sharded_checkpoint wants a file: not a checkpoint
        dk.load_checkpoint(good_dir)


def test_truncated_metadata_is_one_line(good_dir):
    data = (good_dir / ".metadata").read_bytes()
    (good_dir / ".metadata").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt") as info:
        dk.load_checkpoint(good_dir)
    assert "\n" not in str(info.value)


def test_copy_of_good_checkpoint_still_loads(good_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(good_dir, copy)
    assert dk.load_checkpoint(copy)["step"] == 7
