"""Sweep: the memory estimate beyond transformers' heads, against the CPU allocator's own peak.

The cases of ``zoo_beyond.py`` (diffusers UNets of every 2-D block type and VAEs from tiny
configs, PEFT LoRA, gradient checkpointing, eval loops, a DLRM-like recommender on sparse
tables, torchvision's registry where torchvision imports), batch 4 (the recommender: 256),
CPU: ``dk.estimate_memory`` against two truths of the same loop, measured on real steps:

- the allocator: torch's profiler records every allocation and free of the CPU allocator
  (``allocator_peak`` in tests/memory/memory_truth.py), whatever the tensors' layout; the
  verdict is against it;
- the live storages (``measured_peak``): what a dispatch mode sees, as the transformers sweep
  measures (it differs where watching changes the step: AccumulateGrad clones a sparse
  gradient under a mode, and steals it otherwise).

Each case is within 10 %, over by more than 10 %, under by more than 5 % (the issue's "wrong"),
refused (the reason's first words), not built (the library's own model fails on the batch), or
slow (over ``--limit`` seconds). Printed: a row per case and the tally per family.

Run: ``python benchmarks/sweep_estimate_zoo.py [--limit 120] [--only WORD] [--json FILE]``
(a few minutes on a 2-core machine; not part of ``make test``).
"""

from __future__ import annotations

import argparse
import collections
import json
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from sweep_estimate_hf import Slow, _alarm, verdict  # noqa: E402
from tests.memory.memory_truth import allocator_peak, measured_peak  # noqa: E402
from zoo_beyond import Case, cases, torchvision_unavailable  # noqa: E402

import devicekit as dk  # noqa: E402
from devicekit.memory.losses import LOSSES, cross_entropy_loss  # noqa: E402

BATCH = 4


def truth_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The estimate's keyword arguments as the truths take them (a loss name as its function)."""
    out = dict(kwargs)
    if "step" not in out and out.get("training", True):
        out["loss_fn"] = LOSSES[out["loss_fn"]] if "loss_fn" in out else cross_entropy_loss
    return out


def one(case: Case, limit: float) -> dict[str, Any]:
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(limit))
    try:
        try:
            torch.manual_seed(0)
            model, batch = case.build(), case.sample(BATCH)
        except Slow:
            raise
        except Exception as exc:
            return {"status": "not built", "why": f"{type(exc).__name__}: {str(exc)[:100]}"}
        start = time.perf_counter()
        try:
            est = dk.estimate_memory(model, batch, device="cpu", **case.kwargs)
        except Slow:
            raise
        except Exception as exc:
            return {"status": "refused", "why": f"{type(exc).__name__}: {str(exc)[:140]}"}
        seconds = time.perf_counter() - start
        try:
            allocator = allocator_peak(model, batch, **truth_kwargs(case.kwargs))
            live = measured_peak(model, batch, **truth_kwargs(case.kwargs))
        except Slow:
            raise
        except Exception as exc:
            return {"status": "not built", "why": f"truth: {type(exc).__name__}: {str(exc)[:100]}"}
        return {"status": verdict(est.peak, allocator), "error": est.peak / allocator - 1,
                "live error": est.peak / live - 1, "estimate": est.peak, "allocator": allocator,
                "live": live, "seconds": seconds, "method": est.method.split(" (")[0]}
    except Slow:
        return {"status": "slow", "why": f"over {limit:g} s"}
    finally:
        signal.alarm(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=float, default=120.0)
    parser.add_argument("--only", default="", help="only the cases whose name holds this")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for case in cases():
        if args.only and args.only not in case.name:
            continue
        how = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in case.kwargs.items()) or "default"
        result = one(case, args.limit)
        rows.append({"name": case.name, "family": case.family, "how": how, **result})
        error = (f" {result['error']:+.3f} (live {result['live error']:+.3f}, {result['seconds']:.1f} s)"
                 if "error" in result else f" {result.get('why', '')}")
        print(f"{case.family:14s} {case.name:58s} {how:26s} {result['status']}{error}", flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1, default=str))
    why = torchvision_unavailable()
    if why:
        print(f"torchvision: not swept: {why}")
    tally: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for row in rows:
        tally[row["family"]][row["status"]] += 1
    print("\n| family | cases | within 10 % | over > 10 % | under > 5 % | refused | slow | not built | error, min / max |")
    print("|---|---|---|---|---|---|---|---|---|")
    for family, counts in tally.items():
        errors = [r["error"] for r in rows if r["family"] == family and "error" in r]
        span = f"{min(errors):+.1%} / {max(errors):+.1%}" if errors else "-"
        cells = [counts[s] for s in ("within", "over", "under", "refused", "slow", "not built")]
        print(f"| {family} | {sum(counts.values())} | " + " | ".join(str(c) for c in cells) + f" | {span} |")


if __name__ == "__main__":
    main()
