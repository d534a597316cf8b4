"""Benchmark: how fast ``devicekit select`` answers, against a bare interpreter, GPUtil and gpustat.

Cold start: wall time of a fresh process (median of several runs) for ``python -c pass``,
``devicekit select -q`` and the anchors a user would otherwise script: ``GPUtil.getAvailable()``
(the seeds' library) and ``gpustat --json``. In-process: one ``select_gpus`` call (snapshot,
choose, lease under the directory lock, release) against ``GPUtil.getAvailable()``.

Without a GPU, devicekit runs on 8 simulated GPUs (``DEVICEKIT_SIMULATE``); GPUtil and gpustat
have no driver to ask, which the table says on their lines. With a GPU, everything uses NVML.

Run: ``python benchmarks/bench_select.py`` (about 20 s).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
RUNS = 7


def has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


def cold(argv: list[str], env: dict[str, str]) -> tuple[float, float, int]:
    """Median wall and CPU (user+sys) seconds of ``argv`` over RUNS runs after a warm-up, and rc.

    CPU time is reported beside wall time because it hardly moves when other jobs load the
    machine, while wall time does.
    """
    walls, cpus = [], []
    rc = 0
    for i in range(RUNS + 1):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=60)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if i:
            walls.append(wall)
            cpus.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        rc = done.returncode
    return statistics.median(walls), statistics.median(cpus), rc


def per_call(fn, seconds: float = 2.0) -> float:
    """Median seconds per call of ``fn`` over about ``seconds``."""
    fn()
    samples = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(samples) < 5:
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    gpu = has_gpu()
    work = Path(tempfile.mkdtemp(prefix="bench-select-"))
    env = dict(os.environ, PYTHONPATH=str(SRC), DEVICEKIT_LEASE_DIR=str(work / "leases"))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if not gpu:
        sim = work / "gpus.json"
        sim.write_text(json.dumps({"gpus": [
            {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": f"{i}GiB",
             "utilization": 10 * i} for i in range(8)]}))
        env["DEVICEKIT_SIMULATE"] = str(sim)
    os.environ.update(env)
    source = "NVML" if gpu else "8 simulated GPUs"
    print(f"machine: {os.cpu_count()} CPU cores, {'GPU' if gpu else 'no GPU'}; devicekit on {source}")
    print()

    py = sys.executable
    bare, bare_cpu, _ = cold([py, "-c", "pass"], env)

    def row(name: str, wall: float, cpu: float, note: str) -> tuple[str, ...]:
        return (name, f"{wall * 1000:.0f}", f"{wall / bare:.2f}", f"{cpu * 1000:.0f}",
                f"{cpu / bare_cpu:.2f}" if bare_cpu else "-", note)

    rows = [row("python -c pass", bare, bare_cpu, "")]
    wall, cpu, rc = cold([py, "-m", "devicekit", "select", "-q"], env)
    rows.append(row("devicekit select -q", wall, cpu,
                    f"+{(wall - bare) * 1000:.0f} ms wall, +{(cpu - bare_cpu) * 1000:.0f} ms CPU "
                    "over bare python (goal < 300 ms)" + ("" if rc == 0 else f", exit {rc}")))
    gputil_note = "" if gpu else "no GPU: nvidia-smi is absent, GPUtil returns [] at once"
    try:
        import GPUtil  # noqa: F401

        wall, cpu, _ = cold([py, "-c", "import GPUtil; GPUtil.getAvailable()"], env)
        rows.append(row("GPUtil.getAvailable() (anchor)", wall, cpu, gputil_note))
    except ImportError:
        rows.append(("GPUtil.getAvailable() (anchor)", "-", "-", "-", "-",
                     "skipped: GPUtil not installed"))
    gpustat = shutil.which("gpustat") or str(Path(py).parent / "gpustat")
    if Path(gpustat).exists():
        wall, cpu, rc = cold([gpustat, "--json"], env)
        rows.append(row("gpustat --json (anchor)", wall, cpu, "") if rc == 0 else
                    ("gpustat --json (anchor)", "-", "-", "-", "-",
                     "skipped: gpustat finds no NVIDIA driver on this machine"))
    else:
        rows.append(("gpustat --json (anchor)", "-", "-", "-", "-", "skipped: gpustat not installed"))
    table("cold start (median wall time of a fresh process)",
          ("command", "wall ms", "x bare", "CPU ms", "x bare", "note"), rows)

    sys.path.insert(0, str(SRC))
    from devicekit.hardware import inventory
    from devicekit.selection.choose import select_gpus

    inventory._cache.clear()

    def leased() -> None:
        select_gpus(1).release()

    t_lease = per_call(leased)
    t_plain = per_call(lambda: select_gpus(1, lease=False))
    rows = [("select_gpus(1) + release (leased)", f"{t_lease * 1e3:.2f}", "", ""),
            ("select_gpus(1, lease=False)", f"{t_plain * 1e3:.2f}", "", "")]
    try:
        import GPUtil

        t_gputil = per_call(GPUtil.getAvailable)
        rows[0] = (*rows[0][:2], f"{t_lease / t_gputil:.2f}", gputil_note)
        rows[1] = (*rows[1][:2], f"{t_plain / t_gputil:.2f}", gputil_note)
        rows.append(("GPUtil.getAvailable() (anchor)", f"{t_gputil * 1e3:.2f}", "1.00", gputil_note))
    except ImportError:
        rows.append(("GPUtil.getAvailable() (anchor)", "-", "-", "skipped: GPUtil not installed"))
    table("in-process, per call (median)", ("call", "ms", "x GPUtil", "note"), rows)
    shutil.rmtree(work, ignore_errors=True)


def table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"{title}:")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
    print()


if __name__ == "__main__":
    main()
