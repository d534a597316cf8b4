"""Benchmark ``devicekit run`` against plain torchrun and ``accelerate launch``.

Two numbers for the same torch-only DDP script (``ddp_workload.py``, 2 processes, gloo on the
CPU here, nccl on GPUs):

* training throughput (steady-state steps/s of rank 0, from the median step time) through ``devicekit run`` vs plain
  ``python -m torch.distributed.run``: goal ratio >= 0.97, devicekit adds nothing to a step;
* start-up time from starting the launcher to the first finished training step, vs torchrun
  and ``accelerate launch`` (skipped with a line if accelerate is not installed).

devicekit run and torchrun alternate (in both orders) and the best of ``--repeats`` is kept,
to damp the noise of a shared machine; accelerate runs once. Usage::

    python benchmarks/bench_launch.py [--repeats 3] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "ddp_workload.py"
SRC = HERE.parent / "src"


def launchers(nprocs: int, gpu: bool) -> dict[str, list[str] | None]:
    devicekit = [sys.executable, "-m", "devicekit", "run",
                 *(["--gpus", str(nprocs)] if gpu else ["--procs", str(nprocs)]), "--", sys.executable]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(nprocs)]
    accelerate = shutil.which("accelerate", path=str(Path(sys.executable).parent)) or shutil.which("accelerate")
    acc = None
    if accelerate:
        acc = [accelerate, "launch", "--num_processes", str(nprocs), "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no",
               "--multi_gpu"]  # on the CPU, --cpu would start one process; this path is torchrun + gloo
    return {"devicekit run": devicekit, "torchrun": torchrun, "accelerate launch": acc}


def measure(prefix: list[str], steps: int, workdir: Path) -> dict[str, float]:
    out = workdir / f"result-{time.monotonic_ns()}.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun sets by default; the same for all three
    start = time.time()
    done = subprocess.run([*prefix, str(WORKLOAD), str(out), str(steps)], env=env,
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{prefix[:4]} failed ({done.returncode}): {done.stderr[-800:]}")
    data = json.loads(out.read_text())
    return {"startup": data["first_step"] - start, "rate": data["steps_per_second"]}


def own_overhead(repeats: int = 5) -> tuple[float, float]:
    """Best wall time of ``python -c pass`` alone and under ``devicekit run`` (one process)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    bare = [sys.executable, "-c", "pass"]
    wrapped = [sys.executable, "-m", "devicekit", "run", "--", *bare]
    times: dict[str, float] = {"bare": float("inf"), "wrapped": float("inf")}
    for _ in range(repeats):
        for key, cmd in (("bare", bare), ("wrapped", wrapped)):
            start = time.perf_counter()
            subprocess.run(cmd, env=env, capture_output=True, check=True, timeout=60)
            times[key] = min(times[key], time.perf_counter() - start)
    return times["bare"], times["wrapped"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nprocs", type=int, default=None,
                        help="processes (default: one per GPU, up to 8; 2 CPU processes without GPUs)")
    args = parser.parse_args(argv)
    try:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        gpus = 0
    if args.nprocs is None:
        args.nprocs = min(gpus, 8) or 2
    gpu = gpus >= args.nprocs
    table = launchers(args.nprocs, gpu)
    if table["accelerate launch"] is None:
        print("accelerate launch: skipped (accelerate is not installed)")
    best: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        for repeat in range(args.repeats):
            order = list(table.items()) if repeat % 2 == 0 else list(reversed(table.items()))
            for name, prefix in order:
                if prefix is None or (name == "accelerate launch" and repeat > 0):
                    continue  # accelerate: start-up only, one run keeps the benchmark short
                try:
                    result = measure(prefix, args.steps, Path(tmp))
                except RuntimeError as exc:  # a rare gloo abort on a loaded machine: retry once
                    print(f"retrying {name}: {str(exc).splitlines()[0]}", file=sys.stderr)
                    result = measure(prefix, args.steps, Path(tmp))
                seen = best.setdefault(name, {"startup": float("inf"), "rate": 0.0})
                seen["startup"] = min(seen["startup"], result["startup"])
                seen["rate"] = max(seen["rate"], result["rate"])
    where = f"{args.nprocs} x {'GPU (nccl)' if gpu else 'CPU process (gloo)'}"
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, {where}; "
          f"best of {args.repeats} (accelerate: 1), {args.steps} steps, OMP_NUM_THREADS=1")
    anchor = best["torchrun"]
    print()
    print("| launcher | steps/s (rank 0) | throughput ratio vs torchrun | start-up to first step (s) | start-up ratio vs torchrun |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, seen in best.items():
        print(f"| {name} | {seen['rate']:.1f} | {seen['rate'] / anchor['rate']:.3f} |"
              f" {seen['startup']:.2f} | {seen['startup'] / anchor['startup']:.2f} |")
    bare, wrapped = own_overhead()
    print()
    print(f"devicekit run's own start-up cost: `devicekit run -- python -c pass` {wrapped:.3f} s vs"
          f" `python -c pass` {bare:.3f} s (+{wrapped - bare:.3f} s; best of 5)")
    ratio = best["devicekit run"]["rate"] / anchor["rate"]
    print()
    print(f"goal: devicekit run throughput ratio >= 0.97 -> {ratio:.3f} "
          f"({'met' if ratio >= 0.97 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
