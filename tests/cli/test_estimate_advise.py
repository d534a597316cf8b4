"""`devicekit estimate` / `advise`: table, JSON, one-line errors; advise on simulated inventories."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit.cli.main import main
from tests.conftest import h100

EXAMPLES = str(Path(__file__).resolve().parents[2] / "docs" / "examples")


def run(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.chdir(EXAMPLES)
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exit_info.value.code or 0), out, err


def test_estimate_table_and_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, _ = run(capsys, monkeypatch, "estimate", "fit_models:small_mlp", "--input", "1024", "--batch", "64")
    assert code == 0 and "optimizer state" in out and "peak" in out
    code, out, _ = run(capsys, monkeypatch, "estimate", "fit_models:small_mlp", "--input", "1024",
                       "--batch", "64", "--optimizer", "sgd", "--json")
    data = json.loads(out)
    assert code == 0 and data["batch_size"] == 64 and data["parts"]["optimizer state"] == 0
    assert data["peak"] == sum(data["parts"].values())


@pytest.mark.parametrize("argv, words", [
    (["fit_models"], "MODULE:FACTORY"),
    (["no_such_module_xyz:build"], "cannot import"),
    (["fit_models:missing"], "no callable 'missing'"),
    (["fit_models:small_mlp", "--input", "3xfoo"], "'3xfoo' does not parse"),
    (["fit_models:small_mlp", "--input", "1024:complex7"], "complex7"),
    (["fit_models:small_mlp", "--input", "7"], "failed on the sample"),
    (["fit_models:small_mlp", "--input", "1024", "--optimizer", "lion9"], "lion9"),
])
def test_estimate_errors_are_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                      argv: list[str], words: str) -> None:
    if "--input" not in argv:
        argv = [*argv, "--input", "1024"]
    code, _, err = run(capsys, monkeypatch, "estimate", *argv)
    assert code == 1 and words in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_factory_that_raises(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                               tmp_path: Path) -> None:
    (tmp_path / "broken_models.py").write_text("def build():\n    raise RuntimeError('no weights here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = run(capsys, monkeypatch, "estimate", "broken_models:build", "--input", "4")
    assert code == 1 and "factory raised RuntimeError: no weights here" in err


def _big() -> tuple[torch.nn.Module, torch.Tensor]:
    with torch.device("meta"):
        model = torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)])   # 34 M params
    return model, torch.empty(8, 2048, device="meta")


def test_advise_one_big_gpu_trains_there(simulate: Callable[..., Path]) -> None:
    simulate([h100()])
    advice = dk.advise(*_big(), host_memory="64GiB")
    assert advice.best.name == "one GPU" and advice.best.fits
    assert "largest batch there" in advice.best.reason and "devicekit run --gpus 1" in advice.best.command


def test_advise_several_big_gpus_pick_ddp(simulate: Callable[..., Path]) -> None:
    simulate([h100(), h100(), h100(used="79GiB")])       # the third is taken
    advice = dk.advise(*_big(), host_memory="64GiB")
    assert advice.best.name.startswith("DDP") and advice.best.gpus == 2
    assert "global batch 16" in advice.best.reason


def test_advise_four_small_gpus_pick_fsdp(simulate: Callable[..., Path]) -> None:
    small = {"name": "NVIDIA GeForce RTX 3060", "memory_total": "400MiB", "memory_used": "0GiB", "utilization": 0}
    simulate([small] * 4)
    advice = dk.advise(*_big(), host_memory="64GiB")
    assert not next(r for r in advice.rows if r.name == "one GPU").fits
    assert advice.best.name.startswith("FSDP over") and advice.best.fits
    assert "dk.shard(model)" in advice.best.command and "sharded" in advice.best.reason
    assert "does not fit" in str(advice)


def test_advise_a_mix_uses_the_big_one(simulate: Callable[..., Path]) -> None:
    simulate([{"name": "small", "memory_total": "400MiB", "memory_used": "0GiB", "utilization": 0}, h100()])
    advice = dk.advise(*_big(), host_memory="64GiB")
    assert advice.best.name == "one GPU"
    assert not next(r for r in advice.rows if r.name.startswith("DDP")).fits


def test_advise_cli_json(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                         simulate: Callable[..., Path]) -> None:
    simulate([h100(), h100()])
    code, out, _ = run(capsys, monkeypatch, "advise", "fit_models:small_mlp", "--input", "1024", "--json")
    data = json.loads(out)
    assert code == 0 and data["best"].startswith("DDP") and len(data["strategies"]) == 5


def test_advise_rejects_bad_gpus() -> None:
    with pytest.raises(dk.InvalidValueError, match="gpus\\[0\\]"):
        dk.advise(*_big(), gpus=[object()])
