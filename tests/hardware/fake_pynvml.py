"""A stand-in for nvidia-ml-py's ``pynvml`` module, for testing the NVML backend on CPU.

It mimics the real API shape: the same function and constant names, an ``NVMLError`` whose
``__new__`` maps an error code to a generated subclass (``NVMLError_NotSupported``...), device
handles, struct-like return values, and the real call conventions (``nvmlDeviceGetSamples``
returns ``(value_type, samples)`` and raises NOT_FOUND when no sample is newer than the
timestamp given; ``nvmlDeviceGetFieldValues`` answers each field with its own return code).
``test_fake_matches_real_pynvml`` keeps the names honest against the real one.
"""

from __future__ import annotations

import functools
import string
import time
import types
from dataclasses import dataclass, field
from typing import Any

ERROR_CODES = {
    "NVML_ERROR_UNINITIALIZED": 1,
    "NVML_ERROR_NOT_SUPPORTED": 3,
    "NVML_ERROR_NO_PERMISSION": 4,
    "NVML_ERROR_NOT_FOUND": 6,
    "NVML_ERROR_DRIVER_NOT_LOADED": 9,
    "NVML_ERROR_LIBRARY_NOT_FOUND": 12,
    "NVML_ERROR_FUNCTION_NOT_FOUND": 13,
    "NVML_ERROR_GPU_IS_LOST": 15,
    "NVML_ERROR_LIB_RM_VERSION_MISMATCH": 18,
    "NVML_ERROR_UNKNOWN": 999,
}
MESSAGES = {
    1: "Uninitialized", 3: "Not Supported", 4: "Insufficient Permissions", 6: "Not Found",
    9: "Driver Not Loaded", 12: "NVML Shared Library Not Found", 13: "Function Not Found",
    15: "GPU is lost", 18: "RM has detected an NVML/RM version mismatch.", 999: "Unknown Error",
}
NOT_SUPPORTED = ERROR_CODES["NVML_ERROR_NOT_SUPPORTED"]
NOT_FOUND = ERROR_CODES["NVML_ERROR_NOT_FOUND"]
GPU_IS_LOST = ERROR_CODES["NVML_ERROR_GPU_IS_LOST"]
FUNCTION_NOT_FOUND = ERROR_CODES["NVML_ERROR_FUNCTION_NOT_FOUND"]


@dataclass
class FakeDevice:
    """One GPU (or MIG instance) as the fake driver reports it."""

    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = "00000000:17:00.0"
    total: int = 80 * 2**30
    used: int = 0
    gpu_rate: int = 0  # nvmlDeviceGetUtilizationRates().gpu
    memory_rate: int = 0  # nvmlDeviceGetUtilizationRates().memory
    #: (seconds before the first read, value) driver samples; None: nvmlDeviceGetSamples not
    #: supported. Their timestamps are fixed at the first nvmlDeviceGetSamples call
    #: (``sample_epoch``), as the driver's are; a negative age is a sample taken after it.
    gpu_samples: list[tuple[float, int]] | None = None
    memory_samples: list[tuple[float, int]] | None = None
    sample_epoch: float | None = None
    temperature: int = 40
    power_mw: int = 120_000
    limit_mw: int = 700_000
    cc: tuple[int, int] = (9, 0)
    compute_mode: int = 0
    mig_mode: tuple[int, int] = (0, 0)
    mig_slots: list[FakeDevice | None] = field(default_factory=list)
    compute_procs: list[tuple[int, int | None]] = field(default_factory=list)
    graphics_procs: list[tuple[int, int | None]] = field(default_factory=list)
    #: function name -> NVML error code that function raises for this device; a field id's
    #: constant name (``"NVML_FI_DEV_POWER_AVERAGE"``) -> the error code of that one field
    errors: dict[str, int] = field(default_factory=dict)


def make_pynvml(devices: list[FakeDevice], *, init_error: int | None = None,
                driver: str = "550.54.15", cuda: int = 12040,
                nvml_version: str = "12.550.54.15") -> types.ModuleType:
    """A module object that behaves like ``pynvml`` over ``devices``; ``calls`` counts calls."""
    mod = types.ModuleType("pynvml")
    calls: dict[str, int] = {}
    mod.calls = calls  # type: ignore[attr-defined]
    for name, code in ERROR_CODES.items():
        setattr(mod, name, code)
    mod.NVML_SUCCESS = 0
    mod.NVML_TEMPERATURE_GPU = 0
    mod.NVML_GPU_UTILIZATION_SAMPLES = 1
    mod.NVML_MEMORY_UTILIZATION_SAMPLES = 2
    mod.NVML_VALUE_TYPE_DOUBLE = 0
    mod.NVML_VALUE_TYPE_UNSIGNED_INT = 1
    mod.NVML_FI_DEV_POWER_AVERAGE = 185
    mod.NVML_FI_DEV_POWER_INSTANT = 186
    mod.NVML_FI_DEV_POWER_CURRENT_LIMIT = 190
    field_names = {185: "NVML_FI_DEV_POWER_AVERAGE", 186: "NVML_FI_DEV_POWER_INSTANT",
                   190: "NVML_FI_DEV_POWER_CURRENT_LIMIT"}
    mod.NVML_DEVICE_MIG_DISABLE = 0
    mod.NVML_DEVICE_MIG_ENABLE = 1
    mod.nvmlMemory_v2 = 0x02000028

    class NVMLError(Exception):
        _valClassMapping: dict[int, type] = {}

        def __new__(cls, value: int) -> NVMLError:
            if cls is NVMLError:
                cls = NVMLError._valClassMapping.get(value, cls)
            obj = Exception.__new__(cls)
            obj.value = value  # type: ignore[attr-defined]
            return obj

        def __str__(self) -> str:
            return MESSAGES.get(self.value, f"NVML Error with code {self.value}")  # type: ignore[attr-defined]

    class NVMLLibraryMismatchError(Exception):
        """Not an NVMLError: what the real unversioned wrappers raise on an older driver."""

    mod.NVMLError = NVMLError
    mod.NVMLLibraryMismatchError = NVMLLibraryMismatchError
    for name, code in ERROR_CODES.items():  # the same class names the real module generates
        class_name = "NVMLError_" + string.capwords(name.replace("NVML_ERROR_", ""), "_").replace("_", "")

        def new(cls: type, *args: Any, _code: int = code) -> Any:
            return NVMLError.__new__(cls, _code)

        cls = type(class_name, (NVMLError,), {"__new__": new})
        setattr(mod, class_name, cls)
        NVMLError._valClassMapping[code] = cls

    def api(fn: Any) -> Any:
        @functools.wraps(fn)  # keeps the signature, compared with the real one in the tests
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
            if args and isinstance(args[0], FakeDevice) and fn.__name__ in args[0].errors:
                raise NVMLError(args[0].errors[fn.__name__])
            return fn(*args, **kwargs)

        setattr(mod, fn.__name__, wrapper)
        return wrapper

    @api
    def nvmlInit() -> None:
        if init_error is not None:
            raise NVMLError(init_error)

    @api
    def nvmlShutdown() -> None:
        return None

    @api
    def nvmlSystemGetDriverVersion() -> str:
        return driver

    @api
    def nvmlSystemGetNVMLVersion() -> str:
        return nvml_version

    @api
    def nvmlSystemGetCudaDriverVersion() -> int:
        return cuda

    @api
    def nvmlSystemGetCudaDriverVersion_v2() -> int:
        return cuda

    @api
    def nvmlDeviceGetCount() -> int:
        return len(devices)

    @api
    def nvmlDeviceGetHandleByIndex(index: int) -> FakeDevice:
        if not 0 <= index < len(devices):
            raise NVMLError(ERROR_CODES["NVML_ERROR_NOT_FOUND"])
        return devices[index]

    @api
    def nvmlDeviceGetUUID(handle: FakeDevice) -> str:
        return handle.uuid

    @api
    def nvmlDeviceGetName(handle: FakeDevice) -> str:
        return handle.name

    @api
    def nvmlDeviceGetPciInfo(handle: FakeDevice) -> Any:
        return types.SimpleNamespace(busId=handle.bus_id, busIdLegacy=handle.bus_id[4:])

    @api
    def nvmlDeviceGetMemoryInfo(handle: FakeDevice, version: int | None = None) -> Any:
        if version is not None and "nvmlDeviceGetMemoryInfo_v2" in handle.errors:
            raise NVMLError(handle.errors["nvmlDeviceGetMemoryInfo_v2"])
        info = types.SimpleNamespace(total=handle.total, used=handle.used,
                                     free=handle.total - handle.used)
        if version is not None:
            info.reserved = 0
            info.version = version
        return info

    @api
    def nvmlDeviceGetUtilizationRates(handle: FakeDevice) -> Any:
        return types.SimpleNamespace(gpu=handle.gpu_rate, memory=handle.memory_rate)

    @api
    def nvmlDeviceGetSamples(handle: FakeDevice, sampling_type: int, timeStamp: int) -> Any:
        series = handle.gpu_samples if sampling_type == 1 else handle.memory_samples
        if series is None:
            raise NVMLError(NOT_SUPPORTED)
        if handle.sample_epoch is None:
            handle.sample_epoch = time.time()
        epoch_us = handle.sample_epoch * 1_000_000
        samples = [
            types.SimpleNamespace(timeStamp=int(epoch_us - ago * 1_000_000),
                                  sampleValue=types.SimpleNamespace(
                                      dVal=0.0, uiVal=value, ulVal=value, ullVal=value))
            for ago, value in series
        ]
        samples = [s for s in samples if s.timeStamp > timeStamp]
        if not samples:  # the real driver says NOT_FOUND when nothing is newer
            raise NVMLError(NOT_FOUND)
        return 1, samples

    @api
    def nvmlDeviceGetFieldValues(handle: FakeDevice, fieldIds: list[Any]) -> list[Any]:
        readings = {185: handle.power_mw, 186: handle.power_mw, 190: handle.limit_mw}
        values = []
        for field_id in fieldIds:
            name = field_names.get(field_id, "")
            code = handle.errors.get(name, 0 if field_id in readings else NOT_SUPPORTED)
            number = readings.get(field_id, 0) if code == 0 else 0
            values.append(types.SimpleNamespace(
                fieldId=field_id, scopeId=0, timestamp=int(time.time() * 1e6), latencyUsec=0,
                valueType=1, nvmlReturn=code,
                value=types.SimpleNamespace(dVal=0.0, uiVal=number, ulVal=number, ullVal=number,
                                            sllVal=number, siVal=number, usVal=number)))
        return values

    @api
    def nvmlDeviceGetTemperature(handle: FakeDevice, sensor: int) -> int:
        return handle.temperature

    @api
    def nvmlDeviceGetPowerUsage(handle: FakeDevice) -> int:
        return handle.power_mw

    @api
    def nvmlDeviceGetEnforcedPowerLimit(handle: FakeDevice) -> int:
        return handle.limit_mw

    @api
    def nvmlDeviceGetCudaComputeCapability(handle: FakeDevice) -> tuple[int, int]:
        return handle.cc

    @api
    def nvmlDeviceGetComputeMode(handle: FakeDevice) -> int:
        return handle.compute_mode

    @api
    def nvmlDeviceGetMigMode(handle: FakeDevice) -> list[int]:
        return list(handle.mig_mode)

    @api
    def nvmlDeviceGetMaxMigDeviceCount(handle: FakeDevice) -> int:
        return len(handle.mig_slots)

    @api
    def nvmlDeviceGetMigDeviceHandleByIndex(handle: FakeDevice, index: int) -> FakeDevice:
        mig = handle.mig_slots[index]
        if mig is None:
            raise NVMLError(NOT_FOUND)
        return mig

    def procs(entries: list[tuple[int, int | None]]) -> list[Any]:
        return [types.SimpleNamespace(pid=pid, usedGpuMemory=mem, gpuInstanceId=0xFFFFFFFF,
                                      computeInstanceId=0xFFFFFFFF) for pid, mem in entries]

    def versioned(fn: Any) -> Any:
        """Like the real ``throwOnVersionMismatch``: the unversioned name calls ``_v3``, and a
        driver without ``_v3`` (before R510) raises ``NVMLLibraryMismatchError``."""
        @functools.wraps(fn)
        def wrapper(handle: Any) -> Any:
            if isinstance(handle, FakeDevice) and fn.__name__ + "_v3" in handle.errors:
                raise NVMLLibraryMismatchError("Unversioned function called and the pyNVML "
                                               "version does not match the NVML lib version.")
            return fn(handle)

        return wrapper

    @versioned
    @api
    def nvmlDeviceGetComputeRunningProcesses(handle: FakeDevice) -> list[Any]:
        return procs(handle.compute_procs)

    @versioned
    @api
    def nvmlDeviceGetGraphicsRunningProcesses(handle: FakeDevice) -> list[Any]:
        return procs(handle.graphics_procs)

    @api
    def nvmlDeviceGetComputeRunningProcesses_v2(handle: FakeDevice) -> list[Any]:
        return procs(handle.compute_procs)

    @api
    def nvmlDeviceGetGraphicsRunningProcesses_v2(handle: FakeDevice) -> list[Any]:
        return procs(handle.graphics_procs)

    mod.nvmlDeviceGetComputeRunningProcesses = nvmlDeviceGetComputeRunningProcesses
    mod.nvmlDeviceGetGraphicsRunningProcesses = nvmlDeviceGetGraphicsRunningProcesses

    return mod


def install_pynvml(monkeypatch: Any, module: Any) -> None:
    """Make ``module`` the ``pynvml`` that devicekit imports, for this test, and switch off the
    empty GPU simulation every test starts on (tests/conftest.py), so NVML is what is read; its
    GPUs are visible (``CUDA_VISIBLE_DEVICES`` unset), as on a machine that has them."""
    import sys

    from devicekit.hardware import inventory

    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.delenv("DEVICEKIT_SIMULATE", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    inventory._cache.clear()
