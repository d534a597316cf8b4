"""``devicekit run`` speaks torchrun's and ``select``'s spellings (issue 14, items 6 and 8).

Checked with ``--dry-run`` (what would start, nothing started) and torchrun's own parser, so a
spelling torchrun would not accept fails here.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from devicekit.cli.main import main
from tests.conftest import h100

UUIDS = [f"GPU-0000000{i}-1111-2222-3333-444444444444" for i in range(3)]


def dry_run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str], str]:
    with pytest.raises(SystemExit) as done:
        main(["run", "--dry-run", *args, "--", "train"])
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out.splitlines(), err


def refused(capsys: pytest.CaptureFixture[str], *args: str, command: str = "select") -> str:
    with pytest.raises(SystemExit) as done:
        main([command, *args] if command == "select" else ["run", "--dry-run", *args, "--", "train"])
    _, err = capsys.readouterr()
    assert done.value.code == 1, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def torchrun_args(lines: list[str]) -> Any:
    from torch.distributed.run import parse_args

    argv = shlex.split(lines[-1])
    return parse_args(argv[argv.index("devicekit.jobs.torchrun_entry") + 1:])


@pytest.fixture
def three_gpus(simulate: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return simulate([h100(uuid=UUIDS[0]), h100(used="79GiB", uuid=UUIDS[1]),
                     h100(util=90, uuid=UUIDS[2])])


def test_single_node_uses_a_standalone_rendezvous(capsys: pytest.CaptureFixture[str]) -> None:
    """Not torchrun's default port 29500: two runs at once must not collide on any torch."""
    code, lines, _ = dry_run(capsys, "--procs", "2")
    assert code == 0
    args = torchrun_args(lines)
    assert args.standalone and args.nproc_per_node == "2" and args.nnodes == "1"


@pytest.mark.parametrize("spelling", ["--nproc-per-node", "--nproc_per_node", "--procs"])
def test_nproc_per_node_spellings(capsys: pytest.CaptureFixture[str], spelling: str) -> None:
    code, lines, err = dry_run(capsys, spelling, "3")
    assert code == 0, err
    assert torchrun_args(lines).nproc_per_node == "3"


def test_torchrun_options_are_passed(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, lines, err = dry_run(capsys, "--nproc_per_node", "2", "--nnodes", "1:3",
                               "--rdzv-backend", "c10d", "--rdzv_endpoint", "localhost:29411",
                               "--rdzv-id", "job-9", "--max-restarts", "2", "--log-dir", str(tmp_path))
    assert code == 0, err
    args = torchrun_args(lines)
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id) == (
        "1:3", "c10d", "localhost:29411", "job-9")
    assert args.max_restarts == 2 and args.log_dir == str(tmp_path) and args.tee == "3"


def test_one_process_with_max_restarts_runs_under_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = dry_run(capsys, "--max-restarts", "1")
    assert code == 0 and torchrun_args(lines).max_restarts == 1


def test_explicit_standalone(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = dry_run(capsys, "--standalone", "--procs", "2")
    assert code == 0 and torchrun_args(lines).standalone


def test_rendezvous_flags_are_never_ignored_for_one_process(capsys: pytest.CaptureFixture[str]) -> None:
    code, lines, _ = dry_run(capsys, "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:29412")
    assert code == 0
    assert torchrun_args(lines).rdzv_endpoint == "localhost:29412"  # not a plain direct exec


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--nnodes", "1:4"], "--nnodes 1:4 is elastic: add --rdzv-backend c10d"),
        (["--nnodes", "2:1"], "MIN:MAX"),
        (["--rdzv-backend", "c10d", "--nnodes", "2"], "needs --rdzv-endpoint"),
        (["--rdzv-backend", "zookeeper"], "'zookeeper' is not one of"),
        (["--standalone", "--nnodes", "2", "--node-rank", "0", "--master-addr", "localhost"],
         "--standalone"),
        (["--tee", "3"], "--tee is a torchrun option: --log-dir DIR"),
        (["--monitor-interval", "5"], "--monitor-interval is a torchrun option"),
        (["--no-python"], "drop --no-python"),
        (["--nproc-per-node", "cpu"], "e.g. --procs 4"),
        (["--max-util", "0.5"], "looks like a fraction"),
    ],
)
def test_bad_or_foreign_options_are_one_line(capsys: pytest.CaptureFixture[str], args: list[str],
                                             needle: str) -> None:
    assert needle in refused(capsys, *args, command="run")


def test_a_fraction_for_max_util_is_refused_by_select_too(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, "--max-util", "0.5")
    assert "--max-util '0.5' looks like a fraction" in err and "write 50" in err


def test_percent_fraction_with_a_sign_is_accepted() -> None:
    from devicekit.units import parse_percent

    assert parse_percent("0.5%") == 0.5 and parse_percent(50) == 50.0 and parse_percent(0) == 0.0


def test_explicit_gpu_ids_in_the_order_given(capsys: pytest.CaptureFixture[str], three_gpus: Path) -> None:
    code, lines, err = dry_run(capsys, "--gpus", "2,0")
    assert code == 0, err
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[2]},{UUIDS[0]}" in lines  # rank 0 on GPU 2, as asked
    code, lines, err = dry_run(capsys, "--gpu-ids", UUIDS[0][:12])
    assert code == 0, err
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[0]}" in lines


def test_explicit_gpu_that_fails_a_filter_is_not_replaced(capsys: pytest.CaptureFixture[str],
                                                          three_gpus: Path) -> None:
    with pytest.raises(SystemExit) as done:
        main(["run", "--dry-run", "--gpus", "0,1", "--min-free", "20GiB", "--", "train"])
    _, err = capsys.readouterr()
    assert done.value.code == 3 and "GPU 1" in err  # no silent swap for GPU 2


def test_unknown_gpu_id_is_one_line(capsys: pytest.CaptureFixture[str], three_gpus: Path) -> None:
    assert "GPU '7' matches no GPU" in refused(capsys, "--gpus", "0,7", command="run")


def test_run_takes_selects_filters(capsys: pytest.CaptureFixture[str], three_gpus: Path) -> None:
    code, lines, err = dry_run(capsys, "--gpus", "all", "--max-util", "50", "--exclude", "1")
    assert code == 0, err
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[0]}" in lines  # GPU 2 too busy, GPU 1 excluded
    code, lines, err = dry_run(capsys, "--nproc-per-node", "gpu", "--exclude", "0,1", "--max-util", "95%")
    assert code == 0, err
    assert f"CUDA_VISIBLE_DEVICES={UUIDS[2]}" in lines


def test_dry_run_holds_no_lease(capsys: pytest.CaptureFixture[str], three_gpus: Path) -> None:
    from devicekit.sharing.leases import read_leases

    code, _, err = dry_run(capsys, "--gpus", "1")
    assert code == 0 and "leases are released" in err
    assert not read_leases()


def test_run_help_lists_the_torchrun_spellings() -> None:
    from click.testing import CliRunner

    from devicekit.cli.run import command

    text = CliRunner().invoke(command, ["--help"]).output
    for name in ("--nproc-per-node", "--max-restarts", "--rdzv-endpoint", "--standalone",
                 "--log-dir", "--exclude", "--max-util", "--dry-run"):
        assert name in text, name
