"""Benchmark the hang doctor's recording: a DDP step with it on vs off (goal: < 2 % slower).

Two gloo ranks train a small MLP with DDP and, as training loops do, all-reduce the loss each
step (a Python collective the recorder wraps). "on" is what ``devicekit run`` and ``dk.launch``
give every rank: ``DEVICEKIT_HANG_DIR`` (devicekit's own record, the probe thread, the progress
file) and torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE=256``); "off" is the same script
without them (the anchor: plain torch). The two alternate, job after job, so load from other
processes hits both alike; each job reports its median step time, and the ratio is of the
medians over jobs. On a loaded machine a job's median swings by 2x with what else runs, so
each job also reports its best 10-step block (the least disturbed stretch), and the ratio of
the best blocks over all jobs is the figure to read.

Usage::

    python benchmarks/bench_collective_record.py [--jobs 4] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"

WORKLOAD = """
import json, statistics, sys, time, torch, torch.distributed as tdist
from torch import nn
import devicekit as dk
dk.dist.init()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(
    nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 64), torch.randn(64, 1)
times = []
for step in range(int(sys.argv[2])):
    start = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    tdist.all_reduce(logged)
    times.append(time.perf_counter() - start)
if tdist.get_rank() == 0:
    steady = times[20:]
    blocks = [statistics.mean(steady[i:i + 10]) for i in range(0, len(steady) - 9, 10)]
    open(sys.argv[1], "w").write(json.dumps({"median": statistics.median(steady), "best": min(blocks)}))
dk.dist.destroy()
"""


def job(script: Path, steps: int, recording: bool, workdir: Path, port: int,
        flight_recorder: bool = True) -> dict[str, float]:
    out = workdir / f"out-{time.monotonic_ns()}.json"
    base = dict(os.environ)
    base["PYTHONPATH"] = str(SRC) + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    base.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    for name in ("DEVICEKIT_HANG_DIR", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        base.pop(name, None)
    record_dir = None
    if recording:
        record_dir = tempfile.mkdtemp(prefix="devicekit-hang-", dir=workdir)
        base.update(DEVICEKIT_HANG_DIR=record_dir)
        if flight_recorder:
            base.update(TORCH_FR_BUFFER_SIZE="256")
    procs = [subprocess.Popen([sys.executable, str(script), str(out), str(steps)],
                              env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    codes = [p.wait(timeout=600) for p in procs]
    if codes != [0, 0] or not out.exists():
        raise RuntimeError(f"job failed: exit codes {codes}")
    if recording and not list(Path(record_dir).glob("rank*.progress")):  # type: ignore[arg-type]
        raise RuntimeError("recording was asked for but no rank recorded")
    return {key: float(value) for key, value in json.loads(out.read_text()).items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5, help="jobs of each kind (alternating)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--without-flight-recorder", action="store_true",
                        help="'on' is devicekit's own record only (torch's Flight Recorder off)")
    args = parser.parse_args()
    from devicekit.jobs.launch import free_port

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        script = workdir / "workload.py"
        script.write_text(WORKLOAD)
        results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
        for i in range(args.jobs):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")
            for kind in order:
                results[kind].append(job(script, args.steps, kind == "on", workdir, free_port(),
                                         flight_recorder=not args.without_flight_recorder))
    medians = {kind: [r["median"] for r in rs] for kind, rs in results.items()}
    best = {kind: min(r["best"] for r in rs) for kind, rs in results.items()}
    off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores;"
          f" 2 gloo ranks, {args.steps} DDP steps + a loss all_reduce per step, {args.jobs} jobs each")
    print(f"median step, recording off (plain torch): {off * 1e3:.3f} ms  (jobs: "
          + ", ".join(f"{m * 1e3:.3f}" for m in medians["off"]) + ")")
    what = "devicekit only" if args.without_flight_recorder else "devicekit + Flight Recorder"
    print(f"median step, recording on ({what}): {on * 1e3:.3f} ms  (jobs: "
          + ", ".join(f"{m * 1e3:.3f}" for m in medians["on"]) + ")")
    print(f"ratio of medians on/off: {on / off:.3f}")
    print(f"best 10-step block: off {best['off'] * 1e3:.3f} ms, on {best['on'] * 1e3:.3f} ms;"
          f" ratio on/off: {best['on'] / best['off']:.3f}  (goal < 1.02)")


if __name__ == "__main__":
    main()
