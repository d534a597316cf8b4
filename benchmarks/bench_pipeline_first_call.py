"""What a pipeline's first training call costs, against the unsplit model's first call.

Run: ``.venv/bin/python benchmarks/bench_pipeline_first_call.py [ROUNDS]`` (about a minute on
2 cores; each measurement is a fresh process, since only a process's first call pays).

In a fresh process: build a 3-layer MLP, then time its first training step (forward, backward)
three ways, in turns so machine load hits all alike (one intra-op thread each, as in
``bench_pipeline.py``):

* ``unsplit``: the model itself (the anchor: what a user pays without devicekit);
* ``devicekit``: ``dk.Pipeline(model, ["cpu", "cpu"], chunks=4)``: stage threads start,
  micro-batches are checkpointed (``checkpoint="except_last"``) and recomputed on backward;
* ``torch checkpoint``: the same pipeline step with ``torch.utils.checkpoint`` (what devicekit
  used before): its first call imports ``torch._dynamo``.

Printed: per method the best and median first-call seconds over ROUNDS fresh processes, the
ratio to the unsplit first call, and a warm (later) call for scale.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time
import torch
from torch import nn
import devicekit as dk
method = sys.argv[1]
torch.set_num_threads(1)  # as bench_pipeline.py: intra-op threads would fight the loaded cores
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
x = torch.randn(32, 64)
if method != "unsplit":
    if method == "torch checkpoint":
        import torch.utils.checkpoint
        import devicekit.modelparallel.recompute as recompute
        recompute._recomputed_on_backward = lambda fn, x: torch.utils.checkpoint.checkpoint(
            fn, x, use_reentrant=False, preserve_rng_state=True)
    model = dk.Pipeline(model, ["cpu", "cpu"], chunks=4)
def step():
    start = time.perf_counter()
    model(x).sum().backward()
    return time.perf_counter() - start
first = step()
warm = min(step() for _ in range(5))
print(json.dumps({"first": first, "warm": warm}))
'''

METHODS = ["unsplit", "devicekit", "torch checkpoint"]


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    firsts: dict[str, list[float]] = {m: [] for m in METHODS}
    warms: dict[str, list[float]] = {m: [] for m in METHODS}
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for _ in range(rounds):
        for method in METHODS:
            out = subprocess.run([sys.executable, "-c", CHILD, method], capture_output=True, text=True,
                                 env=env, timeout=300, check=True).stdout
            found = json.loads(out.strip().splitlines()[-1])
            firsts[method].append(found["first"])
            warms[method].append(found["warm"])
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {rounds} fresh processes each")
    anchor = statistics.median(firsts["unsplit"])
    print(f"{'method':18} {'first best':>11} {'first median':>13} {'x unsplit':>10} {'warm call':>10}")
    for method in METHODS:
        median = statistics.median(firsts[method])
        print(f"{method:18} {min(firsts[method]) * 1e3:9.1f}ms {median * 1e3:11.1f}ms "
              f"{median / anchor:9.1f}x {min(warms[method]) * 1e3:8.2f}ms")


if __name__ == "__main__":
    main()
