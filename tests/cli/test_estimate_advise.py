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
    # a file path said "cannot import '/x/fit_models.py' (No module named '/x/fit_models')"
    (["/x/fit_models.py:small_mlp"], "'/x/fit_models.py' is a file path, but MODULE is a module name"
                                     " importable from here: run from /x with 'fit_models:small_mlp'"),
    (["fit_models.py:small_mlp"], "run from its folder with 'fit_models:small_mlp'"),
    (["fit_models:small_mlp", "--step", "./fit_models.py:lm_step"], "run from . with 'fit_models:lm_step'"),
    (["fit_models:small_mlp", "--input", "3xfoo"], "'3xfoo' does not parse"),
    (["fit_models:small_mlp", "--input", "1024,"], "--input '1024,': shape '' does not parse"),
    (["fit_models:small_mlp", "--input", "0"], "every dimension of '0' must be at least 1"),
    (["fit_models:small_mlp", "--input", "1024:long"], "float32 and int64"),
    (["fit_models:small_mlp", "--input", "1024", "--inference", "--optimizer", "sgd"],
     "--optimizer sgd: --inference sizes a forward pass"),
    (["fit_models:small_mlp", "--input", "1024:complex7"], "complex7"),
    (["fit_models:small_mlp", "--input", "7"], "failed on the sample"),
    (["fit_models:small_mlp", "--input", "1024", "--optimizer", "lion9"], "lion9"),
    # a shape or batch past what a tensor can hold was torch's traceback (storage size
    # overflowed, or "Overflow when unpacking long long" past int64)
    (["fit_models:small_mlp", "--input", "99999999x99999999x9999999"],
     "--input '99999999x99999999x9999999': 99999999x99999999x9999999 at batch 1 is too large"),
    (["fit_models:small_mlp", "--input", "1024", "--batch", "99999999999999999999"],
     "1024 at batch 99999999999999999999 is too large for any tensor"),
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
    assert "global batch 16" in advice.best.reason and "about 2x the speed of one" in advice.best.reason


def test_advise_ddp_over_a_mix_is_not_promised_n_times_the_speed(simulate: Callable[..., Path]) -> None:
    """DDP runs at the pace of its slowest rank: a mixed or busy set is not 'about 3x'."""
    simulate([h100(), h100(), {**h100(), "name": "NVIDIA GeForce RTX 3060", "memory_total": "12GiB"}])
    reason = dk.advise(*_big(), host_memory="64GiB").best.reason
    assert "at the pace of the slowest" in reason and "less than 3x" in reason and "mixed" in reason


def test_advise_four_small_gpus_pick_fsdp(simulate: Callable[..., Path]) -> None:
    # sized on the CPU: each GPU also holds the CUDA context and cuBLAS workspaces (about 0.85 GiB)
    small = {"name": "NVIDIA GeForce RTX 3060", "memory_total": "1400MiB", "memory_used": "0GiB", "utilization": 0}
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


def test_estimate_loss_and_step_flags(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["estimate", "fit_models:tiny_lm", "--input", "128:long", "--batch", "4", "--json"]
    peaks = {}
    for extra in (["--loss", "sum"], ["--loss", "cross-entropy"], [], ["--step", "fit_models:lm_step"]):
        code, out, _ = run(capsys, monkeypatch, *base, *extra)
        data = json.loads(out)
        assert code == 0 and data["measures"] == "bytes allocated"
        peaks[" ".join(extra)] = data
    assert peaks[""]["loss"] == "cross-entropy (assumed)" and "assumed" in peaks[""]["loop"]
    assert peaks["--loss sum"]["peak"] < peaks["--loss cross-entropy"]["peak"] == peaks[""]["peak"]
    assert "lm_step (yours)" in peaks["--step fit_models:lm_step"]["loop"]
    code, out, _ = run(capsys, monkeypatch, *base[:-1])
    assert "cross-entropy (assumed)" in out and "--step MODULE:FN" in out and "bytes allocated" in out


@pytest.mark.parametrize("argv, words", [
    (["--loss", "hinge"], "loss 'hinge' is unknown"),
    (["--precision", "fp8"], "precision 'fp8'"),
    (["--step", "fit_models"], "not MODULE:FN"),
    (["--step", "fit_models:nothing_here"], "no callable 'nothing_here'"),
    (["--step", "fit_models:lm_step", "--loss", "mse"], "leave out --loss"),
])
def test_step_flag_errors_are_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                       argv: list[str], words: str) -> None:
    code, _, err = run(capsys, monkeypatch, "estimate", "fit_models:small_mlp", "--input", "1024", *argv)
    assert code == 1 and words in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_flags_are_refused_before_torch_is_imported(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = ("import sys\nfrom devicekit.cli.main import main\ntry:\n    main(['estimate', 'x:y', '--input', '4', "
            "'--optimizer', 'lion'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.stdout.strip().endswith("False") and "optimizer 'lion' is unknown" in done.stderr


def test_advise_names_rows_that_do_not_apply_and_the_batch_in_words(simulate: Callable[..., Path]) -> None:
    simulate([h100()])
    advice = dk.advise(*_big(), host_memory="64GiB")
    text = str(advice)
    ddp = next(r for r in advice.rows if r.name.startswith("DDP"))
    assert not ddp.applicable and "not applicable: only one GPU" in text
    assert "does not fit: only one GPU" not in text
    assert "1048576" not in text and "largest batch there: " in advice.best.reason
    tiny = dk.advise(*_big(), gpus=["8MiB"], host_memory="64GiB")
    assert "not even batch 1" in next(r for r in tiny.rows if r.name == "one GPU").reason
    huge = dk.advise(torch.nn.Linear(4, 4), torch.empty(2, 4, device="meta"), gpus=["80GiB"], host_memory="64GiB")
    assert "more than 1,048,576 (the search stops there)" in huge.best.reason


def test_advise_ranks_busy_gpus_by_what_is_free_and_names_their_load(simulate: Callable[..., Path]) -> None:
    busy = {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "60GiB", "utilization": 95}
    idle = {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "70GiB", "utilization": 3}
    simulate([busy, idle, {**busy, "memory_used": "10GiB"}])
    advice = dk.advise(*_big(), host_memory="64GiB")
    assert [label for label, _ in advice.budgets] == ["gpu2", "gpu0", "gpu1"]
    assert "gpu2 (95 % busy)" in advice.best.reason or "gpu2 (95 % busy)" in str(advice)


def test_ddp_row_adds_every_gradient_for_a_language_model() -> None:
    from tests.memory.zoo import GPT

    model = GPT()
    advice = dk.advise(model, torch.zeros(8, 32, dtype=torch.long), gpus=["80GiB", "80GiB"], host_memory="64GiB")
    ddp = next(r for r in advice.rows if r.name.startswith("DDP"))
    grads = sum(p.numel() * 4 for p in model.parameters())
    assert ddp.memory_per_gpu == advice.estimate.peak + grads


def _rtx3060(total: str = "12GiB") -> dict[str, object]:
    return {"name": "NVIDIA GeForce RTX 3060", "memory_total": total, "memory_used": "0GiB", "utilization": 0}


def test_advise_sized_on_the_cpu_adds_what_cuda_holds(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      simulate: Callable[..., Path]) -> None:
    """A new user's report: a 10.8 GiB step sized on the CPU was said to fit a 12 GiB RTX 3060 with
    10.8 GiB usable; on the GPU nvidia-smi shows about 11.7 GiB (10.6 to 14.1) with the CUDA context."""
    simulate([_rtx3060()])
    code, out, _ = run(capsys, monkeypatch, "advise", "fit_models:small_mlp", "--input", "1024", "--batch", "233879")
    one = next(line for line in out.splitlines() if "one GPU" in line)
    assert code == 0 and "may not fit: " in one and " fits: " not in one
    assert "sized on the CPU; on a GPU nvidia-smi will show about" in one
    assert "with the CUDA context and cuBLAS workspaces" in one and "12 GiB free, not the high end" in one
    code, out, _ = run(capsys, monkeypatch, "advise", "fit_models:small_mlp", "--input", "1024", "--batch", "300000",
                       "--json")
    data = json.loads(out)
    one = next(s for s in data["strategies"] if s["name"] == "one GPU")
    assert code == 0 and not one["fits"] and data["nvidia-smi"]["low"] > 12 << 30
    assert data["gpus"][0]["usable"] == 12 << 30      # free memory: the range replaces the 10 % headroom


def test_advise_sized_on_the_cpu_one_rule_with_fits(simulate: Callable[..., Path]) -> None:
    """Each verdict of the one-GPU row is est.fits(gpu)'s, from the same range; far below the card fits."""
    model, sample = _big()
    for total, mark in (("80GiB", "fits"), ("1500MiB", "may not fit"), ("1GiB", "does not fit")):
        simulate([_rtx3060(total)])
        advice = dk.advise(model, sample, host_memory="64GiB")
        one = next(r for r in advice.rows if r.name == "one GPU")
        gpu = dk.gpus()[0]
        fit = advice.estimate.fits(gpu)
        assert advice.estimate.device.type == "cpu" and advice.on_gpu is not None
        assert (one.fits, one.tight) == (bool(fit), mark == "may not fit"), (total, str(advice))
        assert f"{mark}: the step needs" in str(advice) and "CUDA context and cuBLAS workspaces" in one.reason
        assert "sized on the CPU" in fit.reason
        # the bare peak is far within each card's usable memory but 1 GiB: only the range says no
        assert advice.estimate.peak < 0.9 * gpu.memory_total
    roomy = dk.advise(model, sample, gpus=["80GiB"], host_memory="64GiB")
    assert roomy.best.name == "one GPU" and roomy.best.fits and not roomy.best.tight


@pytest.mark.parametrize("argv", [
    ["estimate", "no_such_module_xyz:build", "--input", "3"],
    ["estimate", "fit_models:small_mlp", "--input", "3xfoo"],
    ["advise", "fit_models:small_mlp", "--input", "0"],
])
def test_a_wrong_argument_is_told_before_torch_is_imported(argv: list[str]) -> None:
    """torch's import takes seconds: a wrong model name or --input is checked before it."""
    import subprocess
    import sys

    code = ("import runpy, sys\n"
            f"sys.argv = ['devicekit', *{argv!r}]\n"
            "try:\n    runpy.run_module('devicekit', run_name='__main__')\n"
            "except SystemExit as exit:\n    print('exit', exit.code)\n"
            "print('torch imported:', 'torch' in sys.modules)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2] / "docs" / "examples")
    assert "exit 1" in run.stdout and "torch imported: False" in run.stdout, (run.stdout, run.stderr)
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr


def test_advise_without_gpus_shows_the_step_in_host_ram() -> None:
    model, _ = _big()
    text = str(dk.advise(torch.nn.Linear(64, 64), torch.randn(8, 64), gpus=[], host_memory="64GiB"))
    assert "cpu" in text and " RAM  fits" in text and "0 B/GPU" not in text
