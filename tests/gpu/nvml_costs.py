"""Where an NVML snapshot's time goes, call by call (run on a GPU machine).

``python tests/gpu/nvml_costs.py`` prints, for GPU 0: microseconds per call of every NVML
function a snapshot uses (and of the ones it no longer makes every time); how many NVML calls
one steady-state snapshot makes, counted by wrapping pynvml; whether the power field values
agree with the classic calls (``NVML_FI_DEV_POWER_CURRENT_LIMIT`` vs
``nvmlDeviceGetEnforcedPowerLimit``); the snapshot against ``GPUtil.getGPUs()``; and a profile
of 50 snapshots. History: 5.5 ms per snapshot on the first H100 session (Firecracker VM), 3.73 ms
on the H200 (issue 38), against about 25 ms for GPUtil; the goal is 20x GPUtil.
"""
import cProfile
import functools
import pstats
import time

import pynvml as n

from devicekit.hardware.nvml import NVMLBackend

b = NVMLBackend()
b.snapshot()


def t(label, fn, k=200):
    fn()
    s = time.perf_counter()
    for _ in range(k):
        fn()
    us = (time.perf_counter() - s) / k * 1e6
    print(f"{us:9.1f} us  {label}")
    return us


snap_us = t(f"snapshot(), {b.device_count()} GPU(s), steady state", b.snapshot, 100)
h = n.nvmlDeviceGetHandleByIndex(0)
since = int((time.time() - 5) * 1e6)
newest = max((int(s.timeStamp) for s in n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, since)[1]),
             default=since)
fields = [n.NVML_FI_DEV_POWER_AVERAGE, n.NVML_FI_DEV_POWER_CURRENT_LIMIT]


def newer_than_newest():
    try:  # usually nothing yet: NOT_FOUND after one driver call
        return n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, newest)
    except n.NVMLError_NotFound:
        return None


for name, fn in [
    ("GetCount", lambda: n.nvmlDeviceGetCount()),
    ("GetHandleByIndex", lambda: n.nvmlDeviceGetHandleByIndex(0)),
    ("GetUUID (once)", lambda: n.nvmlDeviceGetUUID(h)), ("GetName (once)", lambda: n.nvmlDeviceGetName(h)),
    ("GetPciInfo (once)", lambda: n.nvmlDeviceGetPciInfo(h)),
    ("GetMemoryInfo v1", lambda: n.nvmlDeviceGetMemoryInfo(h)),
    ("GetMemoryInfo v2 (live)", lambda: n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)),
    ("GetUtilizationRates (fallback)", lambda: n.nvmlDeviceGetUtilizationRates(h)),
    ("GetSamples GPU_UTIL, 5 s window (first)", lambda: n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, since)),
    ("GetSamples MEM_UTIL, 5 s window (first)", lambda: n.nvmlDeviceGetSamples(h, n.NVML_MEMORY_UTILIZATION_SAMPLES, since)),
    ("GetSamples GPU_UTIL, newer than newest (live)", lambda: newer_than_newest()),
    ("GetTemperature (live)", lambda: n.nvmlDeviceGetTemperature(h, 0)),
    ("GetFieldValues power avg + limit (live)", lambda: n.nvmlDeviceGetFieldValues(h, fields)),
    ("GetPowerUsage (fallback)", lambda: n.nvmlDeviceGetPowerUsage(h)),
    ("GetEnforcedPowerLimit (fallback, setting)", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h)),
    ("GetComputeMode (setting)", lambda: n.nvmlDeviceGetComputeMode(h)),
    ("GetCudaComputeCapability (once)", lambda: n.nvmlDeviceGetCudaComputeCapability(h)),
    ("GetMigMode (setting)", lambda: n.nvmlDeviceGetMigMode(h)),
    ("GetComputeRunningProcesses (live)", lambda: n.nvmlDeviceGetComputeRunningProcesses(h)),
    ("GetGraphicsRunningProcesses (live)", lambda: n.nvmlDeviceGetGraphicsRunningProcesses(h)),
    ("SystemGetDriverVersion", lambda: n.nvmlSystemGetDriverVersion()),
]:
    try:
        t(name, fn)
    except Exception as e:
        print("   ERR", name, e)

print("\n--- NVML calls in one steady-state snapshot (pynvml functions, wrapped)")
counts: dict[str, int] = {}
originals = {name: getattr(n, name) for name in dir(n)
             if name.startswith("nvml") and callable(getattr(n, name))}


def counted(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return fn(*args, **kwargs)
    return wrapper


for name, fn in originals.items():
    setattr(n, name, counted(name, fn))
try:
    counted_backend = NVMLBackend()  # made after the wrapping: it holds the wrapped functions
    counted_backend.snapshot()
    counts.clear()
    counted_backend.snapshot()
finally:
    for name, fn in originals.items():
        setattr(n, name, fn)
for name, count in sorted(counts.items()):
    print(f"{count:4d}  {name}")
print(f"{sum(counts.values()):4d}  in all, for {b.device_count()} GPU(s)")

print("\n--- power by field values vs the classic calls (mW)")
for value, field in zip(n.nvmlDeviceGetFieldValues(h, fields), ("average", "current limit"), strict=True):
    print(f"field {field}: return {value.nvmlReturn}, value {value.value.uiVal}")
print(f"GetPowerUsage {n.nvmlDeviceGetPowerUsage(h)}, GetEnforcedPowerLimit "
      f"{n.nvmlDeviceGetEnforcedPowerLimit(h)}, GetPowerManagementLimit {n.nvmlDeviceGetPowerManagementLimit(h)}")

try:
    import GPUtil
except ImportError:
    print("\nGPUtil not installed: no ratio")
else:
    gputil_us = t("GPUtil.getGPUs() (runs nvidia-smi)", GPUtil.getGPUs, 10)
    print(f"snapshot vs GPUtil: {gputil_us / snap_us:.1f}x faster (goal >= 20x)")

profile = cProfile.Profile()
profile.enable()
for _ in range(50):
    b.snapshot()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(20)
