"""What a new user tripped over (issue 25): each case failed before, and says what to do now."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import devicekit as dk
from devicekit.cli.main import main
from devicekit.errors import InvalidSizeError, SimulationFileError
from devicekit.hardware.launchers import detect_environment
from devicekit.hardware.launchers.slurm import expand_nodelist
from devicekit.jobs.request import RunRequest
from devicekit.units import parse_size
from tests.conftest import h100

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(4)]
MIG = {"name": "NVIDIA A100-SXM4-80GB", "memory_total": "80GiB", "mig": [
    {"name": "1g.10gb", "memory_total": "10GiB", "uuid": "MIG-11111111-2222-3333-4444-555555555555"},
    {"name": "1g.10gb", "memory_total": "10GiB", "uuid": "MIG-66666666-2222-3333-4444-555555555555"}]}


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main(list(args))
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


@pytest.fixture
def four(simulate: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return simulate([h100(uuid=UUIDS[0], util=0.3), h100(uuid=UUIDS[1]),
                     h100(uuid=UUIDS[2], used="70GiB", util=95), h100(uuid=UUIDS[3], util=0.2)])


# 1. '0.5%' means 0.5 % on the command line too
@pytest.mark.parametrize("command", [["select"], ["run", "--dry-run"]])
def test_max_util_with_a_percent_sign_is_accepted_by_the_cli(four, capsys, command) -> None:
    extra = ["--", "train"] if command[0] == "run" else []
    code, out, err = cli(capsys, *command, "--max-util", "0.5%", *extra)
    assert code == 0, err
    assert "looks like a fraction" not in err
    assert "utilization 95% > 0.5% asked" in err or UUIDS[2] not in out


def test_a_bare_fraction_is_still_refused_in_one_line(four, capsys) -> None:
    code, _, err = cli(capsys, "select", "--max-util", "0.5")
    assert code == 1 and "'0.5%' if you mean 0.5 %" in err and len(err.strip().splitlines()) == 1


# 2. messages that say what is wrong
def test_a_negative_size_is_called_negative() -> None:
    with pytest.raises(InvalidSizeError, match=r"--min-free '-1GiB' is negative"):
        parse_size("-1GiB", name="--min-free")


def test_a_process_without_a_pid_is_missing_not_none(tmp_path, monkeypatch) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [h100(processes=[{"user": "bob", "memory": "1GiB"}])]}))
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
    with pytest.raises(SimulationFileError, match=r"processes\[0\]\.pid: is missing") as info:
        dk.gpus()
    assert "None" not in str(info.value)


def test_gpus_zero_explains_how_to_say_gpu_zero(four, capsys) -> None:
    code, _, err = cli(capsys, "run", "--dry-run", "--gpus", "0", "--", "train")
    assert code == 1 and "--gpus 0," in err and "--gpu-ids 0" in err
    code, out, err = cli(capsys, "run", "--dry-run", "--gpus", "0,", "--", "train")
    assert code == 0, err
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[0]}" in out


# 3. every GPU hidden: the CPU, and why
@pytest.mark.parametrize("hidden", ["-1", ""])
def test_every_gpu_hidden_runs_on_the_cpu_and_says_why(four, capsys, monkeypatch, hidden) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", hidden)
    code, out, err = cli(capsys, "run", "--dry-run", "--", "train")
    assert code == 0, err
    assert f"CUDA_VISIBLE_DEVICES={hidden!r} hides every GPU" in err
    assert "running on the CPU" in err


# 4. --gpus all takes the free ones and names the others
def test_gpus_all_leaves_a_busy_gpu_and_names_it(four, capsys) -> None:
    code, out, err = cli(capsys, "run", "--dry-run", "--gpus", "all", "--", "train")
    assert code == 0, err
    assert "GPU 2: in use by another job (95% busy, 70 GiB of 80 GiB used)" in err
    assert UUIDS[2] not in out
    assert all(u in out for u in (UUIDS[0], UUIDS[1], UUIDS[3]))


def test_gpus_all_with_explicit_filters_uses_them_instead(four, capsys) -> None:
    code, out, err = cli(capsys, "run", "--dry-run", "--gpus", "all", "--max-util", "100", "--", "t")
    assert code == 0, err
    assert all(u in out for u in UUIDS)


def test_gpus_all_with_nothing_free_is_one_line(simulate, capsys) -> None:
    simulate([h100(used="70GiB", util=95)])
    code, _, err = cli(capsys, "run", "--dry-run", "--gpus", "all", "--", "train")
    assert code == 3 and "no GPU is free" in err and "--max-util" in err


# 5. simulate-file sizes: one rule, the key named once
def test_a_bare_number_in_a_simulate_file_names_the_key_once(tmp_path, monkeypatch) -> None:
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"name": "X", "memory_total": 85899345920,
                                          "memory_used": "0GiB"}]}))
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
    with pytest.raises(SimulationFileError) as info:
        dk.gpus()
    message = str(info.value)
    assert message.count("memory_total") == 1 and "has no unit" in message


def test_the_docs_state_one_rule_for_simulate_sizes() -> None:
    root = Path(__file__).resolve().parents[2]
    cli_page = (root / "docs" / "cli.md").read_text()
    assert "or byte counts" not in cli_page and "a bare JSON number is refused" in cli_page


# 6. a Slurm batch script is one process, for the launcher and for the library
BATCH = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_NNODES": "1",
         "SLURM_JOB_NODELIST": "alpha"}


def test_batch_script_is_a_world_of_one_for_dist_env_and_run(monkeypatch, capsys) -> None:
    assert detect_environment(BATCH).name == "single"
    for name, value in BATCH.items():
        monkeypatch.setenv(name, value)
    facts = dk.dist.env()
    assert (facts.rank, facts.world_size) == (0, 1)
    code, out, err = cli(capsys, "run", "--dry-run", "--", "train")
    assert code == 0, err
    assert "WORLD_SIZE=1" in out


def test_doctor_says_the_batch_script_is_one_process() -> None:
    from devicekit.hardware.launcher_checks import check_launcher

    check = check_launcher(BATCH)
    assert check.status == "pass" and "the sbatch script" in check.message


def test_an_srun_task_is_still_a_rank() -> None:
    facts = detect_environment({**BATCH, "SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}).read()
    assert (facts.source, facts.rank, facts.world_size) == ("slurm", 1, 2)


def test_space_separated_node_list_gives_the_first_host_as_master() -> None:
    assert expand_nodelist("alpha beta gamma") == ["alpha", "beta", "gamma"]
    facts = detect_environment({**BATCH, "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "",
                                "SLURM_NODELIST": "alpha beta gamma", "SLURM_NNODES": "3",
                                "SLURM_NTASKS": "3"}).read()
    assert facts.master_addr == "alpha"


# 7. one process with four GPUs
def test_gpus_four_procs_one_is_one_process_with_four_gpus(four, capsys) -> None:
    assert RunRequest(gpus=4, procs=1).gpus_per_proc == 4
    assert RunRequest(gpus=4, procs=2).gpus_per_proc == 2
    assert RunRequest(gpus=4).gpus_per_proc == 1
    code, out, err = cli(capsys, "run", "--dry-run", "--gpus", "4", "--procs", "1",
                         "--max-util", "100", "--", "train")
    assert code == 0, err
    assert "torchrun_entry" not in out.splitlines()[-1]  # one process: run directly
    assert "DEVICEKIT_GPUS_PER_PROC=4" in out


def test_procs_that_do_not_divide_the_gpus_say_so(four, capsys) -> None:
    code, _, err = cli(capsys, "run", "--dry-run", "--gpus", "4", "--procs", "3", "--", "train")
    assert code == 1 and "give --procs that divides 4" in err


# 8. MIG instances are named as instances
def test_select_names_each_mig_instance(simulate, capsys) -> None:
    simulate([h100(), MIG])
    code, _, err = cli(capsys, "select", "-n", "1")
    assert code == 0, err
    assert "GPU 1 MIG 0: eligible but not needed" in err
    assert "GPU 1 MIG 1: eligible but not needed" in err


# 9. a peak is never below the current value
def test_cpu_peak_is_never_below_rss() -> None:
    keep = torch.ones(4 * 2**20)  # 16 MiB more resident memory right now
    row = dk.memory.usage("cpu")[0]
    assert row.peak is None or row.peak >= row.process_rss
    del keep


def test_status_warnings_are_one_line_each_in_a_pipe(tmp_path, monkeypatch, capsys) -> None:
    long = "x" * 300
    path = tmp_path / "gpus.json"
    path.write_text(json.dumps({"gpus": [h100()]}))
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
    from devicekit.sharing import machine_status as status_mod

    real = status_mod.collect_status

    def with_warning(*a, **k):
        report = real(*a, **k)
        return dataclasses.replace(report, warnings=(*report.warnings, f"a long warning {long} end"))

    monkeypatch.setattr(status_mod, "collect_status", with_warning)
    code, out, _ = cli(capsys, "status")
    assert code == 0
    assert f"warning: a long warning {long} end" in out.splitlines()


# 10. a noisy speed-up says so
def test_logging_speedup_reports_its_spread_over_rounds() -> None:
    from devicekit.measure.exercises import logging_seconds

    result = logging_seconds(torch.device("cpu"), steps=20, n=8, rounds=3)
    assert result["rounds"] == 3 and result["spread"] >= 1.0
    assert result["speedup"] > 0
