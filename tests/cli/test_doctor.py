"""``devicekit doctor``: lines, --json schema, exit codes."""

from __future__ import annotations

import json
import re
import sys

import pytest

from devicekit.cli.main import main
from tests.conftest import h100

A100 = {"name": "NVIDIA A100-SXM4-40GB", "memory_total": "40GiB", "compute_capability": "8.0"}
NAMES = ["nvml", "gpus", "torch", "torch_version", "nccl", "cuda_device_order",
         "cuda_visible_devices", "lease_dir", "queue_policy", "pid_namespace", "launcher"]


def run_cli(capsys, *args):
    with pytest.raises(SystemExit) as exit_info:
        main(["doctor", *args])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def test_lines_on_a_healthy_simulated_machine(simulate, capsys):
    simulate([h100(), h100()])
    code, out, err = run_cli(capsys)
    assert (code, err) == (0, "")
    lines = out.strip().splitlines()
    checks = [line.split()[:2] for line in lines[:-2]]
    assert [name for _, name in checks] == NAMES
    assert all(status in ("PASS", "WARN", "FAIL", "SKIP") for status, _ in checks)
    assert "FAIL" not in out
    assert re.fullmatch(r"\d+ pass, \d+ warn, 0 fail, \d+ skip", lines[-1])


def test_json_schema(simulate, capsys):
    simulate([h100()])
    code, out, _ = run_cli(capsys, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["schema"] == 1 and doc["ok"] is True
    assert set(doc) == {"schema", "ok", "summary", "checks"}
    assert [c["name"] for c in doc["checks"]] == NAMES
    assert all(set(c) == {"name", "status", "message"} for c in doc["checks"])
    assert sum(doc["summary"].values()) == len(NAMES) and doc["summary"]["fail"] == 0


@pytest.mark.parametrize("var,value,name", [
    ("CUDA_VISIBLE_DEVICES", "0,banana", "cuda_visible_devices"),
    ("CUDA_DEVICE_ORDER", "FASTEST", "cuda_device_order"),
    ("WORLD_SIZE", "many", "launcher"),
])
def test_garbage_variables_fail_with_exit_1(simulate, capsys, monkeypatch, var, value, name):
    simulate([h100(), h100()])
    monkeypatch.setenv(var, value)
    code, out, err = run_cli(capsys, "--json", "--no-torch")
    doc = json.loads(out)
    failed = [c for c in doc["checks"] if c["status"] == "fail"]
    assert code == 1 and doc["ok"] is False and err == ""
    assert [c["name"] for c in failed] == [name] and repr(value) in failed[0]["message"]


def test_mixed_models_with_indices_warn_only(simulate, capsys, monkeypatch):
    simulate([h100(), A100])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    code, out, _ = run_cli(capsys, "--no-torch")
    line = next(x for x in out.splitlines() if "cuda_device_order" in x)
    assert code == 0 and line.startswith("WARN") and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in line


def test_cpu_torch_on_a_gpu_machine_fails(capsys, monkeypatch):
    import torch

    from tests.hardware.fake_pynvml import FakeDevice, install_pynvml, make_pynvml

    monkeypatch.setattr(torch.version, "cuda", None)
    install_pynvml(monkeypatch, make_pynvml([FakeDevice("GPU-1111")]))
    code, out, _ = run_cli(capsys)
    torch_line = next(x for x in out.splitlines() if x.split()[1] == "torch")
    assert code == 1 and torch_line.startswith("FAIL") and "CPU-only" in torch_line
    assert next(x for x in out.splitlines() if x.split()[1] == "nvml").startswith("PASS")


def test_symlinked_lease_dir_fails(simulate, capsys, monkeypatch, tmp_path):
    simulate([h100()])
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(tmp_path / "link"))
    code, out, _ = run_cli(capsys, "--no-torch")
    line = next(x for x in out.splitlines() if x.split()[1] == "lease_dir")
    assert code == 1 and line.startswith("FAIL") and "symlink" in line


def test_no_driver_is_a_warning(capsys, monkeypatch):
    from tests.hardware.fake_pynvml import ERROR_CODES, FakeDevice, install_pynvml, make_pynvml

    absent = make_pynvml([FakeDevice("GPU-1")], init_error=ERROR_CODES["NVML_ERROR_LIBRARY_NOT_FOUND"])
    install_pynvml(monkeypatch, absent)
    code, out, _ = run_cli(capsys, "--json")
    doc = json.loads(out)
    status = {c["name"]: c["status"] for c in doc["checks"]}
    assert code == 0 and status["nvml"] == "warn" and status["gpus"] == "skip"


def test_no_torch_option_imports_no_torch(simulate):
    import os
    import subprocess
    from pathlib import Path

    import devicekit

    simulate([h100()])
    code = ("import sys\nfrom devicekit.cli.main import main\n"
            "try:\n    main(['doctor', '--no-torch', '--json'])\nexcept SystemExit as e:\n"
            "    rc = e.code\nprint('torch' in sys.modules, rc, file=sys.stderr)\n")
    env = dict(os.environ, PYTHONPATH=str(Path(devicekit.__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.stderr.strip() == "False 0", done.stderr
    assert [c["name"] for c in json.loads(done.stdout)["checks"]] == [
        n for n in NAMES if n not in ("torch", "torch_version", "nccl")]


def test_each_check_is_printed_as_soon_as_it_has_run(simulate, capsys, monkeypatch):
    from devicekit.sharing import doctor_checks as checks_module

    simulate([h100()])
    seen: list[str] = []
    real = checks_module.check_lease_dir

    def lease_dir_noting_what_is_shown():
        seen.append(capsys.readouterr().out)
        return real()

    monkeypatch.setattr(checks_module, "check_lease_dir", lease_dir_noting_what_is_shown)
    code, out, _ = run_cli(capsys, "--no-torch")
    assert code == 0
    shown = [line.split()[1] for line in seen[0].splitlines()]
    assert shown == ["nvml", "gpus", "cuda_device_order", "cuda_visible_devices"]
    assert [line.split()[1] for line in out.strip().splitlines()[:4]] == [
        "lease_dir", "queue_policy", "pid_namespace", "launcher"]


def test_terminal_gets_coloured_statuses(simulate, tmp_path):
    import os
    import pty
    import select
    import subprocess
    import time

    from tests.ranks import child_env

    path = simulate([h100(), A100])  # mixed models: a WARN line
    env = child_env(DEVICEKIT_SIMULATE=str(path), TERM="xterm-256color", COLUMNS="200")
    env.pop("NO_COLOR", None)
    primary, secondary = pty.openpty()
    child = None
    try:
        child = subprocess.Popen([sys.executable, "-m", "devicekit", "doctor", "--no-torch"],
                                 stdin=subprocess.DEVNULL, stdout=secondary,
                                 stderr=subprocess.PIPE, env=env)
        os.close(secondary)
        chunks = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if not select.select([primary], [], [], 1)[0]:
                continue
            try:
                data = os.read(primary, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
        assert child.wait(timeout=5) == 0
    finally:
        os.close(primary)
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
    text = b"".join(chunks).decode()
    assert re.search(r"\x1b\[[0-9;]*33m[^\x1b]*WARN", text), text  # yellow WARN
    assert re.search(r"\x1b\[[0-9;]*32m[^\x1b]*PASS", text), text  # green PASS
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", text)
    assert "running checks" in plain


def test_a_torch_below_the_floor_fails_doctor(simulate, capsys, monkeypatch):
    import torch

    from devicekit.hardware.torch_checks import TORCH_FLOOR

    simulate([h100()])
    older = f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1] - 1}.1+cu121"
    monkeypatch.setattr(torch, "__version__", older)
    code, out, _ = run_cli(capsys)
    line = next(x for x in out.splitlines() if x.split()[1:2] == ["torch_version"])
    assert code == 1 and line.startswith("FAIL") and older in line and "pip install" in line
