"""Leak-finder overhead per training step, against the plain loop and the tools a user would pick.

A small MLP (256-512-512-10, batch 64, Adam) trains on CPU. Each variant runs the same steps;
the table shows CPU milliseconds per step (process time: other jobs on a shared machine do
not count) and the ratio to the plain loop measured in the same run:

- devicekit LeakDetector, step-level tracking (lines=False), with and without the cycle check
- devicekit LeakDetector with line attribution, on a clean loop (nothing grows: tracer idle)
  and on a leaky loop (a list grows every step: the line tracer runs on every step)
- torch.distributed._tools.mem_tracker.MemTracker (PyTorch's own tracker)
- pytorch_memlab MemReporter, reporting once per step (how it is used to watch a loop)
- the previous LeakDetector (fixed roots only, before it started from the memory), from git
  ref ``--previous`` (default ``1e453dc``), timed in a subprocess in the same rounds
- a small CNN (conv 3-16-32, 32x32 images, batch 32, SGD) for the detector's main variants,
  and a leaky loop where a forward hook is registered every step (found from the memory)

Run: python benchmarks/bench_leaks.py  (a few minutes on a loaded 2-core CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--as-previous" not in sys.argv:
    sys.path.insert(0, str(ROOT / "src"))  # this checkout's devicekit

import torch  # noqa: E402
from torch import nn  # noqa: E402

import devicekit as dk  # noqa: E402

STEPS = 80
SLOW_STEPS = 8  # for the trackers that cost 30x and more
CNN_STEPS = 20
REPEATS = 4


def setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    return model, opt, torch.randn(64, 256), torch.randint(0, 10, (64,))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


def plain(steps: int) -> float:
    model, opt, x, y = setup()
    total = 0.0
    began = time.process_time()
    for _ in range(steps):
        total += train_step(model, opt, x, y).item()
    return time.process_time() - began


def plain_leaky(steps: int) -> float:
    model, opt, x, y = setup()
    kept = []
    began = time.process_time()
    for _ in range(steps):
        kept.append(train_step(model, opt, x, y).detach())
    return time.process_time() - began


INSIDE: dict[str, list[float]] = {}  # CPU seconds spent inside ld.step(), per step, per variant


def detector(lines: bool, cycles: bool) -> Callable[[int], float]:
    def run(steps: int) -> float:
        model, opt, x, y = setup()
        total = 0.0
        inside = 0.0
        began = time.process_time()
        with dk.LeakDetector(lines=lines, cycles=cycles) as ld:
            for _ in range(steps):
                total += train_step(model, opt, x, y).item()
                mark = time.process_time()
                ld.step()
                inside += time.process_time() - mark
        elapsed = time.process_time() - began
        assert ld.report().ok, ld.report()
        INSIDE.setdefault(f"lines={lines}, cycles={cycles}", []).append(inside / steps)
        return elapsed

    return run


def detector_leaky(steps: int) -> float:
    model, opt, x, y = setup()
    kept = []
    began = time.process_time()
    with dk.LeakDetector(lines=True) as ld:
        for _ in range(steps):
            kept.append(train_step(model, opt, x, y).detach())
            ld.step()
    elapsed = time.process_time() - began
    report = ld.report()  # detached scalar losses: slow growth (report.minor), traced like a leak
    assert steps < 6 or "kept" in [leak.holder for leak in (*report.leaks, *report.minor)], report
    return elapsed


def memtracker(steps: int) -> float:
    from torch.distributed._tools.mem_tracker import MemTracker

    model, opt, x, y = setup()
    tracker = MemTracker()
    tracker.track_external(model, opt)
    total = 0.0
    began = time.process_time()
    with tracker:
        for _ in range(steps):
            total += train_step(model, opt, x, y).item()
            tracker.reset_mod_stats()  # required per iteration (MemTracker refuses repeated calls)
    return time.process_time() - began


def memlab(steps: int) -> float:
    from pytorch_memlab import MemReporter

    model, opt, x, y = setup()
    reporter = MemReporter(model)
    total = 0.0
    began = time.process_time()
    with contextlib.redirect_stdout(io.StringIO()):
        for _ in range(steps):
            total += train_step(model, opt, x, y).item()
            reporter.report()
    return time.process_time() - began




def cnn_setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return model, opt, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))


def cnn(with_detector: bool, lines: bool = False) -> Callable[[int], float]:
    def run(steps: int) -> float:
        model, opt, x, y = cnn_setup()
        total = 0.0
        began = time.process_time()
        if with_detector:
            with dk.LeakDetector(lines=lines) as ld:
                for _ in range(steps):
                    total += train_step(model, opt, x, y).item()
                    ld.step()
            assert ld.report().ok, ld.report()
        else:
            for _ in range(steps):
                total += train_step(model, opt, x, y).item()
        return time.process_time() - began

    return run


def hook_leak(with_detector: bool) -> Callable[[int], float]:
    """A forward hook registered every step, each keeping an activation: found from the memory."""

    def run(steps: int) -> float:
        model, opt, x, y = setup()
        began = time.process_time()
        ld = dk.LeakDetector(lines=True) if with_detector else None
        if ld is not None:
            ld.start()
        for _ in range(steps):
            feats: list[torch.Tensor] = []
            model[1].register_forward_hook(lambda m, i, o, feats=feats: feats.append(o.detach()))
            train_step(model, opt, x, y)
            if ld is not None:
                ld.step()
        elapsed = time.process_time() - began
        if ld is not None:
            report = ld.report()
            ld.stop()
            assert steps < 6 or report.leak("model.1._forward_hooks") is not None, report
        return elapsed

    return run


def previous_detector(ref: str) -> Callable[[int], float] | None:
    """The previous LeakDetector, from git ``ref``, timed in a subprocess (same rounds)."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src/devicekit"],
                                 capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        print(f"previous LeakDetector skipped: git archive {ref} failed ({err})")
        return None
    folder = tempfile.mkdtemp(prefix="dk-previous-")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")

    def run(steps: int) -> float:
        out = subprocess.run([sys.executable, __file__, "--as-previous", str(Path(folder) / "src"),
                              "--steps", str(steps)], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    return run


def as_previous(src: str, steps: int) -> None:
    """Subprocess entry: time the detector of another checkout (its ``src``) on the MLP."""
    sys.path.insert(0, src)
    global dk
    import devicekit

    dk = devicekit
    torch.set_num_threads(1)
    detector(False, True)(3)
    print(detector(False, True)(steps))


def main(previous_ref: str) -> None:
    torch.set_num_threads(1)
    previous = previous_detector(previous_ref)
    rows = [
        ("plain loop", plain, STEPS, "plain"),
        ("devicekit LeakDetector, step-level (lines=False)", detector(False, True), STEPS, "plain"),
        ("devicekit LeakDetector, step-level, no cycle check", detector(False, False), STEPS, "plain"),
        ("devicekit LeakDetector, lines=True, clean loop", detector(True, True), STEPS, "plain"),
        ("plain leaky loop (list grows every step)", plain_leaky, STEPS, "leaky"),
        ("devicekit LeakDetector, lines=True, leaky loop (tracer on)", detector_leaky, STEPS, "leaky"),
        ("torch MemTracker", memtracker, SLOW_STEPS, "plain"),
        ("pytorch_memlab MemReporter.report() per step", memlab, SLOW_STEPS, "plain"),
        ("plain loop, hook registered every step (leaky)", hook_leak(False), STEPS, "hook"),
        ("devicekit LeakDetector, lines=True, hook leak (found from the memory)", hook_leak(True), STEPS, "hook"),
        ("plain CNN loop", cnn(False), CNN_STEPS, "cnn"),
        ("devicekit LeakDetector on the CNN, step-level (lines=False)", cnn(True), CNN_STEPS, "cnn"),
        ("devicekit LeakDetector on the CNN, lines=True, clean loop", cnn(True, True), CNN_STEPS, "cnn"),
    ]
    if previous is not None:
        rows.insert(2, (f"previous LeakDetector ({previous_ref}), step-level (lines=False)", previous,
                        STEPS, "plain"))
    for _, run, _, _ in rows:
        run(3)  # warm-up: imports, first Adam step
    # rounds interleave the variants so a busy machine slows them alike; the best round counts
    timings: dict[str, list[float]] = {name: [] for name, _, _, _ in rows}
    for _ in range(REPEATS):
        for name, run, steps, _ in rows:
            timings[name].append(run(steps) / steps)
    results = {name: min(values) for name, values in timings.items()}
    base = {"plain": results["plain loop"], "leaky": results["plain leaky loop (list grows every step)"],
            "hook": results["plain loop, hook registered every step (leaky)"],
            "cnn": results["plain CNN loop"]}
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, no GPU, torch {torch.__version__}, "
          f"1 torch thread; MLP 256-512-512-10, batch 64, Adam; CPU time per step, best of {REPEATS} interleaved rounds")
    print()
    print("| variant | CPU ms/step | ratio to its plain loop |")
    print("|---|---:|---:|")
    for name, _, _, kind in rows:
        print(f"| {name} | {results[name] * 1e3:.3f} | {results[name] / base[kind]:.2f}x |")
    dk_ratio = results["devicekit LeakDetector, step-level (lines=False)"] / base["plain"]
    mt_ratio = results["torch MemTracker"] / base["plain"]
    print()
    print(f"MemTracker / devicekit step-level: {mt_ratio / dk_ratio:.1f}x slower")
    print()
    print("time inside ld.step() alone (the detector's own cost; steadier than the totals above):")
    for name, values in INSIDE.items():
        cost = sorted(values)[len(values) // 2]
        print(f"  {name}: {cost * 1e3:.3f} ms/step = {cost / base['plain']:.1%} of a plain step")


def gpu_part() -> None:
    """Step-level tracking on a CUDA MLP, when there is a GPU (wall time, synchronised)."""
    print()
    if not torch.cuda.is_available():
        print("GPU part skipped: no CUDA device on this machine")
        return
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 1024, device="cuda"), torch.randn(256, 1024, device="cuda")

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def timed(with_detector: bool, steps: int = 100) -> float:
        torch.cuda.synchronize()
        began = time.perf_counter()
        if with_detector:
            with dk.LeakDetector() as ld:
                for _ in range(steps):
                    step()
                    ld.step()
        else:
            for _ in range(steps):
                step()
        torch.cuda.synchronize()
        return (time.perf_counter() - began) / steps

    timed(False, 5)
    plain_s = min(timed(False) for _ in range(3))
    dk_s = min(timed(True) for _ in range(3))
    print(f"GPU ({torch.cuda.get_device_name(0)}): plain {plain_s * 1e3:.3f} ms/step, "
          f"LeakDetector {dk_s * 1e3:.3f} ms/step, ratio {dk_s / plain_s:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--previous", default="1e453dc", help="git ref of the previous LeakDetector")
    parser.add_argument("--as-previous", metavar="SRC", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=STEPS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_previous:
        as_previous(args.as_previous, args.steps)
    else:
        main(args.previous)
        gpu_part()
