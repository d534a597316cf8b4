"""Live NVML readings kept cheap between snapshots: the utilization sample buffer, power read
through ``nvmlDeviceGetFieldValues``, and the processes on a GPU. No torch; used by
:mod:`devicekit.hardware.nvml`.

Utilization: the driver samples GPU and memory-bandwidth busy % several times a second into a
ring buffer, and ``nvmlDeviceGetSamples(handle, type, since)`` returns the samples newer than
``since`` (pynvml asks the driver twice: for the count, then for the samples; once when there
is none, NOT_FOUND). :class:`SampleWindow` keeps the samples of the last ``seconds`` between
snapshots and asks only for those newer than the newest it holds: the mean is over the same
samples as a fresh read of the whole window, and a snapshot taken soon after another mostly
costs the one call that finds nothing new. Where the driver keeps no samples (NOT_SUPPORTED:
MIG, vGPU, old GPUs) it is not asked again until :meth:`SampleWindow.forget`.

Power: the draw and the enforced limit in one ``nvmlDeviceGetFieldValues`` call
(``NVML_FI_DEV_POWER_AVERAGE``: the one-second average, what ``nvmlDeviceGetPowerUsage``
returns on Ampere and later; ``NVML_FI_DEV_POWER_CURRENT_LIMIT``: the limit in force after all
limiters, as ``nvmlDeviceGetEnforcedPowerLimit``). A field this driver or GPU does not give is
left to the classic call from then on; a driver without field values gets the classic calls.

Processes: compute and graphics lists, one entry per pid, with user and command from psutil;
on a driver older than the bindings the call that works (``_v2``) is remembered.

Usage::

    from devicekit.hardware.nvml_readings import PowerFields, SampleWindow

    window = SampleWindow(pynvml, seconds=5.0)
    busy = window.mean(handle, key=(0, pynvml.NVML_GPU_UTILIZATION_SAMPLES))   # None: no samples
    power = PowerFields(pynvml)
    power.read(0, handle)        # {"power_draw": 312000, "power_limit": 700000} (milliwatts)
    ProcessLister(pynvml, unsupported=()).list(handle, "GPU 0")   # (GPUProcess(pid=...), ...)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from devicekit.errors import BackendError
from devicekit.hardware.gpu import GPUProcess

__all__ = ["PowerFields", "ProcessLister", "SampleWindow", "POWER_FIELDS", "error_classes"]

#: GPU fact -> the pynvml field id constant that gives it (milliwatts)
POWER_FIELDS = {"power_draw": "NVML_FI_DEV_POWER_AVERAGE",
                "power_limit": "NVML_FI_DEV_POWER_CURRENT_LIMIT"}

# nvmlValueType_t -> the member of the nvmlValue_t union that holds it
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                  6: "usVal"}
_PERMANENT = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission")


def error_classes(nvml: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The pynvml error classes of these names that this pynvml has."""
    return tuple(cls for name in names if isinstance(cls := getattr(nvml, name, None), type))


class SampleWindow:
    """GPU busy samples of the last ``seconds``, per ``(gpu index, sample type)``."""

    def __init__(self, nvml: Any, seconds: float, clock: Callable[[], float] = time.time) -> None:
        self._nvml = nvml
        self.seconds = seconds
        self._clock = clock
        self._get = getattr(nvml, "nvmlDeviceGetSamples", None)
        self._none_new = error_classes(nvml, ("NVMLError_NotFound",))
        self._permanent = error_classes(nvml, _PERMANENT)
        self._kept: dict[tuple[int, int], list[tuple[int, float]]] = {}
        self._no_samples: set[tuple[int, int]] = set()

    def mean(self, handle: Any, key: tuple[int, int | None]) -> float | None:
        """Mean of the samples newer than ``seconds`` ago; None when there are none."""
        index, sample_type = key
        if sample_type is None or self._get is None or (index, sample_type) in self._no_samples:
            return None
        since = int((self._clock() - self.seconds) * 1_000_000)
        kept = [s for s in self._kept.get((index, sample_type), ()) if s[0] > since]
        newest = max(since, kept[-1][0]) if kept else since
        try:
            _, samples = self._get(handle, sample_type, newest)
        except self._none_new:  # nothing newer than what is kept
            samples = []
        except self._permanent:
            self._no_samples.add((index, sample_type))
            self._kept.pop((index, sample_type), None)
            return None
        except self._nvml.NVMLError:  # anything else: no average this time (the rates are read)
            samples = []
        fresh = sorted((int(s.timeStamp), _sample_value(s)) for s in samples
                       if int(s.timeStamp) > newest)
        kept += fresh
        self._kept[(index, sample_type)] = kept
        if not kept:
            return None
        return sum(value for _, value in kept) / len(kept)

    def forget(self, index: int) -> None:
        """Ask GPU ``index``'s driver again next time, even for a sample type it refused."""
        self._no_samples = {key for key in self._no_samples if key[0] != index}


class PowerFields:
    """Power draw and limit by field values, per GPU index, with the classic calls left over."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml
        self._get = getattr(nvml, "nvmlDeviceGetFieldValues", None)
        self._ids = {fact: getattr(nvml, name, None) for fact, name in POWER_FIELDS.items()}
        self._classic: dict[int, set[str]] = {}  # gpu index -> facts read the classic way

    def read(self, index: int, handle: Any) -> dict[str, float]:
        """``{fact: milliwatts}`` for the facts the driver gave as field values (others absent)."""
        classic = self._classic.get(index)
        if classic is None:
            classic = self._classic[index] = (
                set(self._ids) if self._get is None else {f for f, i in self._ids.items() if i is None})
        wanted = [(fact, field) for fact, field in self._ids.items() if fact not in classic]
        if not wanted:
            return {}
        try:
            values = self._get(handle, [field for _, field in wanted])
        except self._nvml.NVMLError:  # no field values here (or failing: the classic calls say how)
            classic.update(fact for fact, _ in wanted)
            return {}
        got: dict[str, float] = {}
        for (fact, _), value in zip(wanted, values, strict=False):
            number = _field_number(value)
            if number is None:  # a field this driver or GPU does not know: classic call from now on
                classic.add(fact)
            else:
                got[fact] = number
        return got

    def forget(self, index: int) -> None:
        """Try the field values again for GPU ``index`` (after a settings refresh)."""
        self._classic.pop(index, None)


class ProcessLister:
    """The processes on a GPU; ``unsupported``: the NVML errors that mean "cannot tell"."""

    def __init__(self, nvml: Any, unsupported: tuple[type[BaseException], ...]) -> None:
        self._nvml = nvml
        self._unsupported = unsupported
        self._process_calls: dict[str, Callable[[Any], Any]] = {}  # kind -> the call that works
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self._too_new = (*error_classes(nvml, ("NVMLError_FunctionNotFound",)),
                         *((mismatch,) if isinstance(mismatch, type) else ()))

    def list(self, handle: Any, label: str) -> tuple[GPUProcess, ...]:
        """Compute and graphics processes, one entry per pid, with user and command via psutil."""
        memory_by_pid: dict[int, int | None] = {}
        for kind in ("Compute", "Graphics"):
            for proc in self._running(handle, kind, label):
                pid = int(proc.pid)
                raw = getattr(proc, "usedGpuMemory", None)  # None: the driver will not say
                memory = int(raw) if raw is not None else None
                # a process in both lists holds one allocation: keep the larger figure
                known = memory_by_pid.get(pid)
                if pid not in memory_by_pid or (memory is not None and (known or 0) < memory):
                    memory_by_pid[pid] = memory
        return tuple(_describe_process(pid, memory) for pid, memory in sorted(memory_by_pid.items()))

    def _running(self, handle: Any, kind: str, label: str) -> list[Any]:
        """``nvmlDeviceGet{kind}RunningProcesses``, falling back to ``_v2`` on older drivers.

        nvidia-ml-py's unversioned call uses the ``_v3`` C function, which drivers before R510
        lack; it then raises ``NVMLLibraryMismatchError``, which is not an ``NVMLError``. The
        call that worked is remembered, so an old driver costs the failed try only once.
        """
        nvml = self._nvml
        known = self._process_calls.get(kind)
        calls = [known] if known is not None else [
            fn for suffix in ("", "_v2")
            if (fn := getattr(nvml, f"nvmlDeviceGet{kind}RunningProcesses{suffix}", None)) is not None]
        for fn in calls:
            try:
                found = list(fn(handle))
            except self._too_new:
                continue
            except self._unsupported:
                return []
            except nvml.NVMLError as exc:
                raise BackendError(
                    f"NVML failed to list {label} processes ({exc}); check 'nvidia-smi' and the driver"
                ) from None
            self._process_calls[kind] = fn
            return found
        return []


def _field_number(value: Any) -> float | None:
    """The number in one ``nvmlFieldValue_t``; None where its own return code is an error."""
    if int(getattr(value, "nvmlReturn", 1)) != 0:
        return None
    member = _VALUE_MEMBERS.get(int(getattr(value, "valueType", -1)))
    union = value.value
    if member is None or not hasattr(union, member):
        return None
    return float(getattr(union, member))


def _sample_value(sample: Any) -> float:
    value = sample.sampleValue
    # utilization samples are unsigned ints; other fields of the union are read as a fallback
    for field in ("uiVal", "ulVal", "ullVal", "dVal"):
        if hasattr(value, field):
            return float(getattr(value, field))
    return float(value)


def _describe_process(pid: int, memory: int | None) -> GPUProcess:
    """User and command line of ``pid``; None where it vanished, is hidden or in another namespace."""
    import psutil

    user: str | None = None
    command: str | None = None
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            try:
                user = proc.username()
            except (psutil.Error, KeyError):  # KeyError: a uid without a passwd entry
                try:
                    user = str(proc.uids().real)
                except psutil.Error:
                    user = None
            try:
                argv = proc.cmdline()
                command = " ".join(argv) if argv else proc.name()
            except psutil.Error:  # another user's process: the name is usually still readable
                try:
                    command = proc.name()
                except psutil.Error:
                    command = None
    except psutil.Error:  # gone since NVML listed it, or in another pid namespace
        pass
    return GPUProcess(pid=pid, user=user, command=command, memory=memory)
