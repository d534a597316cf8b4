"""Where an NVML snapshot's time goes, call by call (run on a GPU machine).

``python tests/gpu/nvml_costs.py`` prints microseconds per call of every NVML function
``NVMLBackend.snapshot()`` uses, then a profile of 50 snapshots. On the first H100 session
(Firecracker VM) a snapshot took 5.5 ms against 24.6 ms for ``GPUtil.getGPUs()``: this says
which calls to batch (``nvmlDeviceGetFieldValues``) or cache.
"""
import cProfile
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
    print(f"{(time.perf_counter()-s)/k*1e6:9.1f} us  {label}")
t("snapshot()", b.snapshot, 50)
h = n.nvmlDeviceGetHandleByIndex(0)
since = int((time.time() - 5) * 1e6)
for name, fn in [
    ("GetCount", lambda: n.nvmlDeviceGetCount()),
    ("GetHandleByIndex", lambda: n.nvmlDeviceGetHandleByIndex(0)),
    ("GetUUID", lambda: n.nvmlDeviceGetUUID(h)), ("GetName", lambda: n.nvmlDeviceGetName(h)),
    ("GetPciInfo", lambda: n.nvmlDeviceGetPciInfo(h)),
    ("GetMemoryInfo v1", lambda: n.nvmlDeviceGetMemoryInfo(h)),
    ("GetMemoryInfo v2", lambda: n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)),
    ("GetUtilizationRates", lambda: n.nvmlDeviceGetUtilizationRates(h)),
    ("GetSamples GPU_UTIL", lambda: n.nvmlDeviceGetSamples(h, n.NVML_GPU_UTILIZATION_SAMPLES, since)),
    ("GetSamples MEM_UTIL", lambda: n.nvmlDeviceGetSamples(h, n.NVML_MEMORY_UTILIZATION_SAMPLES, since)),
    ("GetTemperature", lambda: n.nvmlDeviceGetTemperature(h, 0)),
    ("GetPowerUsage", lambda: n.nvmlDeviceGetPowerUsage(h)),
    ("GetEnforcedPowerLimit", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h)),
    ("GetComputeMode", lambda: n.nvmlDeviceGetComputeMode(h)),
    ("GetCudaComputeCapability", lambda: n.nvmlDeviceGetCudaComputeCapability(h)),
    ("GetMigMode", lambda: n.nvmlDeviceGetMigMode(h)),
    ("GetComputeRunningProcesses", lambda: n.nvmlDeviceGetComputeRunningProcesses(h)),
    ("GetGraphicsRunningProcesses", lambda: n.nvmlDeviceGetGraphicsRunningProcesses(h)),
    ("SystemGetDriverVersion", lambda: n.nvmlSystemGetDriverVersion()),
]:
    try:
        t(name, fn)
    except Exception as e:
        print("   ERR", name, e)
profile = cProfile.Profile()
profile.enable()
for _ in range(50):
    b.snapshot()
profile.disable()
pstats.Stats(profile).sort_stats("tottime").print_stats(20)
