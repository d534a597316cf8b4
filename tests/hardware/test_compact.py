"""The compact forms of ``dk.show_utilization``: one line per GPU, one line for this process."""

from __future__ import annotations

import io
import subprocess
import sys
from types import SimpleNamespace

import pytest

import devicekit as dk
from tests.conftest import h100

GiB = 1024**3
UUID0 = "GPU-00000000-0000-0000-0000-00000000000a"
UUID1 = "GPU-00000000-0000-0000-0000-00000000000b"


def test_compact_is_one_line_per_gpu(simulate):
    simulate([h100(used="10GiB", util=12, uuid=UUID0,
                   processes=[{"pid": 4242, "memory": "2GiB", "command": "python train.py"}]),
              h100(used="40GiB", util=0, uuid=UUID1)])
    buffer = io.StringIO()
    dk.show_utilization(compact=True, file=buffer)
    assert buffer.getvalue().splitlines() == [
        "GPU 0 NVIDIA H100 80GB HBM3: 12% busy, 10 GiB / 80 GiB used (12%), 1 process",
        "GPU 1 NVIDIA H100 80GB HBM3: 0% busy, 40 GiB / 80 GiB used (50%), 0 processes",
    ]


def test_compact_label_goes_in_front_and_stdout_is_the_default(simulate, capsys):
    simulate([h100(used="8GiB", util=50)])
    dk.show_utilization(compact=True, label="step 7")
    assert capsys.readouterr().out == (
        "step 7: GPU 0 NVIDIA H100 80GB HBM3: 50% busy, 8 GiB / 80 GiB used (10%), 0 processes\n")


def test_compact_does_not_import_torch(simulate):
    path = simulate([h100()])
    code = ("import sys, devicekit as dk; dk.show_utilization(compact=True); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "DEVICEKIT_SIMULATE": str(path)})
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1


def test_this_process_on_cpu_is_one_line(simulate, capsys):
    simulate([h100()])
    dk.show_utilization(this_process=True, label="step 1")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("step 1: cpu rss ") and ", RAM " in lines[0]


def test_this_process_names_its_cuda_devices_with_nvml_used_total(simulate, monkeypatch, capsys):
    import torch

    simulate([h100(used="10GiB", uuid=UUID0), h100(used="30GiB", uuid=UUID1),
              h100(used="1GiB")])
    # this process: cuda:0 is physical GPU 1 (memory there), cuda:1 is GPU 0 (nothing of ours)
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, uuid=UUID1[4:]),
             SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * GiB, uuid=UUID0[4:])]
    reserved = [2 * GiB, 0]
    cuda = torch.cuda
    for name, fake in {
        "is_available": lambda: True, "is_initialized": lambda: True, "device_count": lambda: 2,
        "current_device": lambda: 0, "get_device_properties": lambda i: props[i],
        "memory_reserved": lambda i=0: reserved[i], "memory_allocated": lambda i=0: GiB + GiB // 2,
        "max_memory_allocated": lambda i=0: GiB * 7 // 4,
        "mem_get_info": lambda i=0: (50 * GiB, 80 * GiB),
    }.items():
        monkeypatch.setattr(cuda, name, fake)
    dk.show_utilization(this_process=True, label="step 3")
    assert capsys.readouterr().out == (
        "step 3: cuda:0 (GPU 1) alloc 1.5 GiB, reserved 2 GiB, peak 1.8 GiB, "
        "GPU 30 GiB / 80 GiB used\n")


def test_label_without_a_compact_form_is_a_one_line_error(simulate):
    simulate([h100()])
    with pytest.raises(dk.InvalidValueError, match="label= goes with compact=True"):
        dk.show_utilization(label="step 1")
