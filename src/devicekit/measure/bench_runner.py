"""``dk.bench()``: measure each device, beside its known peak, with progress; cache the results.

What is measured (``quick=True`` measures fewer sizes with smaller buffers and fewer rounds,
in a few seconds on an idle machine; other work on the CPU makes every figure slower to take):

* every device: matmul TFLOP/s per dtype and size, copy bandwidth inside its memory, the time
  per tiny op (launch latency), and D2L's logging exercise (``.item()`` per step vs
  ``dk.MetricLog``); the CPU with the threads this process may use;
* each GPU: host-to-device and device-to-host bandwidth, pinned and pageable, and the matrix
  size at which it overtakes the CPU (D2L exercise 1);
* several GPUs: P2P bandwidth for each pair (and whether P2P is enabled), and all GPUs working
  at once vs one after another (D2L exercise 4; ideal speedup: the number of GPUs).

Each device's result is cached by UUID (``cpu`` for the host, see
:mod:`devicekit.hardware.bench_cache`), so ``select --order fastest``, ``run`` and
``BalancedDataParallel(weights="auto")`` use measured figures once every GPU has been benched.

Usage::

    import devicekit as dk

    report = dk.bench(quick=True)                # CPU and every visible GPU
    report = dk.bench(["cuda:0"], progress=False)
    print(report.to_dict()["devices"][0]["figures"][0])
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from devicekit.errors import InvalidValueError
from devicekit.hardware.bench_cache import write_result
from devicekit.hardware.known_gpus import KnownGPU, lookup
from devicekit.measure import exercises, matmul, transfers
from devicekit.measure.devices import bench_devices, cuda_count
from devicekit.measure.report import BenchReport, DeviceBench, Figure

__all__ = ["bench", "Plan", "logging_figures"]

MiB = 1 << 20


@dataclass(frozen=True)
class Plan:
    """Sizes for one run."""

    cpu_sizes: tuple[int, ...]
    gpu_sizes: tuple[int, ...]
    crossover_sizes: tuple[int, ...]
    copy_bytes: int
    memory_bytes: int
    peer_bytes: int
    ops: int
    steps: int
    #: paired rounds of the logging exercise (.item() vs MetricLog), and seconds after which
    #: no new round starts (None: all of them)
    rounds: int
    logging_budget: float | None = None

    @classmethod
    def for_run(cls, quick: bool) -> Plan:
        if quick:
            return cls((256, 1024), (4096,), (16, 64, 256, 1024), 64 * MiB, 256 * MiB,
                       64 * MiB, 200, 100, 3, 2.0)
        return cls((64, 256, 1024), (256, 1024, 4096, 8192), (16, 32, 64, 128, 256, 512, 1024, 2048),
                   256 * MiB, 1024 * MiB, 256 * MiB, 1000, 1000, 5)


Step = tuple[str, Callable[[], None]]


def bench(devices: Sequence[str] | str | None = None, *, quick: bool = False,
          progress: bool | None | Callable[[str], None] = None, cache: bool = True) -> BenchReport:
    """Measure ``devices`` (default: the CPU and every visible GPU); see the module doc.

    ``progress``: a rich progress bar on stderr (None: only when stderr is a terminal), or a
    function called with each measurement's description before it runs (no bar).
    ``cache``: write each device's result to the bench cache.
    """
    if not isinstance(quick, bool):
        raise InvalidValueError(f"quick={quick!r} must be True or False")
    chosen = bench_devices(devices)
    plan = Plan.for_run(quick)
    gpus = [d for d in chosen if d.type == "cuda"]
    report = BenchReport([_describe(d) for d in chosen], quick=quick, gpu_count=cuda_count())
    if report.gpu_count == 0:
        report.notes.append(
            f"no GPU: torch {torch.__version__} sees no CUDA device "
            f"({'CPU-only build' if torch.version.cuda is None else 'CUDA ' + torch.version.cuda + ' build, no device or driver'}); "
            "CPU figures only")
    elif not gpus:
        report.notes.append(f"{report.gpu_count} GPU(s) present but not asked for (--device)")
    steps = [step for dev, entry in zip(chosen, report.devices, strict=True)
             for step in _device_steps(dev, entry, plan)]
    steps += _system_steps(gpus, report, plan)
    start = time.perf_counter()
    _run_steps(steps, progress)
    report.seconds = time.perf_counter() - start
    if cache:
        report.cache_files = [str(p) for p in _write_cache(report)]
    return report


def _describe(device: torch.device) -> DeviceBench:
    if device.type == "cpu":
        return DeviceBench("cpu", _cpu_name(), uuid="cpu")
    name = torch.cuda.get_device_name(device)
    props = torch.cuda.get_device_properties(device)
    raw_uuid = getattr(props, "uuid", None)
    uuid = None if raw_uuid is None else (str(raw_uuid) if str(raw_uuid).startswith("GPU-")
                                          else f"GPU-{raw_uuid}")
    known = lookup(name)
    return DeviceBench(str(device), name, uuid=uuid, known_model=known.model if known else "unknown")


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def _device_steps(device: torch.device, entry: DeviceBench, plan: Plan) -> list[Step]:
    known = lookup(entry.name) if device.type == "cuda" else None
    add = entry.figures.append
    steps: list[Step] = []
    sizes = plan.gpu_sizes if device.type == "cuda" else plan.cpu_sizes
    threads = {"threads": torch.get_num_threads(), "usable_cores": _usable_cores()}
    for dtype in matmul.supported_dtypes(device):
        for n in sizes:
            def measure(dtype: str = dtype, n: int = n) -> None:
                value = matmul.matmul_tflops(device, dtype, n)
                detail = {"n": n, "dtype": dtype, **(threads if device.type == "cpu" else {})}
                add(Figure(f"matmul.{dtype}.{n}", f"matmul {dtype} {n}x{n}", value, "TFLOP/s",
                           _peak(known, dtype), detail))
            steps.append((f"{device} matmul {dtype} n={n}", measure))
    steps.append((f"{device} memory copy", lambda: add(Figure(
        "memory.copy", "copy within memory (read+write)",
        transfers.within_device_gbs(device, plan.memory_bytes), "GB/s",
        known.memory_bandwidth_gbs if known else None, {"bytes": plan.memory_bytes}))))
    if device.type == "cuda":
        for pinned in (True, False):
            for to_device in (True, False):
                kind = "pinned" if pinned else "pageable"
                key = f"{'h2d' if to_device else 'd2h'}.{kind}"
                label = f"{'host to device' if to_device else 'device to host'}, {kind}"

                def copy(pinned: bool = pinned, to_device: bool = to_device, key: str = key,
                         label: str = label) -> None:
                    add(Figure(key, label, transfers.host_device_gbs(
                        device, plan.copy_bytes, pinned=pinned, to_device=to_device), "GB/s",
                        None, {"bytes": plan.copy_bytes}))
                steps.append((f"{device} {label}", copy))
        steps.append((f"{device} vs cpu crossover", lambda: _crossover(device, entry, plan)))
    steps.append((f"{device} launch latency", lambda: add(Figure(
        "latency.op", "time per tiny op (launch latency)",
        exercises.launch_latency_us(device, plan.ops), "us", None, {"ops": plan.ops}))))
    steps.append((f"{device} logging exercise", lambda: _logging(device, entry, plan)))
    return steps


def _peak(known: KnownGPU | None, dtype: str) -> float | None:
    return known.peak(dtype) if known is not None else None


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _crossover(device: torch.device, entry: DeviceBench, plan: Plan) -> None:
    size, rows = matmul.crossover(device, plan.crossover_sizes)
    entry.figures.append(Figure(
        "crossover", "fp32 size where it overtakes the CPU", float(size or 0), "n",
        None, {"found": size is not None, "per_size": rows}))
    if size is None:
        entry.notes.append(f"the CPU was faster at every size up to {plan.crossover_sizes[-1]}")


def _logging(device: torch.device, entry: DeviceBench, plan: Plan) -> None:
    seconds = exercises.logging_seconds(device, plan.steps, rounds=plan.rounds,
                                        budget=plan.logging_budget)
    figures, note = logging_figures(seconds, plan.steps)
    entry.figures += figures
    if note:
        entry.notes.append(note)


def logging_figures(seconds: dict[str, float], steps: int) -> tuple[list[Figure], str | None]:
    """The logging exercise's rows from :func:`~devicekit.measure.exercises.median_round`'s
    result: both times of the median round and its speed-up (so they cannot disagree), and a
    note when the rounds spread too far to trust."""
    rounds = int(seconds["rounds"])
    detail = {"steps": steps, "n": 100, "rounds": rounds,
              "median_round": int(seconds.get("median_round", 0)),
              "spread": round(seconds["spread"], 3),
              "noisy": seconds["spread"] > exercises.NOISY_SPREAD}
    note = None
    if detail["noisy"]:
        note = (f"MetricLog speed-up is noisy: {seconds['speedup']:.2f}x is the median of"
                f" {rounds} rounds that spread {seconds['spread']:.1f}x (max/min); the"
                " machine is busy, rerun when it is idle")
    figures = [
        Figure("logging.item_per_step", f"{steps} steps, .item() each (the median round)",
               seconds["item_per_step"], "s", None, detail),
        Figure("logging.metric_log", f"{steps} steps, dk.MetricLog (the same round)",
               seconds["metric_log"], "s", None, detail),
        Figure("logging.speedup", f"MetricLog speedup (median of {rounds} rounds)",
               seconds["speedup"], "x", None, detail),
    ]
    return figures, note


def _system_steps(gpus: list[torch.device], report: BenchReport, plan: Plan) -> list[Step]:
    if len(gpus) < 2:
        if len(gpus) == 1:
            report.notes.append("one GPU: no P2P or multi-GPU scaling to measure")
        return []
    steps: list[Step] = []
    pairs = [(a, b) for a in gpus for b in gpus if a != b and (not plan.ops < 1000 or a.index < b.index)]
    for src, dst in pairs:
        def peer(src: torch.device = src, dst: torch.device = dst) -> None:
            enabled = transfers.peer_enabled(src, dst)
            report.system.append(Figure(
                f"p2p.{src.index}-{dst.index}", f"{src} -> {dst} ({'P2P' if enabled else 'no P2P: via host'})",
                transfers.peer_gbs(src, dst, plan.peer_bytes), "GB/s", None,
                {"p2p_enabled": enabled, "bytes": plan.peer_bytes}))
        steps.append((f"{src} -> {dst}", peer))

    def scale() -> None:
        result = exercises.scaling(gpus, repeats=10 if plan.ops < 1000 else 20)
        report.system.append(Figure(
            "scaling", f"{len(gpus)} GPUs at once vs in sequence", result["speedup"], "x",
            result["ideal"], result))
    steps.append((f"{len(gpus)} GPUs at once vs in sequence", scale))
    return steps


def _run_steps(steps: list[Step], progress: bool | None | Callable[[str], None]) -> None:
    if callable(progress):
        for number, (description, step) in enumerate(steps, 1):
            progress(f"{description} ({number}/{len(steps)})")
            step()
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    enabled = sys.stderr.isatty() if progress is None else bool(progress)
    console = Console(stderr=True)
    with Progress(TextColumn("bench: {task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=console, transient=True, disable=not enabled) as bar:
        task = bar.add_task("starting", total=len(steps))
        for description, step in steps:
            bar.update(task, description=description)
            step()
            bar.advance(task)
    if enabled:
        console.print(f"bench: {len(steps)} measurements done")


def _write_cache(report: BenchReport) -> list[object]:
    files = []
    for entry in report.devices:
        if entry.uuid is None:
            continue
        tflops: dict[str, float] = {}
        for fig in entry.figures:
            if fig.key.startswith("matmul."):
                dtype = fig.key.split(".")[1]
                tflops[dtype] = max(tflops.get(dtype, 0.0), fig.value)
        memory = entry.get("memory.copy")
        files.append(write_result(entry.uuid, {
            "device": entry.device, "name": entry.name, "quick": report.quick,
            "measured_at": time.time(), "matmul_tflops": tflops,
            "memory_gbs": memory.value if memory else None,
            "figures": {f.key: f.value for f in entry.figures},
        }))
    return files
