"""Host facts via psutil."""

from __future__ import annotations

import json
import os
import socket
import time

import psutil

import devicekit as dk
from devicekit.hardware.host import Host, host


def test_host_facts_are_real():
    h = dk.host()
    assert isinstance(h, Host)
    assert h.hostname == socket.gethostname()
    assert h.cpu_count_logical == psutil.cpu_count(logical=True)
    assert h.cpu_count_physical is None or 1 <= h.cpu_count_physical <= h.cpu_count_logical
    assert 0 < h.memory_available <= h.memory_total and 0 < h.memory_used <= h.memory_total
    if hasattr(os, "getloadavg"):
        assert h.load_average is not None and len(h.load_average) == 3
        assert all(x >= 0 for x in h.load_average)
    if hasattr(os, "sched_getaffinity"):
        assert h.cpu_affinity == tuple(sorted(os.sched_getaffinity(0)))
        assert h.usable_cpus == len(os.sched_getaffinity(0))


def test_host_does_not_sleep(monkeypatch):
    intervals = []
    real_percent = psutil.cpu_percent

    def recording(interval=None, percpu=False):
        intervals.append(interval)
        return real_percent(interval=None, percpu=percpu)

    def no_sleep(seconds):
        raise AssertionError(f"host() slept {seconds} s")

    monkeypatch.setattr(psutil, "cpu_percent", recording)
    monkeypatch.setattr(time, "sleep", no_sleep)
    host()
    assert intervals == [None]  # the non-blocking reading, never psutil's sleeping one


def test_cpu_percent_needs_a_window(monkeypatch):
    from devicekit.hardware import host as host_module

    clock = [1000.0]
    monkeypatch.setattr(host_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(host_module, "_last_cpu_reading", [])
    assert host().cpu_percent is None  # first reading of the process: no window yet
    clock[0] += 0.01
    assert host().cpu_percent is None  # 10 ms: too short to mean anything
    clock[0] += 2.0
    sum(i * i for i in range(100_000))  # some work between two readings
    value = host().cpu_percent
    assert value is not None and 0.0 <= value <= 100.0


def test_usable_cpus_follows_affinity():
    base = host()
    narrowed = Host(**{**base.__dict__, "cpu_affinity": (0,)})
    assert narrowed.usable_cpus == 1
    unknown = Host(**{**base.__dict__, "cpu_affinity": None})
    assert unknown.usable_cpus == base.cpu_count_logical


def test_to_dict_is_json():
    data = json.loads(json.dumps(host().to_dict()))
    assert set(data) >= {"hostname", "cpu_count_logical", "cpu_count_physical", "load_average",
                         "cpu_percent", "memory_total", "memory_available", "memory_used",
                         "cpu_affinity", "usable_cpus"}
