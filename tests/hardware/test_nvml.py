"""The NVML backend against a fake ``pynvml`` (no driver on CI machines)."""

from __future__ import annotations

import getpass
import inspect
import os

import psutil
import pytest

from devicekit.errors import BackendError, InvalidValueError, NVMLUnavailableError
from devicekit.hardware import inventory
from devicekit.hardware.nvml import NVMLBackend, NVMLNotFound
from tests.hardware.fake_pynvml import (
    ERROR_CODES,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    NOT_SUPPORTED,
    FakeDevice,
    install_pynvml,
    make_pynvml,
)

UUID0 = "GPU-5d9b2f4e-1111-2222-3333-444455556666"
UUID1 = "GPU-aa11bb22-1111-2222-3333-444455556666"


@pytest.fixture
def fake_nvml(monkeypatch):
    """``fake_nvml([FakeDevice(...)], **opts)`` installs a fake pynvml and returns it."""

    def install(devices, **options):
        module = make_pynvml(devices, **options)
        install_pynvml(monkeypatch, module)
        inventory._cache.clear()
        return module

    return install


def test_fake_matches_real_pynvml():
    """Every name the fake offers exists in the real module, so the tests track the real API."""
    real = pytest.importorskip("pynvml")
    fake = make_pynvml([])
    public = [n for n in vars(fake) if n.startswith(("nvml", "NVML"))]
    assert len(public) > 30
    missing = [n for n in public if not hasattr(real, n)]
    assert missing == []
    for name, code in ERROR_CODES.items():
        assert getattr(real, name) == code
        assert type(real.NVMLError(code)).__name__ == type(fake.NVMLError(code)).__name__
    for name in public:  # same number of parameters, same defaults
        if callable(getattr(fake, name)) and not isinstance(getattr(fake, name), type):
            ours = inspect.signature(getattr(fake, name)).parameters.values()
            theirs = inspect.signature(getattr(real, name)).parameters.values()
            assert [p.default for p in ours] == [p.default for p in theirs], name


def test_snapshot_reports_every_fact(fake_nvml):
    fake_nvml([
        FakeDevice(UUID0, used=2 * 2**30, gpu_rate=7, memory_rate=3, temperature=41,
                   power_mw=123_400, limit_mw=700_000, cc=(9, 0), compute_mode=3,
                   bus_id="00000000:17:00.0"),
        FakeDevice(UUID1, name="NVIDIA A100-SXM4-40GB", total=40 * 2**30, cc=(8, 0),
                   bus_id="00000000:65:00.0"),
    ])
    backend = NVMLBackend()
    first, second = backend.snapshot()
    assert (first.index, first.uuid, first.name) == (0, UUID0, "NVIDIA H100 80GB HBM3")
    assert first.pci_bus_id == "00000000:17:00.0"
    assert (first.memory_total, first.memory_used, first.memory_free) == (
        80 * 2**30, 2 * 2**30, 78 * 2**30)
    assert first.utilization == 7.0 and first.memory_bandwidth_utilization == 3.0
    assert first.temperature == 41
    assert first.power_draw == pytest.approx(123.4) and first.power_limit == 700.0
    assert first.compute_capability == (9, 0) and first.compute_mode == "exclusive_process"
    assert first.mig_enabled is False and first.mig_devices == ()
    assert first.backend == "nvml"
    assert (second.index, second.uuid, second.compute_capability) == (1, UUID1, (8, 0))
    assert second.to_dict()["compute_capability"] == "8.0"
    assert backend.driver_version() == "550.54.15"
    assert backend.cuda_driver_version() == "12.4"
    assert backend.nvml_version() == "12.550.54.15"


def test_init_once_and_handles_cached(fake_nvml):
    module = fake_nvml([FakeDevice(UUID0), FakeDevice(UUID1)])
    backend = NVMLBackend()
    for _ in range(3):
        backend.snapshot()
    NVMLBackend().snapshot()
    assert module.calls["nvmlInit"] == 1
    assert module.calls["nvmlDeviceGetHandleByIndex"] == 4  # 2 per backend, none per snapshot
    assert module.calls["nvmlDeviceGetUUID"] == 4  # static facts read once per backend
    assert module.calls["nvmlDeviceGetMemoryInfo"] == 8  # live facts read on every snapshot


def test_utilization_is_averaged_over_the_window(fake_nvml):
    fake_nvml([FakeDevice(
        UUID0, gpu_rate=99, memory_rate=99,
        gpu_samples=[(30.0, 100), (2.0, 40), (1.0, 60), (0.1, 50)],  # the 30 s old one is outside
        memory_samples=[(1.5, 10), (0.5, 30)],
    )])
    gpu = NVMLBackend(utilization_window=5.0).snapshot()[0]
    assert gpu.utilization == pytest.approx(50.0)
    assert gpu.memory_bandwidth_utilization == pytest.approx(20.0)


@pytest.mark.parametrize("window", [0, -1, float("nan"), "5", True, 1e9])
def test_bad_utilization_window(fake_nvml, window):
    fake_nvml([FakeDevice(UUID0)])
    with pytest.raises(InvalidValueError, match="utilization_window"):
        NVMLBackend(utilization_window=window)


def test_utilization_falls_back_to_one_reading(fake_nvml):
    # sampling unsupported (None) or no sample inside the window: the instantaneous rates
    fake_nvml([FakeDevice(UUID0, gpu_rate=12, memory_rate=34, gpu_samples=None,
                          memory_samples=[(60.0, 90)])])
    gpu = NVMLBackend(utilization_window=5.0).snapshot()[0]
    assert (gpu.utilization, gpu.memory_bandwidth_utilization) == (12.0, 34.0)


def test_unsupported_fields_become_none(fake_nvml):
    unsupported = {name: NOT_SUPPORTED for name in (
        "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage", "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetComputeMode",
        "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetMigMode", "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetComputeRunningProcesses")}
    unsupported["nvmlDeviceGetGraphicsRunningProcesses"] = FUNCTION_NOT_FOUND
    unsupported["nvmlDeviceGetMemoryInfo_v2"] = FUNCTION_NOT_FOUND  # old driver: v1 is used
    unsupported["NVML_FI_DEV_POWER_AVERAGE"] = NOT_SUPPORTED  # no power fields: classic calls
    unsupported["NVML_FI_DEV_POWER_CURRENT_LIMIT"] = NOT_SUPPORTED
    fake_nvml([FakeDevice(UUID0, used=2**30, errors=unsupported)])
    gpu = NVMLBackend().snapshot()[0]
    assert gpu.memory_used == 2**30
    for name in ("temperature", "power_draw", "power_limit", "compute_capability",
                 "compute_mode", "utilization", "memory_bandwidth_utilization", "pci_bus_id"):
        assert getattr(gpu, name) is None, name
    assert gpu.mig_enabled is False and gpu.processes == ()


def test_a_failing_gpu_is_a_backend_error(fake_nvml):
    fake_nvml([FakeDevice(UUID0), FakeDevice(UUID1, errors={"nvmlDeviceGetTemperature": GPU_IS_LOST})])
    with pytest.raises(BackendError) as info:
        NVMLBackend().snapshot()
    message = str(info.value)
    assert "GPU 1" in message and "GPU is lost" in message and "\n" not in message
    assert not isinstance(info.value, NVMLUnavailableError)


@pytest.mark.parametrize("code", ["NVML_ERROR_LIBRARY_NOT_FOUND", "NVML_ERROR_DRIVER_NOT_LOADED"])
def test_no_driver_means_no_gpus(fake_nvml, code):
    fake_nvml([FakeDevice(UUID0)], init_error=ERROR_CODES[code])
    with pytest.raises(NVMLNotFound) as info:
        NVMLBackend()
    assert isinstance(info.value, NVMLUnavailableError) and "\n" not in str(info.value)
    assert inventory.gpus() == []
    assert inventory.backend().name == "none"


def test_missing_pynvml_package_means_no_gpus(monkeypatch):
    install_pynvml(monkeypatch, None)  # "import pynvml" raises ImportError
    with pytest.raises(NVMLNotFound, match="nvidia-ml-py"):
        NVMLBackend()
    assert inventory.gpus() == []


def test_broken_driver_is_a_backend_error(fake_nvml):
    fake_nvml([FakeDevice(UUID0)], init_error=ERROR_CODES["NVML_ERROR_LIB_RM_VERSION_MISMATCH"])
    with pytest.raises(BackendError, match="version mismatch") as info:
        inventory.gpus()
    assert not isinstance(info.value, NVMLNotFound)
    assert info.value.exit_code == 2


def test_mig_instances(fake_nvml):
    slots = [FakeDevice("MIG-11111111-2222-3333-4444-555555555555", name="1g.10gb",
                        total=10 * 2**30, used=2**30),
             None,
             FakeDevice("MIG-66666666-2222-3333-4444-555555555555", name="3g.40gb",
                        total=40 * 2**30)]
    module = fake_nvml([FakeDevice(UUID0, mig_mode=(1, 1), mig_slots=slots,
                                   errors={"nvmlDeviceGetUtilizationRates": NOT_SUPPORTED})])
    backend = NVMLBackend()
    gpu = backend.snapshot()[0]
    assert gpu.mig_enabled
    assert [(m.index, m.name, m.memory_free) for m in gpu.mig_devices] == [
        (0, "1g.10gb", 9 * 2**30), (1, "3g.40gb", 40 * 2**30)]
    assert gpu.mig_devices[1].uuid.startswith("MIG-66666666")
    assert gpu.utilization is None
    slots[0].used = 3 * 2**30  # the instances' memory is live; their names are settings
    opened = module.calls["nvmlDeviceGetMigDeviceHandleByIndex"]
    assert backend.snapshot()[0].mig_devices[0].memory_free == 7 * 2**30
    assert module.calls["nvmlDeviceGetMigDeviceHandleByIndex"] == opened


def _dead_pid() -> int:
    pid = 4_000_000
    while psutil.pid_exists(pid):
        pid += 1
    return pid


def test_processes_with_users_and_commands(fake_nvml):
    me = os.getpid()
    gone = _dead_pid()
    fake_nvml([FakeDevice(
        UUID0,
        compute_procs=[(me, 2**30), (gone, None), (1, 5 * 2**20)],
        graphics_procs=[(me, 2**30)],  # the same process in both lists counts once
    )])
    procs = {p.pid: p for p in NVMLBackend().snapshot()[0].processes}
    assert set(procs) == {me, gone, 1}
    mine = procs[me]
    assert mine.memory == 2**30
    assert mine.user == psutil.Process(me).username() or mine.user == getpass.getuser()
    assert "pytest" in (mine.command or "") or "python" in (mine.command or "")
    assert (procs[gone].user, procs[gone].command, procs[gone].memory) == (None, None, None)
    init = procs[1]  # another user's process: user and at least its name are still known
    assert init.user == psutil.Process(1).username() and init.command
    assert init.memory == 5 * 2**20


def test_bytes_from_old_bindings_are_decoded(fake_nvml):
    module = fake_nvml([FakeDevice(UUID0)])
    original = module.nvmlDeviceGetName
    module.nvmlDeviceGetName = lambda handle: original(handle).encode()
    module.nvmlSystemGetDriverVersion = lambda: b"535.104.05"
    backend = NVMLBackend()
    assert backend.snapshot()[0].name == "NVIDIA H100 80GB HBM3"
    assert backend.driver_version() == "535.104.05"


def test_gpu_fenced_off_by_a_job_allocation_is_left_out(fake_nvml):
    from devicekit.sharing.machine_status import collect_status

    module = fake_nvml([FakeDevice(UUID0), FakeDevice(UUID1), FakeDevice("GPU-3")])
    original = module.nvmlDeviceGetHandleByIndex

    def fenced(index):
        if index == 1:
            raise module.NVMLError(ERROR_CODES["NVML_ERROR_NO_PERMISSION"])
        return original(index)

    module.nvmlDeviceGetHandleByIndex = fenced
    gpus = inventory.gpus()
    assert [(g.index, g.uuid) for g in gpus] == [(0, UUID0), (2, "GPU-3")]  # indices kept
    report = collect_status()
    assert any("GPU 1 is not accessible" in w for w in report.warnings)


def test_processes_on_a_driver_older_than_the_bindings(fake_nvml):
    """Before R510 the driver has no ``_v3`` process calls: pynvml's unversioned wrapper then
    raises NVMLLibraryMismatchError (not an NVMLError); the ``_v2`` calls still list them."""
    me = os.getpid()
    module = fake_nvml([FakeDevice(UUID0, compute_procs=[(me, 2**30)], errors={
        "nvmlDeviceGetComputeRunningProcesses_v3": FUNCTION_NOT_FOUND,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": FUNCTION_NOT_FOUND,
    })])
    (gpu,) = NVMLBackend().snapshot()
    assert [(p.pid, p.memory) for p in gpu.processes] == [(me, 2**30)]
    assert module.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 1


# -- what a snapshot costs -----------------------------------------------------------------------

#: NVML calls per GPU on every snapshot: memory, temperature, power (draw and limit as field
#: values), the two utilization sample reads, the compute and graphics process lists
LIVE_CALLS = {"nvmlDeviceGetMemoryInfo": 1, "nvmlDeviceGetTemperature": 1,
              "nvmlDeviceGetFieldValues": 1, "nvmlDeviceGetSamples": 2,
              "nvmlDeviceGetComputeRunningProcesses": 1, "nvmlDeviceGetGraphicsRunningProcesses": 1}
#: and once per GPU (UUID, name, PCI, compute capability), or once per settings_ttl (the modes)
FIRST_ONLY = {"nvmlDeviceGetUUID": 1, "nvmlDeviceGetName": 1, "nvmlDeviceGetPciInfo": 1,
              "nvmlDeviceGetCudaComputeCapability": 1, "nvmlDeviceGetComputeMode": 1,
              "nvmlDeviceGetMigMode": 1}


def _busy_gpu(uuid: str) -> FakeDevice:
    return FakeDevice(uuid, used=2**30, gpu_samples=[(2.0, 40), (1.0, 60), (0.1, 50)],
                      memory_samples=[(1.5, 10), (0.5, 30)])


def _calls_of(module, fn) -> dict[str, int]:
    before = dict(module.calls)
    fn()
    return {name: n - before.get(name, 0) for name, n in module.calls.items()
            if n != before.get(name, 0)}


def test_nvml_calls_per_snapshot_of_a_4_gpu_machine(fake_nvml):
    """The count the H200's 3.73 ms snapshot came from (issue 38): 10 NVML calls per GPU, 12
    driver calls with two sample reads; now 7 per GPU after the first snapshot, the sample reads
    finding nothing new (one driver call each) when snapshots follow each other closely."""
    module = fake_nvml([_busy_gpu(f"GPU-{i}") for i in range(4)])
    backend = NVMLBackend()
    first = _calls_of(module, backend.snapshot)
    assert first == {name: 4 * n for name, n in {**LIVE_CALLS, **FIRST_ONLY}.items()}
    for _ in range(3):
        later = _calls_of(module, backend.snapshot)
        assert later == {name: 4 * n for name, n in LIVE_CALLS.items()}
    assert sum(later.values()) == 28
    gpu = backend.snapshot()[0]
    assert (gpu.power_draw, gpu.power_limit, gpu.compute_mode) == (120.0, 700.0, "default")
    assert (gpu.utilization, gpu.memory_bandwidth_utilization) == (pytest.approx(50.0),
                                                                   pytest.approx(20.0))


def test_power_without_field_values_uses_the_classic_calls_once_tried(fake_nvml):
    module = fake_nvml([FakeDevice(UUID0, errors={"nvmlDeviceGetFieldValues": FUNCTION_NOT_FOUND})])
    backend = NVMLBackend()
    for _ in range(3):
        gpu = backend.snapshot()[0]
        assert (gpu.power_draw, gpu.power_limit) == (120.0, 700.0)
    assert module.calls["nvmlDeviceGetFieldValues"] == 1  # not asked again
    assert module.calls["nvmlDeviceGetPowerUsage"] == 3  # live
    assert module.calls["nvmlDeviceGetEnforcedPowerLimit"] == 1  # a setting, re-read every ttl


def test_a_field_the_gpu_lacks_is_read_the_classic_way(fake_nvml):
    """An A100 or older driver: no one-second power average as a field; the limit still is one."""
    module = fake_nvml([FakeDevice(UUID0, power_mw=250_000,
                                   errors={"NVML_FI_DEV_POWER_AVERAGE": NOT_SUPPORTED})])
    asked: list[list[int]] = []
    original = module.nvmlDeviceGetFieldValues
    module.nvmlDeviceGetFieldValues = lambda h, ids: (asked.append(list(ids)), original(h, ids))[1]
    backend = NVMLBackend()
    for _ in range(2):
        gpu = backend.snapshot()[0]
        assert (gpu.power_draw, gpu.power_limit) == (250.0, 700.0)
    assert asked == [[185, 190], [190]]
    assert module.calls["nvmlDeviceGetPowerUsage"] == 2
    assert "nvmlDeviceGetEnforcedPowerLimit" not in module.calls


def test_settings_are_read_again_after_settings_ttl(fake_nvml):
    device = FakeDevice(UUID0)
    module = fake_nvml([device])
    backend = NVMLBackend(settings_ttl=10)
    now = [1000.0]
    backend._clock = lambda: now[0]
    assert backend.snapshot()[0].compute_mode == "default"
    device.compute_mode = 2  # an administrator: nvidia-smi -c PROHIBITED
    now[0] += 9
    assert backend.snapshot()[0].compute_mode == "default"  # kept for settings_ttl seconds
    now[0] += 2
    assert backend.snapshot()[0].compute_mode == "prohibited"
    assert module.calls["nvmlDeviceGetComputeMode"] == 2
    every = NVMLBackend(settings_ttl=0)
    every.snapshot(), every.snapshot()
    assert module.calls["nvmlDeviceGetComputeMode"] == 4
    with pytest.raises(InvalidValueError, match="settings_ttl"):
        NVMLBackend(settings_ttl=-1)


def test_samples_are_kept_and_only_newer_ones_asked_for(fake_nvml):
    """The mean is over the driver's samples of the last window, whether read at once or bit by
    bit: the second snapshot asks only for samples newer than the newest it has."""
    device = FakeDevice(UUID0, gpu_samples=[(30.0, 100), (2.0, 40), (1.0, 60), (0.1, 50)],
                        memory_samples=[(1.5, 10), (0.5, 30)])
    module = fake_nvml([device])
    asked: list[tuple[int, int]] = []
    original = module.nvmlDeviceGetSamples
    module.nvmlDeviceGetSamples = lambda h, kind, since: (asked.append((kind, since)),
                                                          original(h, kind, since))[1]
    backend = NVMLBackend(utilization_window=5.0)
    assert backend.snapshot()[0].utilization == pytest.approx(50.0)
    epoch_us = device.sample_epoch * 1_000_000
    asked.clear()
    gpu = backend.snapshot()[0]
    assert (gpu.utilization, gpu.memory_bandwidth_utilization) == (pytest.approx(50.0),
                                                                   pytest.approx(20.0))
    assert asked == [(1, int(epoch_us - 0.1e6)), (2, int(epoch_us - 0.5e6))]
    assert "nvmlDeviceGetUtilizationRates" not in module.calls  # nothing new is not "no samples"
    device.gpu_samples.append((-0.2, 90))  # the driver took one more
    assert backend.snapshot()[0].utilization == pytest.approx((40 + 60 + 50 + 90) / 4)
    later = device.sample_epoch + 4.5  # the window moved: what is older than 5 s is dropped
    backend._samples._clock = lambda: later
    assert backend.snapshot()[0].utilization == pytest.approx((50 + 90) / 2)


def test_old_driver_fallbacks_cost_their_failed_try_once(fake_nvml):
    me = os.getpid()
    module = fake_nvml([FakeDevice(UUID0, compute_procs=[(me, 2**30)], errors={
        "nvmlDeviceGetMemoryInfo_v2": FUNCTION_NOT_FOUND,
        "nvmlDeviceGetComputeRunningProcesses_v3": FUNCTION_NOT_FOUND,
        "nvmlDeviceGetGraphicsRunningProcesses_v3": FUNCTION_NOT_FOUND,
    })])
    backend = NVMLBackend()
    backend.snapshot()
    later = _calls_of(module, backend.snapshot)
    assert later["nvmlDeviceGetMemoryInfo"] == 1  # v1 straight away
    assert later["nvmlDeviceGetComputeRunningProcesses_v2"] == 1
    assert [p.pid for p in backend.snapshot()[0].processes] == [me]
