"""MIG instances are selected and leased by their MIG UUIDs, with their own memory."""

import io
import json
import os
import sys

import pytest
import torch

import devicekit as dk
from devicekit.errors import InvalidValueError, NoDeviceAvailable
from devicekit.hardware import inventory
from devicekit.hardware.mig import leasable_devices
from devicekit.selection.choose import select_gpus
from devicekit.sharing.leases import Lease, read_leases
from devicekit.sharing.machine_status import collect_status
from tests.conftest import h100
from tests.hardware.fake_pynvml import FakeDevice, install_pynvml, make_pynvml

SMALL = "MIG-11111111-2222-3333-4444-555555555555"
LARGE = "MIG-66666666-2222-3333-4444-555555555555"
A100 = {"name": "NVIDIA A100-SXM4-80GB", "memory_total": "80GiB", "mig": [
    {"name": "1g.10gb", "memory_total": "10GiB", "memory_used": "1GiB", "uuid": SMALL},
    {"name": "3g.40gb", "memory_total": "40GiB", "uuid": LARGE}]}


@pytest.fixture
def machine(simulate):
    """GPU 0: a whole H100 with 10 GiB free; GPU 1: an A100 in MIG mode, 9 and 40 GiB free."""
    simulate([h100(used="70GiB"), A100])
    return dk.gpus()


def test_a_mig_instance_is_chosen_and_leased_by_its_uuid(machine, monkeypatch):
    with select_gpus(1, min_free_memory="20GiB") as sel:
        (dev,) = sel.gpus
        assert (dev.uuid, dev.label, dev.memory_free, dev.parent_uuid) == (
            LARGE, "GPU 1 MIG 1", 40 * 2**30, machine[1].uuid)
        assert sel.cuda_visible_devices == LARGE
        assert sel.rejected == ["GPU 0: 10 GiB free < 20 GiB asked",
                                "GPU 1 MIG 0: 10 GiB total < 20 GiB asked"]
        assert [r.gpu_uuid for r in read_leases()] == [LARGE]
        with pytest.raises(NoDeviceAvailable, match="GPU 1 MIG 1: leased by"):
            select_gpus(1, min_free_memory="20GiB")
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", sel.cuda_visible_devices)
        assert sel.devices == [torch.device("cuda", 0)]
        with pytest.raises(InvalidValueError, match="MIG instance has no index"):
            sel.to_env("index")
    assert read_leases() == []


def test_the_mig_parent_is_no_candidate_but_a_gpu_in_mig_mode_without_instances_says_why(simulate):
    simulate([{**A100, "mig": True}, A100 | {"mig": A100["mig"]}])
    names = [d.label for d in leasable_devices(dk.gpus())]
    assert names == ["GPU 0", "GPU 1 MIG 0", "GPU 1 MIG 1"]
    sel = select_gpus(1, lease=False, order="index")
    assert sel.gpus[0].uuid == SMALL
    assert sel.rejected[0] == ("GPU 0: in MIG mode without MIG instances (create them with "
                               "'nvidia-smi mig')")


def test_several_devices_never_include_a_mig_instance(machine):
    with pytest.raises(NoDeviceAvailable, match="CUDA gives a process one MIG instance") as info:
        select_gpus(2)
    assert not info.value.waiting_helps
    sel = select_gpus("all", lease=False)
    assert [g.label for g in sel.gpus] == ["GPU 0"]


def test_exclude_and_visible_devices_name_instances(machine, monkeypatch):
    assert select_gpus(1, exclude=[LARGE], lease=False).gpus[0].uuid == machine[0].uuid
    assert select_gpus(1, exclude=[0, LARGE], lease=False).gpus[0].uuid == SMALL
    with pytest.raises(NoDeviceAvailable):
        select_gpus(1, exclude=[0, 1], lease=False)  # an index names every instance of it
    with pytest.raises(NoDeviceAvailable):
        select_gpus(1, exclude=[0, machine[1].uuid], lease=False)  # and so does its UUID
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", SMALL)
    sel = select_gpus(1, lease=False)
    assert sel.gpus[0].uuid == SMALL
    assert any(line.startswith("GPU 1 MIG 1: hidden by CUDA_VISIBLE_DEVICES") for line in sel.rejected)


def test_share_leases_on_a_mig_instance_budget_its_own_memory(machine):
    a = select_gpus(1, min_free_memory="25GiB", share=True)
    assert a.gpus[0].uuid == LARGE
    with pytest.raises(NoDeviceAvailable, match="GPU 1 MIG 1: 15 GiB free after shared leases"):
        select_gpus(1, min_free_memory="25GiB", share=True)
    a.release()


def test_status_shows_instances_under_their_gpu_with_their_leases(machine):
    from rich.console import Console

    from devicekit.sharing.status_table import render_status

    with Lease.acquire([LARGE], command="python train.py"):
        report = collect_status()
        doc = report.to_dict()
        small, large = doc["gpus"][1]["mig_devices"]
        assert small["leases"] == [] and [r["gpu_uuid"] for r in large["leases"]] == [LARGE]
        assert large["memory_free"] == 40 * 2**30
        assert "parent_uuid" not in doc["gpus"][0]  # physical GPUs: the schema is unchanged
        out = io.StringIO()
        Console(file=out, width=150).print(render_status(report))
        text = out.getvalue()
    rows = text.splitlines()
    mig_row = next(r for r in rows if "└ MIG 3g.40gb" in r)
    assert mig_row.split()[0] == "1/1" and f"({os.getpid()})" in mig_row  # its lease cell
    assert "0.0/40 GiB" in mig_row
    assert any(r.split()[:1] == ["1/1"] and "python train.py" in r for r in rows)  # lease table


def test_select_cli_prints_the_mig_uuid(machine, capsys):
    from devicekit.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(["select", "--min-free", "20GiB"])
    out, err = capsys.readouterr()
    assert info.value.code == 0 and out == f"{LARGE}\n"
    assert "chose GPU 1 MIG 1 (40 GiB free)" in err
    with pytest.raises(SystemExit) as info:
        main(["select", "--min-free", "20GiB", "--format", "index"])
    assert info.value.code == 1 and "use format 'uuid'" in capsys.readouterr().err


def test_run_gives_the_child_the_mig_uuid_and_holds_its_lease(machine, tmp_path):
    from devicekit.jobs.run import RunRequest, execute, plan_run
    from tests.children import child_env

    report = tmp_path / "child.json"
    code = ("import json, os, sys; from devicekit.sharing.leases import read_leases; "
            "json.dump([os.environ['CUDA_VISIBLE_DEVICES'], [r.gpu_uuid for r in read_leases()]],"
            " open(sys.argv[1], 'w'))")
    plan = plan_run(RunRequest(command=[sys.executable, "-c", code, str(report)],
                               min_free_memory="20GiB"), environ=child_env())
    try:
        assert plan.env["CUDA_VISIBLE_DEVICES"] == LARGE
        assert execute(plan) == 0
    finally:
        plan.allocation.release()
    assert json.loads(report.read_text()) == [LARGE, [LARGE]]  # leased while the child ran
    assert read_leases() == []


def test_mig_instances_through_nvml(monkeypatch):
    slots = [FakeDevice(SMALL, name="1g.10gb", total=10 * 2**30, used=2**30), None,
             FakeDevice(LARGE, name="3g.40gb", total=40 * 2**30, used=4 * 2**30)]
    parent = FakeDevice("GPU-abcdef01-2222-3333-4444-555555555555", name="NVIDIA A100-SXM4-80GB",
                        mig_mode=(1, 1), mig_slots=slots)
    install_pynvml(monkeypatch, make_pynvml([parent]))
    inventory._cache.clear()
    with select_gpus(1, min_free_memory="20GiB") as sel:
        assert sel.cuda_visible_devices == LARGE and sel.gpus[0].memory_free == 36 * 2**30
        assert [r.gpu_uuid for r in read_leases()] == [LARGE]
    with select_gpus(1, order="index") as sel:
        assert sel.gpus[0].uuid == SMALL and sel.gpus[0].memory_total == 10 * 2**30
