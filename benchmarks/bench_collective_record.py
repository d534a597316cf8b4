"""Benchmark the hang doctor's recording on a DDP step (goal: < 2 % slower than plain torch).

Two gloo ranks train a small MLP with DDP and, as training loops do, all-reduce the loss each
step (a Python collective the recorder wraps). Each rank is pinned to its own core where the
machine has two or more, so the ranks do not trade places on the cores between runs.

Two measurements, each against its anchor in the same run:

1. **devicekit's record** (what ``devicekit run`` and ``dk.launch`` give every rank: the wrapped
   collectives, ``rank<R>.last`` rewritten per call, the probe thread and its progress file) vs
   the same job with the wrapper switched off. Inside one job, both ranks switch the wrapper on
   and off together every ``--block`` steps (default 2: a job's load and its drift hit both
   alike); the ratio is the median over adjacent (on, off) block pairs, in both orders. An A/A
   control job (recording on in both halves, labelled the same way) gives the estimator's own
   spread on this machine, measured in the same run. The probe thread runs in both halves: it wakes twice a second, which is measured apart (its cost
   per wake-up x 2 per second).
2. **torch's Flight Recorder** on gloo (``TORCH_FR_BUFFER_SIZE=256``, which cannot be switched
   inside a job): jobs with it and without it alternate; the ratio is of the medians over jobs.

Usage::

    python benchmarks/bench_collective_record.py [--steps 2000] [--block 2] [--jobs 6] [--width 256]
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
import json, os, statistics, sys, time, torch, torch.distributed as tdist
from torch import nn
import devicekit as dk
from devicekit.parallel import collective_log
dk.dist.init()
torch.manual_seed(0)
width = int(sys.argv[5])
model = nn.parallel.DistributedDataParallel(nn.Sequential(
    nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 64), torch.randn(64, 1)
steps, block, toggle = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] in ("toggle", "same")
same = sys.argv[4] == "same"  # the A/A control: blocks labelled on/off, recording on in both
state = collective_log._state
times, kinds = [], []
for step in range(steps):
    on = state is not None and (not toggle or (step // block) % 2 == 0)
    collective_log._state = state if on or same else None
    start = time.perf_counter()
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    logged = loss.detach().clone()
    tdist.all_reduce(logged)
    times.append(time.perf_counter() - start)
    kinds.append(on)
collective_log._state = state
if tdist.get_rank() == 0:
    warm = max(2 * block, 20)
    warm += (-warm) % block
    blocks = [(kinds[i], statistics.mean(times[i:i + block]))
              for i in range(warm, steps - block + 1, block)]
    json.dump({"median": statistics.median(times[warm:]), "blocks": blocks}, open(sys.argv[1], "w"))
dk.dist.destroy()
"""

PROBE = """
import json, os, sys, tempfile, time, timeit
from devicekit.parallel import collective_log
directory = tempfile.mkdtemp()
state = collective_log._State(directory, 0, 60.0)
state.entries.append({"seq": 1, "state": "completed"})
progress = os.path.join(directory, "rank0.progress")
def wake():  # what one wake-up of the probe thread does (progress changed: the costly case)
    collective_log._progress()
    collective_log._write(progress, json.dumps({"torch_seq": 1, "seq": 1, "state": "completed",
                                                "timeout": 60.0}))
    collective_log._read_request(os.path.join(directory, collective_log.REQUEST_FILE))
runs = 2000
print(min(timeit.repeat(wake, number=runs, repeat=5)) / runs)
"""


def job(script: Path, args: argparse.Namespace, toggle: bool | str, flight_recorder: bool,
        workdir: Path) -> dict:
    from devicekit.jobs.launch import free_port

    out = workdir / f"out-{time.monotonic_ns()}.json"
    base = dict(os.environ)
    base["PYTHONPATH"] = str(SRC) + (os.pathsep + base["PYTHONPATH"] if base.get("PYTHONPATH") else "")
    base.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        base.pop(name, None)
    record_dir = tempfile.mkdtemp(prefix="devicekit-hang-", dir=workdir)
    base["DEVICEKIT_HANG_DIR"] = record_dir
    if flight_recorder:
        base["TORCH_FR_BUFFER_SIZE"] = "256"
    cores = os.cpu_count() or 1
    procs = []
    for rank in range(2):
        pin = ["taskset", "-c", str(rank % cores)] if args.pin and cores >= 2 and _has_taskset() else []
        procs.append(subprocess.Popen(
            [*pin, sys.executable, str(script), str(out), str(args.steps), str(args.block),
             toggle if isinstance(toggle, str) else ("toggle" if toggle else "on"), str(args.width)],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    codes = [p.wait(timeout=600) for p in procs]
    if codes != [0, 0] or not out.exists():
        raise RuntimeError(f"job failed: exit codes {codes}")
    if not list(Path(record_dir).glob("rank*.progress")):
        raise RuntimeError("recording was asked for but no rank recorded")
    return json.loads(out.read_text())


def _has_taskset() -> bool:
    from shutil import which

    return which("taskset") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000, help="DDP steps per job")
    parser.add_argument("--block", type=int, default=2, help="steps per on/off block")
    parser.add_argument("--pin", action="store_true", help="pin each rank to a core of its own")
    parser.add_argument("--width", type=int, default=256, help="hidden width of the MLP (step size)")
    parser.add_argument("--toggle-jobs", type=int, default=2, help="jobs of the on/off measurement")
    parser.add_argument("--jobs", type=int, default=6, help="jobs of each kind (Flight Recorder)")
    parser.add_argument("--fr-steps", type=int, default=600, help="DDP steps per Flight Recorder job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        script = workdir / "workload.py"
        script.write_text(WORKLOAD)
        pairs: dict[str, list[float]] = {"toggle": [], "same": []}
        on_blocks: list[float] = []
        off_blocks: list[float] = []
        for _ in range(args.toggle_jobs):
            for kind in ("toggle", "same"):
                blocks = job(script, args, toggle=kind, flight_recorder=False, workdir=workdir)["blocks"]
                for (first_on, first), (second_on, second) in zip(blocks, blocks[1:]):  # noqa: B905
                    if first_on != second_on:  # every neighbouring pair: (on, off) and (off, on)
                        on, off = (first, second) if first_on else (second, first)
                        pairs[kind].append(on / off)
                        if kind == "toggle":
                            on_blocks.append(on)
                            off_blocks.append(off)
        medians: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(args.jobs):
            for kind in (("off", "on") if i % 2 == 0 else ("on", "off")):
                fr_args = argparse.Namespace(**{**vars(args), "steps": args.fr_steps, "block": 10})
                medians[kind].append(job(script, fr_args, toggle=False, flight_recorder=kind == "on",
                                         workdir=workdir)["median"])
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        wake = float(subprocess.run([sys.executable, "-c", PROBE], env=env, check=True,
                                    capture_output=True, text=True).stdout)
    step = statistics.median(off_blocks)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores,"
          f" load average {os.getloadavg()[0]:.2f}; 2 gloo ranks{' (pinned)' if args.pin else ''},"
          f" an MLP of width {args.width} under DDP"
          " + one loss all_reduce per step")
    print("| what | anchor | with | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| devicekit's record, in-job on/off blocks of {args.block} steps"
          f" ({len(pairs['toggle'])} pairs, {args.toggle_jobs} jobs): median of pair ratios"
          f" | {step * 1e3:.3f} ms/step | {statistics.median(on_blocks) * 1e3:.3f} ms/step"
          f" | {statistics.median(pairs['toggle']):.3f} |")
    print(f"| the same with recording on in both halves (A/A control: the estimator's floor,"
          f" {len(pairs['same'])} pairs) | - | - | {statistics.median(pairs['same']):.3f} |")
    probe_share = wake * 2 / 1.0  # two wake-ups a second
    print(f"| the probe thread: one wake-up {wake * 1e6:.1f} us, 2 per second | - | - |"
          f" {1 + probe_share:.4f} |")
    off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
    print(f"| torch's Flight Recorder on gloo, {args.jobs} jobs each: median of job medians"
          f" | {off * 1e3:.3f} ms/step | {on * 1e3:.3f} ms/step | {on / off:.3f} |")


if __name__ == "__main__":
    main()
