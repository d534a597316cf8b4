"""GPU facts from NVML (NVIDIA's driver library) through nvidia-ml-py: no torch, no subprocess.

NVML is initialised once per process and device handles are cached. A snapshot costs a few C
calls per GPU, counted by ``tests/hardware/test_nvml.py`` (``tests/gpu/nvml_costs.py`` times
each on a real driver):

- read once per GPU: UUID, name, PCI bus id, compute capability, SM count and clocks;
- settings an administrator changes (compute mode, MIG mode and the MIG instances' identity,
  and the power limit where field values cannot give it) are re-read every ``settings_ttl``
  seconds (default 10);
- live on every snapshot: memory, temperature, power (draw and limit in one
  ``nvmlDeviceGetFieldValues`` call where the driver has the fields), utilization, processes.

Facts a GPU or driver does not support (``Not Supported``, ``No Permission``, a function the
driver is too old for) come back as ``None``; a driver that is present but failing raises
:class:`~devicekit.errors.BackendError` naming the NVML error; a machine without the NVML
library raises :class:`NVMLNotFound` (inventory then reports no GPUs).

GPU and memory-bandwidth utilization are averaged over the driver's own sample buffer for the
last ``utilization_window`` seconds (``nvmlDeviceGetSamples``), not read as one instantaneous
value; where sampling is unsupported the single ``nvmlDeviceGetUtilizationRates`` reading is
used. The samples are kept between snapshots and only newer ones asked for
(:mod:`devicekit.hardware.nvml_readings`); the mean is the same.

Usage::

    from devicekit.hardware.nvml import NVMLBackend, NVMLNotFound

    try:
        nvml = NVMLBackend()
    except NVMLNotFound:
        print("no NVIDIA driver on this machine")
    else:
        print(nvml.driver_version(), nvml.cuda_driver_version())
        for gpu in nvml.snapshot():
            print(gpu.index, gpu.uuid, gpu.utilization, gpu.memory_free)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from devicekit.errors import BackendError, InvalidValueError, NVMLUnavailableError
from devicekit.hardware.gpu import GPU, GPUProcess, MigDevice
from devicekit.hardware.known_gpus import lookup
from devicekit.hardware.nvml_readings import (
    PowerFields,
    ProcessLister,
    SampleWindow,
    error_classes,
)

__all__ = ["NVMLBackend", "NVMLNotFound", "DEFAULT_UTILIZATION_WINDOW", "DEFAULT_SETTINGS_TTL"]

#: seconds of driver samples averaged into ``GPU.utilization``
DEFAULT_UTILIZATION_WINDOW = 5.0
#: seconds an administrator's settings (compute mode, MIG mode, power limit) are kept
DEFAULT_SETTINGS_TTL = 10.0

_T = TypeVar("_T")

_COMPUTE_MODES = {0: "default", 1: "exclusive_thread", 2: "prohibited", 3: "exclusive_process"}

# per-field errors that mean "this GPU/driver cannot tell": the field becomes None
_UNSUPPORTED_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_NoPermission",
    "NVMLError_FunctionNotFound",
    "NVMLError_NotFound",
)
# nvmlInit errors that mean "no NVIDIA driver here" rather than "the driver is broken"
_ABSENT_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")

_init_lock = threading.Lock()
_initialised: list[Any] = []  # pynvml modules already initialised: one nvmlInit per process


class NVMLNotFound(NVMLUnavailableError):
    """The NVML library (``libnvidia-ml.so.1``) or the NVIDIA kernel driver is not present."""


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:
        raise NVMLNotFound(
            f"nvidia-ml-py is not installed ({exc}); run 'pip install nvidia-ml-py'"
        ) from None
    return pynvml


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NVMLBackend:
    """Snapshots every physical GPU through NVML.

    ``utilization_window`` (seconds) is how far back the driver's utilization samples are
    averaged; ``settings_ttl`` (seconds, 0: every snapshot) how long compute mode, MIG mode
    and the power limit are kept before they are read again. Raises :class:`NVMLNotFound` when
    NVML cannot be loaded and :class:`~devicekit.errors.BackendError` when the driver is
    present but fails.
    """

    name = "nvml"

    def __init__(self, utilization_window: float = DEFAULT_UTILIZATION_WINDOW,
                 settings_ttl: float = DEFAULT_SETTINGS_TTL) -> None:
        for what, value, low_open in (("utilization_window", utilization_window, True),
                                      ("settings_ttl", settings_ttl, False)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not ((0 < value) if low_open else (0 <= value)) or not value <= 3600:
                interval = "(0, 3600]" if low_open else "[0, 3600]"
                raise InvalidValueError(
                    f"{what} {value!r} must be a number of seconds in {interval}")
        self.utilization_window = float(utilization_window)
        self.settings_ttl = float(settings_ttl)
        self._clock: Callable[[], float] = time.monotonic
        self._nvml = _load_pynvml()
        self._unsupported = error_classes(self._nvml, _UNSUPPORTED_ERRORS)
        self._init()
        count = self._call(self._nvml.nvmlDeviceGetCount, what="count the GPUs")
        #: GPUs NVML lists but will not open for this process, one line each (shown by status)
        self.problems: list[str] = []
        # (NVML index, handle); a GPU fenced off from this process (a Slurm/cgroup allocation
        # leaves the others listed but NO_PERMISSION) is left out, keeping the others' indices
        self._handles: list[tuple[int, Any]] = []
        no_permission = error_classes(self._nvml, ("NVMLError_NoPermission",))
        for i in range(count):
            try:
                handle = self._nvml.nvmlDeviceGetHandleByIndex(i)
            except no_permission:
                self.problems.append(f"GPU {i} is not accessible to this process (NVML: "
                                     "Insufficient Permissions); it belongs to another job")
                continue
            except self._nvml.NVMLError as exc:
                raise BackendError(
                    f"NVML failed to open GPU {i} ({exc}); check 'nvidia-smi' and the driver"
                ) from None
            self._handles.append((i, handle))
        self._static: dict[int, dict[str, Any]] = {}
        self._settings: dict[int, tuple[float, dict[str, Any]]] = {}  # index -> (read at, facts)
        self._samples = SampleWindow(self._nvml, self.utilization_window)
        self._power = PowerFields(self._nvml)
        self._memory_v2: Any = getattr(self._nvml, "nvmlMemory_v2", None)  # None: v1 only
        self._process_lister = ProcessLister(self._nvml, self._unsupported)

    # -- set-up -----------------------------------------------------------------------------

    def _init(self) -> None:
        nvml = self._nvml
        with _init_lock:
            if any(module is nvml for module in _initialised):
                return
            try:
                nvml.nvmlInit()
            except nvml.NVMLError as exc:
                if isinstance(exc, error_classes(nvml, _ABSENT_ERRORS)):
                    raise NVMLNotFound(
                        f"NVML cannot be loaded ({exc}); no NVIDIA driver on this machine, "
                        "so devicekit sees no GPUs (install the driver, or use DEVICEKIT_SIMULATE)"
                    ) from None
                raise BackendError(
                    f"the NVIDIA driver failed to initialise NVML ({exc}); "
                    "check 'nvidia-smi' and reload or reinstall the driver"
                ) from None
            _initialised.append(nvml)

    def _call(self, fn: Callable[..., _T], *args: Any, what: str) -> _T:
        """Call NVML; any NVML error is a BackendError naming it (for facts that must exist)."""
        try:
            return fn(*args)
        except self._nvml.NVMLError as exc:
            raise BackendError(
                f"NVML failed to {what} ({exc}); check 'nvidia-smi' and the driver"
            ) from None

    def _optional(self, fn: Callable[..., _T], *args: Any, what: str) -> _T | None:
        """Call NVML; 'not supported'-style errors give None, real failures a BackendError."""
        try:
            return fn(*args)
        except self._unsupported:
            return None
        except self._nvml.NVMLError as exc:
            raise BackendError(
                f"NVML failed to {what} ({exc}); check 'nvidia-smi' and the driver"
            ) from None

    # -- system facts -----------------------------------------------------------------------

    def driver_version(self) -> str | None:
        """The NVIDIA driver version, e.g. ``"550.54.15"``."""
        value = self._optional(self._nvml.nvmlSystemGetDriverVersion, what="read the driver version")
        return _text(value) if value is not None else None

    def nvml_version(self) -> str | None:
        """The NVML library version, e.g. ``"12.550.54.15"``."""
        value = self._optional(self._nvml.nvmlSystemGetNVMLVersion, what="read the NVML version")
        return _text(value) if value is not None else None

    def cuda_driver_version(self) -> str | None:
        """The newest CUDA version the driver supports, e.g. ``"12.4"`` (torch's CUDA must be <=)."""
        fn = getattr(self._nvml, "nvmlSystemGetCudaDriverVersion_v2", None) or \
            self._nvml.nvmlSystemGetCudaDriverVersion
        value = self._optional(fn, what="read the CUDA driver version")
        if value is None:
            return None
        return f"{int(value) // 1000}.{int(value) % 1000 // 10}"

    def device_count(self) -> int:
        return len(self._handles)

    # -- snapshot ---------------------------------------------------------------------------

    def snapshot(self) -> list[GPU]:
        """One :class:`GPU` per physical device, in NVML (PCI bus) order."""
        return [self._gpu(i, handle) for i, handle in self._handles]

    def _static_facts(self, index: int, handle: Any) -> dict[str, Any]:
        """Facts that cannot change while the process runs: read once per GPU."""
        facts = self._static.get(index)
        if facts is None:
            nvml = self._nvml
            pci = self._optional(nvml.nvmlDeviceGetPciInfo, handle, what=f"read GPU {index} PCI info")
            bus_id = None
            if pci is not None:
                bus_id = _text(getattr(pci, "busId", "") or getattr(pci, "busIdLegacy", "")) or None
            facts = {
                "uuid": _text(self._call(nvml.nvmlDeviceGetUUID, handle, what=f"read GPU {index} UUID")),
                "name": _text(self._call(nvml.nvmlDeviceGetName, handle, what=f"read GPU {index} name")),
                "pci_bus_id": bus_id,
                "compute_capability": self._optional(
                    nvml.nvmlDeviceGetCudaComputeCapability, handle,
                    what=f"read GPU {index} compute capability"),
            }
            cc = facts["compute_capability"]
            if cc is not None:
                facts["compute_capability"] = (int(cc[0]), int(cc[1]))
            facts.update(self._speed_facts(index, handle, facts["compute_capability"]))
            self._static[index] = facts
        return facts

    def _speed_facts(self, index: int, handle: Any, cc: tuple[int, int] | None) -> dict[str, Any]:
        """SM count, boost clock and peak memory bandwidth; None where the driver will not say."""
        nvml = self._nvml

        def read(fn_name: str, *args: Any) -> Any:
            fn = getattr(nvml, fn_name, None)
            if fn is None:
                return None
            try:  # best effort: a speed fact the driver will not give never breaks status
                return fn(handle, *args)
            except nvml.NVMLError:
                return None

        clock_sm = getattr(nvml, "NVML_CLOCK_SM", 1)
        clock_mem = getattr(nvml, "NVML_CLOCK_MEM", 2)
        sm_clock = read("nvmlDeviceGetMaxClockInfo", clock_sm)
        mem_clock = read("nvmlDeviceGetMaxClockInfo", clock_mem)
        bus_width = read("nvmlDeviceGetMemoryBusWidth")
        cores = read("nvmlDeviceGetNumGpuCores")
        # CUDA cores per SM: 64 on Volta, Turing and A100; 128 on GA10x, Ada, Hopper and later
        per_sm = 128 if cc is not None and (cc >= (8, 6)) else 64
        return {
            "max_sm_clock": int(sm_clock) if sm_clock else None,
            # double data rate: bytes per clock = bus width / 8, twice per clock
            "memory_bandwidth": (int(bus_width) / 8 * int(mem_clock) * 1e6 * 2 / 1e9
                                 if bus_width and mem_clock else None),
            "sm_count": int(cores) // per_sm if cores and cc else None,
        }

    def _settings_of(self, index: int, handle: Any, label: str) -> dict[str, Any]:
        """Compute mode, MIG mode and instances, as read at most ``settings_ttl`` seconds ago."""
        now = self._clock()
        cached = self._settings.get(index)
        if cached is not None and now - cached[0] < self.settings_ttl:
            return cached[1]
        if cached is not None:  # re-probe what the driver refused before (MIG mode may have moved)
            self._samples.forget(index)
            self._power.forget(index)
        nvml = self._nvml
        mode = self._optional(nvml.nvmlDeviceGetComputeMode, handle, what=f"read {label} compute mode")
        facts: dict[str, Any] = {
            "compute_mode": _COMPUTE_MODES.get(mode, str(mode)) if mode is not None else None,
            "mig": self._mig_layout(handle, label),
        }
        self._settings[index] = (now, facts)
        return facts

    def _gpu(self, index: int, handle: Any) -> GPU:
        nvml = self._nvml
        static = self._static_facts(index, handle)
        label = f"GPU {index}"
        settings = self._settings_of(index, handle, label)
        total, used, free = self._memory(handle, label)
        temperature = self._optional(nvml.nvmlDeviceGetTemperature, handle,
                                     nvml.NVML_TEMPERATURE_GPU, what=f"read {label} temperature")
        power = self._power.read(index, handle)
        if "power_draw" not in power:
            value = self._optional(nvml.nvmlDeviceGetPowerUsage, handle, what=f"read {label} power")
            power["power_draw"] = value
        if "power_limit" not in power:  # not a field here: a setting, re-read with the others
            if "power_limit" not in settings:
                settings["power_limit"] = self._optional(
                    nvml.nvmlDeviceGetEnforcedPowerLimit, handle, what=f"read {label} power limit")
            power["power_limit"] = settings["power_limit"]
        draw, limit = power["power_draw"], power["power_limit"]
        mig_enabled, mig_devices = self._mig_devices(index, settings["mig"], label)
        gpu_util, bw_util = self._utilization(index, handle, label)
        return GPU(
            index=index,
            uuid=static["uuid"],
            name=static["name"],
            memory_total=total,
            memory_used=used,
            memory_free=free,
            pci_bus_id=static["pci_bus_id"],
            utilization=gpu_util,
            memory_bandwidth_utilization=bw_util,
            temperature=int(temperature) if temperature is not None else None,
            power_draw=draw / 1000.0 if draw is not None else None,
            power_limit=limit / 1000.0 if limit is not None else None,
            compute_capability=static["compute_capability"],
            compute_mode=settings["compute_mode"],
            mig_enabled=mig_enabled,
            mig_devices=mig_devices,
            processes=self._processes(handle, label),
            architecture=known.architecture if (known := lookup(static["name"])) else None,
            sm_count=static.get("sm_count"),
            max_sm_clock=static.get("max_sm_clock"),
            memory_bandwidth=static.get("memory_bandwidth"),
            backend="nvml",
        )

    def _memory(self, handle: Any, label: str) -> tuple[int, int, int]:
        nvml = self._nvml
        info = None
        if self._memory_v2 is not None:  # v2 reports "used" without driver-reserved memory
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle, version=self._memory_v2)
            except (*self._unsupported, TypeError):
                self._memory_v2 = None  # a driver or binding without v2: v1 from now on
            except nvml.NVMLError:
                info = None  # v1 says whether the GPU itself fails
        if info is None:
            info = self._call(nvml.nvmlDeviceGetMemoryInfo, handle, what=f"read {label} memory")
        return int(info.total), int(info.used), int(info.free)

    def _utilization(self, index: int, handle: Any, label: str) -> tuple[float | None, float | None]:
        """(GPU busy %, memory-bandwidth busy %), averaged over the recent window where possible."""
        nvml = self._nvml
        gpu = self._samples.mean(handle, (index, getattr(nvml, "NVML_GPU_UTILIZATION_SAMPLES", None)))
        bandwidth = self._samples.mean(
            handle, (index, getattr(nvml, "NVML_MEMORY_UTILIZATION_SAMPLES", None)))
        if gpu is None or bandwidth is None:
            rates = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle,
                                   what=f"read {label} utilization")
            if rates is not None:
                gpu = float(rates.gpu) if gpu is None else gpu
                bandwidth = float(rates.memory) if bandwidth is None else bandwidth
        return gpu, bandwidth

    def _mig_layout(self, handle: Any, label: str) -> tuple[bool, tuple[tuple[Any, str, str], ...]]:
        """(MIG enabled, each instance's (handle, UUID, name)): settings, re-read with them."""
        nvml = self._nvml
        modes = self._optional(nvml.nvmlDeviceGetMigMode, handle, what=f"read {label} MIG mode")
        enabled_value = getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        if modes is None or modes[0] != enabled_value:
            return False, ()
        slots = self._optional(nvml.nvmlDeviceGetMaxMigDeviceCount, handle,
                               what=f"count {label} MIG instances") or 0
        found: list[tuple[Any, str, str]] = []
        for slot in range(int(slots)):
            mig = self._optional(nvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, slot,
                                 what=f"open {label} MIG slot {slot}")
            if mig is None:  # an empty slot
                continue
            where = f"{label} MIG slot {slot}"
            found.append((mig,
                          _text(self._call(nvml.nvmlDeviceGetUUID, mig, what=f"read {where} UUID")),
                          _text(self._call(nvml.nvmlDeviceGetName, mig, what=f"read {where} name"))))
        return True, tuple(found)

    def _mig_devices(self, index: int, layout: tuple[bool, tuple[tuple[Any, str, str], ...]],
                     label: str) -> tuple[bool, tuple[MigDevice, ...]]:
        """The instances' memory, live; an instance gone since the layout was read is left out
        and the layout is read again on the next snapshot."""
        enabled, instances = layout
        devices: list[MigDevice] = []
        for mig, uuid, name in instances:
            info = self._optional(self._nvml.nvmlDeviceGetMemoryInfo, mig,
                                  what=f"read {label} MIG {uuid} memory")
            if info is None:
                self._settings.pop(index, None)
                continue
            devices.append(MigDevice(index=len(devices), uuid=uuid, name=name,
                                     memory_total=int(info.total), memory_used=int(info.used)))
        return enabled, tuple(devices)

    def _processes(self, handle: Any, label: str) -> tuple[GPUProcess, ...]:
        return self._process_lister.list(handle, label)
