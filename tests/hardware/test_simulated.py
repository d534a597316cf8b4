import json

import pytest

import devicekit as dk
from devicekit.errors import SimulationFileError
from devicekit.hardware.inventory import gpus
from tests.conftest import h100


def test_simulated_inventory(simulate):
    simulate([
        h100(used="2GiB", util=5, processes=[
            {"pid": 4242, "user": "alice", "memory": "2GiB", "command": "python train.py"}]),
        h100(temperature=40, compute_capability="9.0", mig=[{"name": "1g.10gb", "memory_total": "10GiB"}]),
    ])
    found = gpus()
    assert [g.index for g in found] == [0, 1]
    first, second = found
    assert first.memory_free == 78 * 2**30
    assert first.processes[0].user == "alice" and first.processes[0].memory == 2 * 2**30
    assert first.backend == "simulated"
    assert first.uuid != second.uuid and first.uuid.startswith("GPU-")
    assert second.compute_capability == (9, 0) and second.mig_enabled
    assert second.mig_devices[0].memory_free == 10 * 2**30
    # stable across snapshots (leases key on the uuid)
    assert gpus()[0].uuid == first.uuid
    assert json.loads(json.dumps(first.to_dict()))["memory_total"] == 80 * 2**30


def test_public_alias(simulate):
    simulate([h100()])
    assert len(dk.gpus()) == 1


@pytest.mark.parametrize(
    "content,needle",
    [
        ("not json", "not valid JSON"),
        (json.dumps({"gpu": []}), "'gpus' list"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "10XB"}]}), "gpus[0].memory_total"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB", "colour": 1}]}), "'colour'"),
        (json.dumps({"gpus": [{"name": "x"}]}), "missing key 'memory_total'"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "0GiB"}]}), "gpus[0].memory_total: '0GiB' is no memory"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB", "memory_used": "2GiB"}]}),
         "larger than memory_total"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB", "utilization": 140}]}),
         "gpus[0].utilization"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB",
                               "processes": [{"pid": "abc"}]}]}), "processes[0].pid"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB",
                               "processes": [{"pid": 1, "user": 5}]}]}), "processes[0].user"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB",
                               "compute_capability": [float("inf"), 0]}]}),
         "gpus[0].compute_capability"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB", "utilization": float("nan")}]}),
         "gpus[0].utilization"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB", "uuid": "GPU-a"},
                              {"name": "y", "memory_total": "1GiB", "uuid": "GPU-a"}]}),
         "gpus[1].uuid"),
        (json.dumps({"gpus": [{"name": "x", "memory_total": "1GiB",
                               "mig": [{"memory_total": "1GiB", "memory_used": "2GiB"}]}]}),
         "mig[0].memory_used"),
    ],
)
def test_malformed_file_names_file_and_key(tmp_path, monkeypatch, content, needle):
    path = tmp_path / "bad.json"
    path.write_text(content)
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
    with pytest.raises(SimulationFileError) as info:
        gpus()
    assert str(path) in str(info.value) and needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path, monkeypatch):
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(tmp_path / "nope.json"))
    with pytest.raises(SimulationFileError, match="cannot be read"):
        gpus()


def test_file_that_is_not_text(tmp_path, monkeypatch):
    path = tmp_path / "gpus.json"
    path.write_bytes(b"\xff\xfe{}")
    monkeypatch.setenv("DEVICEKIT_SIMULATE", str(path))
    with pytest.raises(SimulationFileError, match="not valid JSON"):
        gpus()
