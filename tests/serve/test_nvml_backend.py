"""``devicekit serve`` over the NVML backend (a fake pynvml with NVML's API): the numbers NVML
gives reach /metrics unchanged, MIG instances included, and requests make no NVML call."""

from __future__ import annotations

import os

from prometheus_client.parser import text_string_to_metric_families

from devicekit.hardware import inventory
from devicekit.serve import StatusServer
from tests.hardware.fake_pynvml import FakeDevice, install_pynvml, make_pynvml
from tests.serve.conftest import get, get_json

GPU0 = "GPU-5d9b2f4e-1111-2222-3333-444455556666"
GPU1 = "GPU-aa11bb22-1111-2222-3333-444455556666"
MIG0 = "MIG-11111111-2222-3333-4444-555555555555"


def test_nvml_numbers_reach_metrics_and_requests_make_no_nvml_call(monkeypatch):
    me = os.getpid()
    mig = [FakeDevice(MIG0, name="1g.10gb", total=10 * 2**30, used=2**30)]
    fake = make_pynvml([
        FakeDevice(GPU0, used=3 * 2**30, gpu_rate=40, memory_rate=15, temperature=55,
                   power_mw=300_000, limit_mw=700_000, compute_procs=[(me, 2**30)]),
        FakeDevice(GPU1, name="NVIDIA A100-SXM4-80GB", bus_id="00000000:18:00.0",
                   mig_mode=(1, 1), mig_slots=mig),
    ])
    install_pynvml(monkeypatch, fake)
    inventory._cache.clear()
    with StatusServer("127.0.0.1", 0, interval=3600) as server:  # one sample, at start
        doc = get_json(server)
        assert doc["backend"] == "nvml"
        calls = sum(fake.calls.values())
        for path in ("/metrics", "/", "/fragment", "/api/status") * 5:
            assert get(server, path)[0] == 200
        assert sum(fake.calls.values()) == calls  # every answer came from the cached snapshot
        text = get(server, "/metrics")[2].decode()
    found, users = {}, {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, sample.labels.get("uuid"))] = (sample.labels, sample.value)
            if sample.name == "devicekit_user_gpu_memory_bytes":
                users[sample.labels["user"]] = sample.value
    assert found[("devicekit_gpu_temperature_celsius", GPU0)][1] == 55
    assert found[("devicekit_gpu_power_draw_watts", GPU0)][1] == 300.0
    assert found[("devicekit_gpu_power_limit_watts", GPU0)][1] == 700.0
    assert found[("devicekit_gpu_utilization_percent", GPU0)][1] == doc["gpus"][0]["utilization"]
    assert found[("devicekit_gpu_memory_used_bytes", GPU0)][1] == 3 * 2**30
    labels, value = found[("devicekit_mig_memory_used_bytes", MIG0)]
    assert value == 2**30 and labels["gpu"] == "1" and labels["name"] == "1g.10gb"
    me_user = doc["gpus"][0]["processes"][0]["user"]
    assert me_user and users == {me_user: 2**30}  # this process's owner, as NVML's pid says
