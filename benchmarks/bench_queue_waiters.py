"""Benchmark: what waiting in the fair queue costs, per waiter, against a bare polling loop.

On simulated GPUs in a private lease directory, one job holds the only GPU and N jobs wait for
it (``devicekit run --gpus 1 --wait ...``). Each waiter looks once a second; what one look costs
grows with the number of tickets it reads. Printed: the CPU each waiter uses (percent of one
core, mean and max over a 10 s window, after the waiters have settled), beside the anchor a
user would otherwise write: a shell loop that asks ``devicekit select`` once a second until a
GPU is free (``until devicekit select; do sleep 1; done``), its children's CPU counted. Goal
(issue 33): well under 1 % of a core per waiter at 30 waiters.

Run: ``python benchmarks/bench_queue_waiters.py [--waiters 30] [--seconds 10]`` (about 40 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SRC = str(Path(__file__).resolve().parents[1] / "src")
ANCHOR = 'until "$0" -m devicekit select >/dev/null 2>&1; do sleep 1; done'


def cpu_percent(pids: list[int], seconds: float) -> list[float]:
    """Percent of one core each process used over ``seconds``."""
    procs = [psutil.Process(p) for p in pids]
    before = [sum(p.cpu_times()[:4]) for p in procs]  # with the children it has waited for
    time.sleep(seconds)
    after = [sum(p.cpu_times()[:4]) for p in procs]
    return [100 * (b - a) / seconds for a, b in zip(before, after, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=30)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="devicekit-bench-waiters-"))
    leases = scratch / "leases"
    leases.mkdir()
    leases.chmod(0o1777)
    sim = scratch / "gpus.json"
    sim.write_text(json.dumps({"gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB",
                                         "memory_used": "0GiB", "utilization": 0}]}))
    env = dict(os.environ, DEVICEKIT_SIMULATE=str(sim), DEVICEKIT_LEASE_DIR=str(leases),
               PYTHONPATH=SRC)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    run = [sys.executable, "-m", "devicekit", "run", "--gpus", "1"]
    started: list[subprocess.Popen[bytes]] = []
    try:
        holder = subprocess.Popen([*run, "--", "sleep", "600"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(holder)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not list(leases.glob("*.lease")):
            time.sleep(0.1)
        waiters = [subprocess.Popen([*run, "--wait", "600", "--", "true"], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for _ in range(args.waiters)]
        anchors = [subprocess.Popen(["bash", "-c", ANCHOR, sys.executable], env=env)
                   for _ in range(3)]
        started += waiters + anchors
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list(leases.glob("q.*.ticket"))) < args.waiters:
            time.sleep(0.2)
        time.sleep(3)  # start-up (imports) is not waiting
        costs = cpu_percent([w.pid for w in waiters] + [a.pid for a in anchors], args.seconds)
        waiting, anchor = costs[:args.waiters], costs[args.waiters:]
        mean_wait = sum(waiting) / len(waiting)
        mean_anchor = sum(anchor) / len(anchor)
        print(f"{args.waiters} waiters on 1 leased GPU, {args.seconds:g} s window, {os.cpu_count()} cores")
        print("| waiter | CPU per waiter, % of a core (mean / max) | vs the anchor |")
        print("|---|---|---|")
        print(f"| devicekit run --wait (the queue) | {mean_wait:.2f} / {max(waiting):.2f} |"
              f" x{mean_wait / max(mean_anchor, 1e-6):.3f} |")
        print(f"| anchor: until devicekit select; do sleep 1; done | {mean_anchor:.2f} /"
              f" {max(anchor):.2f} | 1 |")
    finally:
        for proc in started:
            proc.kill()
        for proc in started:
            proc.wait(timeout=30)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
