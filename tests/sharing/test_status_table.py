"""The utilization table (dk.show_utilization / devicekit status) and the status report."""

from __future__ import annotations

import io
import json
import os
import time

import pytest

import devicekit as dk
from devicekit.hardware.gpu import GPU, GPUProcess, MigDevice
from devicekit.hardware.host import host
from devicekit.sharing.leases import Lease, LeaseRecord
from devicekit.sharing.machine_status import (
    SCHEMA_VERSION,
    StatusReport,
    collect_status,
    leases_by_gpu,
)
from devicekit.sharing.status_table import fit_widths, render_status
from tests.conftest import h100

GiB = 2**30


def _gpu(index: int, **kw) -> GPU:
    base = dict(index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000",
                name="NVIDIA H100 80GB HBM3", memory_total=80 * GiB, memory_used=10 * GiB,
                memory_free=70 * GiB, utilization=35.0, memory_bandwidth_utilization=12.0,
                temperature=55, power_draw=250.4, power_limit=700.0)
    base.update(kw)
    return GPU(**base)


def _lease(gpu: GPU, user: str = "bob", pid: int = 812, memory: int | None = None,
           share: bool = False, since: float | None = None) -> LeaseRecord:
    return LeaseRecord(gpu_uuid=gpu.uuid, pid=pid, user=user, host="node1",
                       command="python train.py --epochs 3", since=since or time.time() - 125,
                       memory=memory, share=share)


def _text(renderable, width: int = 140) -> str:
    from rich.console import Console

    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None).print(renderable)
    return buffer.getvalue()


def test_table_shows_gpus_processes_users_and_leases():
    busy = _gpu(0, processes=(GPUProcess(4242, "alice", "python big.py", 9 * GiB),
                              GPUProcess(4343, None, None, None)))
    idle = _gpu(1, memory_used=0, memory_free=80 * GiB, utilization=None, temperature=None,
                power_draw=None)
    shared = _gpu(2, name="NVIDIA A100-SXM4-40GB", memory_total=40 * GiB, memory_free=30 * GiB)
    report = StatusReport(host=host(), backend="nvml", driver_version="550.54.15",
                          cuda_driver_version="12.4", gpus=(busy, idle, shared),
                          leases=(_lease(idle),
                                  _lease(shared, "carol", 900, 8 * GiB, True),
                                  _lease(shared, "dave", 901, 4 * GiB, True)))
    out = _text(render_status(report))
    lines = out.splitlines()
    assert "driver 550.54.15 (CUDA 12.4)" in lines[0] and "backend nvml" in lines[0]
    row0 = next(line for line in lines if line.lstrip().startswith("0 "))
    for cell in ("NVIDIA H100 80GB HBM3", "35%", "12%", "10.0/80 GiB", "55C", "250/700 W",
                 "2: ?,alice"):
        assert cell in row0, (cell, row0)
    row1 = next(line for line in lines if line.lstrip().startswith("1 "))
    assert "n/a" in row1 and "bob (812)" in row1
    row2 = next(line for line in lines if line.lstrip().startswith("2 "))
    assert "2 shared: carol,dave 12 GiB" in row2
    assert "Processes" in out and "python big.py" in out and "4343" in out
    assert "Leases" in out and "node1" in out and "2m05s" in out and "8 GiB (shared)" in out
    without = _text(render_status(report, all_processes=False))
    assert "Processes" not in without and "python big.py" not in without


def test_several_leases_that_are_not_shared_are_not_called_shared():
    # two whole-GPU lease files of `nobody` on one GPU (written by hand, kept locked) showed as
    # "2 shared: nobody", though neither is a share lease
    gpu = _gpu(0)
    report = StatusReport(host=host(), backend="nvml", driver_version=None, cuda_driver_version=None,
                          gpus=(gpu,), leases=(_lease(gpu, "nobody", 31625),
                                               _lease(gpu, "nobody", 31626)))
    row0 = next(line for line in _text(render_status(report)).splitlines()
                if line.lstrip().startswith("0 "))
    assert "2 leases: nobody" in row0 and "shared" not in row0, row0


def test_table_fits_an_80_column_terminal():
    report = StatusReport(host=host(), backend="nvml", driver_version=None, cuda_driver_version=None,
                          gpus=tuple(_gpu(i, processes=(GPUProcess(7, "someone-with-a-long-name"),))
                                     for i in range(3)))
    out = _text(render_status(report, all_processes=False), width=80)
    rows = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(rows) == 3
    assert all(len(line) <= 80 for line in rows)
    assert all("10.0/80 GiB" in line and "250/700 W" in line for line in rows)  # numbers intact


def test_fit_widths_shrinks_text_columns_in_order():
    natural, flexible = [3, 30, 4, 12, 12], {4: 5, 3: 5, 1: 10}
    assert fit_widths(natural, flexible, 61) == natural  # fits: untouched
    assert fit_widths(natural, flexible, 50) == [3, 30, 4, 8, 5]  # last column gives way first
    assert fit_widths(natural, flexible, 40) == [3, 23, 4, 5, 5]  # the name only at the end
    assert fit_widths(natural, flexible, 10) == [3, 10, 4, 5, 5]  # never below the minimums


def test_mig_and_orphan_leases():
    mig = MigDevice(0, "MIG-aaaa", "1g.10gb", 10 * GiB, 0)
    gpu = _gpu(0, mig_enabled=True, mig_devices=(mig,))
    on_mig = LeaseRecord("MIG-aaaa", 1, "eve", "h", "x", time.time(), None, False)
    orphan = LeaseRecord("GPU-gone", 2, "fay", "h", "y", time.time(), None, False)
    grouped, orphans = leases_by_gpu([gpu], [on_mig, orphan])
    assert grouped == {gpu.uuid: [on_mig]} and orphans == [orphan]
    report = StatusReport(host=host(), backend="nvml", driver_version=None,
                          cuda_driver_version=None, gpus=(gpu,), leases=(on_mig, orphan))
    out = _text(render_status(report))
    assert "[MIG x1]" in out and "eve (1)" in out and "GPU-gone" in out
    doc = report.to_dict()
    assert doc["gpus"][0]["leases"][0]["user"] == "eve"
    assert doc["other_leases"][0]["gpu_uuid"] == "GPU-gone"


def test_show_utilization_prints_live_leases(simulate):
    simulate([h100(used="2GiB", util=5, processes=[
        {"pid": 4242, "user": "alice", "memory": "2GiB", "command": "python train.py"}]),
        h100()])
    second = dk.gpus()[1]
    buffer = io.StringIO()
    with Lease.acquire([second.uuid], memory=20 * GiB, command="python mine.py"):
        dk.show_utilization(file=buffer)
        out = buffer.getvalue()
        assert "python train.py" in out and "alice" in out
        row1 = next(line for line in out.splitlines() if line.lstrip().startswith("1 "))
        assert f"({os.getpid()})" in row1 and "20 GiB" in row1
        assert "python mine.py" in out
    buffer = io.StringIO()
    dk.show_utilization(file=buffer, all_processes=False)
    out = buffer.getvalue()
    assert "Leases" not in out and "python train.py" not in out  # released, processes left out


def test_collect_status_document(simulate):
    simulate([h100(), h100(used="70GiB", util=90)])
    report = collect_status()
    doc = json.loads(json.dumps(report.to_dict()))
    assert doc["schema"] == SCHEMA_VERSION == 1
    assert doc["backend"] == "simulated" and doc["driver_version"] == "simulated"
    assert [g["index"] for g in doc["gpus"]] == [0, 1]
    assert doc["gpus"][1]["memory_free"] == 10 * GiB and doc["gpus"][1]["utilization"] == 90
    assert doc["gpus"][0]["leases"] == [] and doc["other_leases"] == [] and doc["warnings"] == []
    assert doc["host"]["cpu_count_logical"] >= 1


def test_broken_lease_dir_is_a_warning_not_a_crash(simulate, tmp_path, monkeypatch):
    simulate([h100()])
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(link))
    report = collect_status()
    assert len(report.gpus) == 1
    assert len(report.warnings) == 1 and "symlink" in report.warnings[0]
    assert "warning: leases not shown" in _text(render_status(report))


def test_status_does_not_create_the_lease_dir(simulate, tmp_path, monkeypatch):
    simulate([h100(mig=[{"name": "1g.10gb", "memory_total": "10GiB", "memory_used": "1GiB"}])])
    missing = tmp_path / "not-yet"
    monkeypatch.setenv("DEVICEKIT_LEASE_DIR", str(missing))
    doc = collect_status().to_dict()
    assert not missing.exists() and doc["warnings"] == [] and doc["gpus"][0]["leases"] == []
    assert doc["gpus"][0]["mig_devices"][0]["memory_free"] == 9 * GiB


def test_show_utilization_defaults_to_stdout(simulate, capsys):
    simulate([h100(used="40GiB", util=50)])
    assert dk.show_utilization() is None
    out = capsys.readouterr().out
    assert "40.0/80 GiB" in out and "50%" in out


def test_show_utilization_into_a_log_is_not_cut_to_80_columns(simulate, capsys, monkeypatch):
    """stdout redirected to a file (a batch job's log) gets the same roomy width as file=."""
    monkeypatch.delenv("COLUMNS", raising=False)
    procs = [{"pid": 10, "user": "alice", "memory": "1GiB"}, {"pid": 11, "user": "bob"}]
    simulate([h100(used="1GiB", processes=procs)])
    dk.show_utilization()
    out = capsys.readouterr().out
    assert "2: alice,bob" in out, out


def _lab_doc() -> dict:
    now = time.time()
    lock = {"gpu_uuid": "GPU-0", "pid": 812, "user": "bob", "host": "node1", "command": "python x.py",
            "since": now - 3725, "memory": None, "share": False, "kind": "lock", "job": "bert",
            "idle_since": now - 600, "stopped_since": None}
    return {"schema": 1, "taken_at": now, "backend": "nvml", "warnings": [],
            "host": {"hostname": "node1", "cpu_count_logical": 8, "memory_used": GiB,
                     "memory_total": 8 * GiB},
            "gpus": [{"index": 0, "uuid": "GPU-0", "name": "NVIDIA H100 80GB HBM3",
                      "memory_total": 80 * GiB, "memory_used": 10 * GiB, "utilization": 35,
                      "processes": [], "mig_devices": [], "leases": [lock], "blocked": None}],
            "other_leases": []}


def test_status_and_the_lab_render_one_document_the_same_way():
    """One renderer: the lock holder and the idle lease read alike here and in --hosts."""
    from devicekit.serve.lab import HostAnswer
    from devicekit.serve.lab_page import render_lab_fragment
    from devicekit.serve.lab_table import render_lab
    from devicekit.serve.peer_fetch import PeerAddress

    doc = _lab_doc()
    local = _text(render_status(doc))
    lab = _text(render_lab([HostAnswer(PeerAddress.parse("node1:9400"), doc)]))
    for out in (local, lab):
        row = next(line for line in out.splitlines() if "bob (812)" in line)
        assert "bob (812) (lock) idle" in row and "10.0/80 GiB" in row and "35%" in row, row
    assert "bert" in lab and "1h02m" in local and "(lock only) python x.py" in local
    page = render_lab_fragment({"taken_at": doc["taken_at"], "hosts": [
        {"host": "node1:9400", "status": doc, "error": None, "age": 1.0}]})
    assert '<tr class="leased"' in page and "<td>10.0/80 GiB</td>" in page and "idle 10m" in page


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "12", True, None, [], {"x": 1}, -1e300])
def test_a_document_with_odd_values_renders_without_raising(bad):
    """The document may be a peer's: every number is checked before it is formatted."""
    doc = _lab_doc()
    gpu = doc["gpus"][0]
    for key in ("index", "memory_total", "memory_used", "utilization", "temperature",
                "power_draw", "capability"):
        gpu[key] = bad
    gpu["leases"][0].update(since=bad, memory=bad, pid=bad, idle_since=bad)
    doc["host"].update(cpu_count_logical=bad, load_average=[bad], memory_used=bad)
    doc["taken_at"] = bad
    out = _text(render_status(doc))
    assert "bob" in out and "Leases" in out
