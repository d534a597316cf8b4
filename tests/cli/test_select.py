import os
import subprocess
import sys
from pathlib import Path

import pytest

import devicekit as dk
from devicekit.cli.main import main
from devicekit.sharing.leases import Lease, read_leases
from tests.conftest import h100

SRC = str(Path(dk.__file__).parents[1])
ALICE = {"pid": 4242, "user": "alice", "memory": "70GiB", "command": "python train.py"}


@pytest.fixture
def three(simulate):
    simulate([h100(used="70GiB", processes=[ALICE]), h100(), h100(used="10GiB", util=90)])
    return dk.gpus()


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["select", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_prints_only_the_value_on_stdout(three, capsys):
    code, out, err = run_cli(capsys, "-n", "2")
    assert code == 0
    assert out == f"{three[1].uuid},{three[2].uuid}\n"
    assert "chose GPU 1 (80 GiB free), GPU 2 (70 GiB free)" in err
    assert "GPU 0: eligible but not needed" in err


def test_filters_and_exclude(three, capsys):
    code, out, _ = run_cli(capsys, "--min-free", "20GiB", "--max-util", "50", "--exclude", "1")
    assert code == 3 and out == ""
    code, out, _ = run_cli(capsys, "--exclude", "1,2", "--account-as-free", "alice",
                           "--min-free", "79GiB", "-q")
    assert code == 0 and out.strip() == three[0].uuid


def test_index_format_advises_pci_bus_order(three, capsys):
    code, out, err = run_cli(capsys, "--format", "index", "--order", "index")
    assert (code, out) == (0, "0\n") and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in err


def test_leased_gpus_skipped_and_select_holds_none(three, capsys):
    with Lease.acquire([three[1].uuid]):
        code, out, err = run_cli(capsys)
        assert out.strip() == three[2].uuid and "GPU 1: leased by" in err
        assert [r.gpu_uuid for r in read_leases()] == [three[1].uuid]  # select leased nothing


@pytest.mark.parametrize("args,code,needle", [
    (["-n", "0"], 1, "Invalid value for '-n': '0' must be"),
    (["-n", "-3"], 1, "Invalid value for '-n': '-3' must be"),
    (["--account-as-free", ""], 1, "Invalid value for '--account-as-free': '' is not"),
    (["-n", "two"], 1, "'two' is not a whole number"),
    (["--min-free", "10XB"], 1, "--min-free '10XB'"),
    (["--max-util", "150"], 1, "--max-util '150'"),
    (["--order", "fast"], 1, "'fast' is not one of"),
    (["--exclude", "7"], 1, "exclude entry '7'"),
    (["--wait", "-1"], 1, "--wait"),
    # not finite: named as typed (it said "wait inf" for 1e999), before any ticket is taken
    (["--wait", "nan"], 1, "Invalid value for '--wait': 'nan' is not a number of seconds"),
    (["--wait", "inf"], 1, "Invalid value for '--wait': 'inf' is not a number of seconds"),
    (["--wait", "1e999"], 1, "Invalid value for '--wait': '1e999' is not a number of seconds"),
    # --hosts' --timeout nan passed click's FloatRange and raised ValueError in a thread join
    (["--hosts", "127.0.0.1:9", "--timeout", "nan"], 1,
     "Invalid value for '--timeout': 'nan' is not a number of seconds from 0.1 to 60"),
    (["--share"], 1, "--share needs --min-free"),
    (["-n", "5"], 3, "need 5 GPU(s) but this machine has only 3; waiting cannot help"),
    (["-n", "5", "--wait", "600"], 3, "this machine has only 3; waiting cannot help"),
    (["--min-free", "20"], 1, "--min-free '20' has no unit"),
    (["--min-free", "0.5"], 1, "--min-free '0.5' has no unit"),
    (["-n", "3", "--max-util", "50"], 3, "add --wait SECONDS to queue"),
])
def test_errors_one_line_and_exit_codes(three, capsys, args, code, needle):
    got, out, err = run_cli(capsys, *args)
    assert got == code and out == ""
    assert err.startswith("devicekit: ") and err.count("\n") == 1 and needle in err


def test_garbage_visible_devices_exit_1(three, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,banana")
    code, _, err = run_cli(capsys)
    assert code == 1 and "'banana'" in err and "silently" in err


def test_broken_simulation_file_exit_1(simulate, capsys):
    path = simulate([h100()])
    path.write_text("{not json")
    code, _, err = run_cli(capsys)
    assert code == 1 and str(path) in err


def test_driver_failure_exit_2(three, capsys, monkeypatch):
    from devicekit.errors import BackendError
    from devicekit.hardware import inventory

    def broken():
        raise BackendError("NVML call nvmlDeviceGetCount failed: Unknown Error; check the driver")

    monkeypatch.setattr(inventory, "gpus", broken)
    code, _, err = run_cli(capsys)
    assert code == 2 and "NVML" in err


def test_help_says_no_lease_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["select", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "cannot hold a lease" in out and "devicekit run" in out and "dk.select_gpus" in out
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in out
    assert "0 chosen; 1 bad input; 2 NVML or driver failure; 3 too few GPUs" in out


def test_shell_substitution_without_torch(three, tmp_path):
    """The real thing: $(devicekit select) in a shell, and no torch import on that path."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os, sys\nprint(os.environ['CUDA_VISIBLE_DEVICES'])\n")
    env = dict(os.environ, PYTHONPATH=SRC)
    script = (f'CUDA_VISIBLE_DEVICES=$("{sys.executable}" -m devicekit select -n 2 -q) '
              f'"{sys.executable}" "{probe}"')
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{three[1].uuid},{three[2].uuid}"
    check = ("import sys\nfrom devicekit.cli.main import main\n"
             "try:\n    main(['select', '-q'])\nexcept SystemExit:\n    pass\n"
             "print('torch' in sys.modules, file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.stdout.strip() == three[1].uuid and done.stderr.strip() == "False"


def test_wait_until_a_leased_gpu_is_released(simulate, capsys):
    import threading

    simulate([h100()])
    uuid = dk.gpus()[0].uuid
    lease = Lease.acquire([uuid])
    timer = threading.Timer(0.3, lease.release)
    timer.start()
    try:
        code, out, _ = run_cli(capsys, "--wait", "20", "-q")
    finally:
        timer.cancel()
        lease.release()
    assert (code, out.strip()) == (0, uuid)


def test_all_eligible(three, capsys):
    code, out, _ = run_cli(capsys, "-n", "all", "--max-util", "50%", "-q")
    assert code == 0 and out.strip() == f"{three[1].uuid},{three[0].uuid}"


def test_ordering_warning_is_one_devicekit_line(simulate, tmp_path):
    """A DeviceOrderWarning reaches the shell as one 'devicekit: warning:' line, not Python's
    'file.py:245: DeviceOrderWarning' plus a line of devicekit's source code."""
    a100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0"}
    path = simulate([h100(compute_capability="9.0"), a100])
    env = dict(os.environ, PYTHONPATH=SRC, DEVICEKIT_SIMULATE=str(path), CUDA_VISIBLE_DEVICES="1")
    done = subprocess.run([sys.executable, "-m", "devicekit", "select", "-q"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("devicekit: warning: CUDA_VISIBLE_DEVICES='1' uses indices")


def test_no_command_prints_the_help_not_an_error_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 1 and out == ""
    assert err.startswith("Usage: devicekit [OPTIONS] COMMAND") and "select" in err
    assert "devicekit: Usage" not in err and "(see 'devicekit --help')" not in err


def _documented_forms() -> list[str]:
    """Every shell line in the docs, README and `select --help` that substitutes `select`."""
    from devicekit.cli.select import _HELP

    root = Path(__file__).resolve().parents[2]
    texts = [_HELP, (root / "README.md").read_text()]
    texts += [p.read_text() for p in sorted((root / "docs").glob("*.md"))]
    return [line.strip().split("  #")[0].strip() for text in texts for line in text.splitlines()
            if "$(devicekit select" in line and "python train.py" in line
            and not line.strip().startswith("`") and "would" not in line]


def test_every_documented_select_idiom_stops_the_job_when_select_fails():
    forms = _documented_forms()
    assert len(forms) >= 4
    assert all("&&" in form for form in forms), forms


@pytest.mark.parametrize("used,ran", [("70GiB", False), ("10GiB", True)])
def test_the_shell_idiom_never_starts_the_job_on_no_gpu(simulate, tmp_path, used, ran):
    # `CUDA_VISIBLE_DEVICES=$(devicekit select ...) python train.py` used to start train.py
    # with every GPU hidden when too few GPUs qualified (exit 0, training on the CPU)
    simulate([h100(used=used), h100(used=used)])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, target in (("devicekit", f'"{sys.executable}" -m devicekit'),
                         ("python", f'"{sys.executable}"')):
        (bin_dir / name).write_text(f'#!/bin/sh\nexec {target} "$@"\n')
        (bin_dir / name).chmod(0o755)
    (tmp_path / "train.py").write_text(
        "import os\nopen('ran', 'w').write(os.environ['CUDA_VISIBLE_DEVICES'])\n")
    (form,) = {f for f in _documented_forms() if "-n 2 --min-free 20GiB" in f}
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": SRC}
    done = subprocess.run(["bash", "-c", form], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert (tmp_path / "ran").exists() == ran, done.stderr
    if ran:
        assert done.returncode == 0
        assert (tmp_path / "ran").read_text() == ",".join(g.uuid for g in dk.gpus())
    else:
        assert done.returncode == 3 and "need 2 GPU(s)" in done.stderr
