"""Benchmark: a simulated day on an 8-GPU server: the fair queue against today's polling.

An arrival trace of 1/2/4/8-GPU jobs with lengths (Poisson arrivals over 24 h, sizes 50/25/15/10 %,
lengths log-uniform 5 min to 3 h; 70 % of jobs declare a time limit of 1.2-2x their length)
runs through three schedulers on a virtual clock (simulated time, not wall time):

- ``polling`` (the anchor: devicekit before the queue, ``--wait`` polls): whenever GPUs free up,
  the waiting jobs look in random order (their polling phases) and each takes GPUs if enough
  are free at that moment.
- ``queue``: the decision the queue uses (:func:`devicekit.sharing.queue_order.decide`) at
  every arrival and end: FIFO, reservations for earlier tickets, EASY backfill of jobs whose
  declared limit ends before the reserving ticket could start (holders without a limit count
  as freeing at once).
- ``ideal``: the same FIFO with backfill, offline, knowing every job's true length (every job
  "declares" its exact length).

Printed: mean and max wait per job size (minutes), GPU utilisation (busy GPU-hours over 8 GPUs
from the first arrival to the last end), and the ratios against polling. Goal: the max wait of
8-GPU jobs bounded, utilisation within 10 % of polling.

Run: ``python benchmarks/bench_queue.py [--days N] [--load L]`` (a few seconds).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from devicekit.sharing.queue_order import Busy, Waiting, decide  # noqa: E402

GPUS = [f"GPU-{i}" for i in range(8)]
SIZES = (1, 2, 4, 8)
WEIGHTS = (0.50, 0.25, 0.15, 0.10)


@dataclass
class Job:
    id: int
    arrive: float
    size: int
    length: float
    limit: float | None
    start: float | None = None


def trace(seed: int, load: float, hours: float = 24.0) -> list[Job]:
    """Arrivals whose GPU-hours are ``load`` of the 8 GPUs' capacity over ``hours``."""
    rng = random.Random(seed)
    mean_size = sum(s * w for s, w in zip(SIZES, WEIGHTS, strict=True))
    lo, hi = math.log(5 * 60), math.log(3 * 3600)
    mean_length = (math.exp(hi) - math.exp(lo)) / (hi - lo)
    rate = load * len(GPUS) / (mean_size * mean_length)  # jobs per second
    jobs, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > hours * 3600:
            return jobs
        size = rng.choices(SIZES, WEIGHTS)[0]
        length = math.exp(rng.uniform(lo, hi))
        limit = length * rng.uniform(1.2, 2.0) if rng.random() < 0.7 else None
        jobs.append(Job(len(jobs), t, size, length, limit))


def simulate(jobs: list[Job], mode: str, seed: int) -> list[Job]:
    """Run ``jobs`` (copies) through ``mode``; returns them with start times."""
    rng = random.Random(seed)
    jobs = [Job(j.id, j.arrive, j.size, j.length, j.length if mode == "ideal" else j.limit)
            for j in jobs]
    events: list[tuple[float, int, int]] = [(j.arrive, 1, j.id) for j in jobs]  # (t, kind, id)
    heapq.heapify(events)
    held: dict[str, int] = {}          # gpu -> job id
    waiting: list[Job] = []
    while events:
        now = events[0][0]
        while events and events[0][0] == now:  # simultaneous events together
            _, kind, jid = heapq.heappop(events)
            if kind == 0:              # an end frees its GPUs
                for g in [g for g, j in held.items() if j == jid]:
                    del held[g]
            else:
                waiting.append(jobs[jid])
        for started, gpus in _schedule(mode, waiting, held, jobs, now, rng):
            started.start = now
            for g in gpus:
                held[g] = started.id
            waiting.remove(started)
            heapq.heappush(events, (now + started.length, 0, started.id))
    return jobs


def _schedule(mode: str, waiting: list[Job], held: dict[str, int], jobs: list[Job], now: float,
              rng: random.Random) -> list[tuple[Job, list[str]]]:
    out: list[tuple[Job, list[str]]] = []
    busy = dict(held)
    if mode == "polling":
        order = list(waiting)
        rng.shuffle(order)             # whoever polls first takes what is free
        for job in order:
            free = [g for g in GPUS if g not in busy]
            if len(free) >= job.size:
                out.append((job, free[: job.size]))
                busy.update({g: job.id for g in free[: job.size]})
        return out
    while True:                        # decide again after each round of grants
        state = {g: Busy("", "u", _ends(jobs[j], now)) for g, j in busy.items()}
        pending = [j for j in waiting if j.id not in {o[0].id for o in out}]
        tickets = [Waiting(str(j.id), "u", j.size, frozenset(GPUS), j.limit) for j in pending]
        granted = [d for d in decide(tickets, GPUS, state, now) if d.grant]
        if not granted:
            return out
        by_id = {str(j.id): j for j in pending}
        for d in granted:
            job = by_id[d.ticket]
            job.start = now                # for _ends of what starts in this round
            out.append((job, list(d.grant)))
            busy.update({g: job.id for g in d.grant})


def _ends(job: Job, now: float) -> float | None:
    start = job.start if job.start is not None else now
    return None if job.limit is None else start + job.limit


def report(runs: dict[str, list[list[Job]]]) -> list[str]:
    lines = ["| scheduler | " + " | ".join(f"{s}-GPU mean / max wait (min)" for s in SIZES)
             + " | GPU utilisation |", "|---|" + "---|" * (len(SIZES) + 1)]
    summary: dict[str, tuple[float, float]] = {}
    for mode, days in runs.items():
        cells = []
        for size in SIZES:
            waits = [(j.start - j.arrive) / 60 for day in days for j in day
                     if j.size == size and j.start is not None]
            cells.append(f"{sum(waits) / len(waits):.0f} / {max(waits):.0f}" if waits else "-")
            if size == 8:
                eight = max(waits) if waits else float("nan")
        busy = sum(j.size * j.length for day in days for j in day)
        span = sum(max(j.start + j.length for j in day) - min(j.arrive for j in day)
                   for day in days)
        util = busy / (len(GPUS) * span)
        summary[mode] = (eight, util)
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {util:.1%} |")
    base_wait, base_util = summary["polling"]
    for mode in ("queue", "ideal"):
        wait, util = summary[mode]
        lines.append(f"{mode} vs polling: max wait of 8-GPU jobs x{wait / base_wait:.2f},"
                     f" utilisation x{util / base_util:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=10, help="simulated days (one trace each)")
    parser.add_argument("--load", type=float, default=0.85, help="offered load, share of capacity")
    args = parser.parse_args()
    days = [trace(seed, args.load) for seed in range(args.days)]
    runs = {mode: [simulate(day, mode, seed) for seed, day in enumerate(days)]
            for mode in ("polling", "queue", "ideal")}
    unserved = sum(j.start is None for ds in runs.values() for d in ds for j in d)
    print(f"{args.days} simulated day(s) on 8 GPUs, offered load {args.load:.0%},"
          f" {sum(len(d) for d in days)} jobs; unserved: {unserved}")
    for line in report(runs):
        print(line)


if __name__ == "__main__":
    main()
