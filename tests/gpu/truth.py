"""Compare what devicekit says about the GPUs with the machine's own truth.

Run on a GPU machine (``python tests/gpu/truth.py``): reads ``nvidia-smi --query-gpu`` and
``--query-compute-apps`` as CSV (the one place devicekit's checks parse nvidia-smi: as the
independent witness, never as the source) and ``torch.cuda``, and prints one line per field,
``OK`` or ``MISMATCH``, exiting 1 on any mismatch. The same comparisons run as tests in
``tests/gpu/test_nvml_vs_torch.py``; this script prints the figures for a session's log.
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys

import devicekit as dk

FIELDS = "index,uuid,name,memory.total,memory.used,pci.bus_id,driver_version,temperature.gpu,power.limit"
MIB = 2**20


def smi(query: str, fields: str) -> list[dict[str, str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}={fields}", "--format=csv,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    rows = list(csv.reader(io.StringIO(out)))
    head = [h.strip().split(" [")[0] for h in rows[0]]
    return [dict(zip(head, (c.strip() for c in row), strict=True)) for row in rows[1:] if row]


def main() -> int:
    bad = 0

    def check(label: str, ours: object, truth: object, ok: bool | None = None) -> None:
        nonlocal bad
        good = (ours == truth) if ok is None else ok
        bad += not good
        print(f"{'OK' if good else 'MISMATCH':8} {label}: devicekit={ours!r} truth={truth!r}")

    truth = smi("gpu", FIELDS)
    ours = dk.gpus()
    check("GPU count", len(ours), len(truth))
    for gpu, row in zip(ours, truth, strict=False):
        i = gpu.index
        check(f"GPU {i} uuid", gpu.uuid, row["uuid"])
        check(f"GPU {i} name", gpu.name, row["name"])
        check(f"GPU {i} memory total (MiB)", gpu.memory_total // MIB, int(row["memory.total"]))
        used = gpu.memory_used // MIB
        check(f"GPU {i} memory used (MiB, +-64)", used, int(row["memory.used"]),
              abs(used - int(row["memory.used"])) <= 64)
        check(f"GPU {i} PCI bus id", gpu.pci_bus_id.lower(), row["pci.bus_id"].lower())
        if gpu.temperature is not None:
            check(f"GPU {i} temperature (+-3 C)", gpu.temperature, int(row["temperature.gpu"]),
                  abs(gpu.temperature - int(row["temperature.gpu"])) <= 3)
    print(f"driver (nvidia-smi): {truth[0]['driver_version'] if truth else '-'}")
    apps = smi("compute-apps", "pid,used_memory,gpu_uuid")
    ours_pids = {(p.pid, g.uuid) for g in ours for p in g.processes}
    for app in apps:
        pid = int(app["pid"])
        check(f"process {pid} on {app['gpu_uuid'][:12]}", (pid, app["gpu_uuid"]) in ours_pids, True)

    import torch

    if torch.cuda.is_available():
        env_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        from devicekit.hardware.visible import visible_devices

        print(f"CUDA_VISIBLE_DEVICES={env_visible!r}; devicekit: {visible_devices()}")
        for d in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(d)
            uuid = "GPU-" + str(props.uuid)
            gpu = next((g for g in ours if g.uuid == uuid), None)
            check(f"cuda:{d} uuid known to devicekit", gpu is not None, True)
            if gpu is not None:
                check(f"cuda:{d} total memory (MiB, torch vs NVML)", props.total_memory // MIB,
                      gpu.memory_total // MIB,
                      abs(props.total_memory - gpu.memory_total) <= 1024 * MIB)
                cc = f"{props.major}.{props.minor}"
                if gpu.compute_capability is not None:
                    check(f"cuda:{d} compute capability",
                          ".".join(map(str, gpu.compute_capability)), cc)
                free, total = torch.cuda.mem_get_info(d)
                print(f"         cuda:{d}: torch mem_get_info free={free // MIB} MiB "
                      f"total={total // MIB} MiB; NVML free={gpu.memory_free // MIB} MiB")
    print(f"{'all OK' if not bad else f'{bad} mismatch(es)'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
