"""dk.shard: FSDP2 per block over 2 gloo ranks matches one process; DCP checkpoints reshard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import devicekit as dk
from devicekit.errors import InvalidValueError
from devicekit.parallel.blocks import find_blocks
from tests.parallel import shard_workloads as work

TIMEOUT = 90.0


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    path = tmp_path_factory.mktemp("shard") / "step-1"
    results = dk.launch(work.train_and_save, str(path), nprocs=2, devices="cpu", timeout=TIMEOUT)
    return results, path


def _single_process() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = work.build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(work.batch()).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def test_two_sharded_ranks_match_one_process(two_ranks: tuple[list[dict[str, Any]], Path]) -> None:
    results, _ = two_ranks
    grads, params = _single_process()
    for result in results:
        assert result["world"] == 2
        assert len(result["fsdp_modules"]) == 4         # 3 blocks + the root, each fully_shard-ed
        for name, grad in grads.items():
            torch.testing.assert_close(result["grads"][name], grad, rtol=1e-5, atol=1e-6)
        for name, param in params.items():
            torch.testing.assert_close(result["params"][name], param, rtol=1e-5, atol=1e-6)


def test_checkpoint_saved_by_two_loads_in_one_and_four(two_ranks: tuple[list[dict[str, Any]], Path]) -> None:
    results, path = two_ranks
    assert (path / ".metadata").is_file()
    expected = results[0]["params"]
    plain = work.build(seed=99)                                  # one process, no process group
    dk.load_checkpoint(path, into=plain)
    for name, param in plain.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name])
    whole = dk.load_checkpoint(path)                             # no target: the full state dict
    torch.testing.assert_close(whole["head.weight"], expected["head.weight"])
    four = dk.launch(work.load_sharded, str(path), nprocs=4, devices="cpu", timeout=TIMEOUT)
    for loaded in four:
        for name, param in expected.items():
            torch.testing.assert_close(loaded[name], param)


def test_blocks_are_found_or_named() -> None:
    model = work.build()
    assert [n for n, _ in find_blocks(model)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in find_blocks(model, "Block")] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in find_blocks(model, ["head"])] == ["head"]
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    encoder = torch.nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
    assert [n for n, _ in find_blocks(encoder)] == ["layers.0", "layers.1", "layers.2"]
    with pytest.raises(InvalidValueError, match="NoSuchBlock"):
        find_blocks(model, "NoSuchBlock")
    with pytest.raises(InvalidValueError, match="nothing.here"):
        find_blocks(model, ["nothing.here"])


def test_shard_refuses_what_it_cannot_shard() -> None:
    with pytest.raises(InvalidValueError, match="nn.Module"):
        dk.shard("not a model")
    with pytest.raises(InvalidValueError, match="precision 'fp8'"):
        dk.shard(work.build(), precision="fp8")
