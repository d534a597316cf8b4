"""Sweep: the memory estimate on every transformers architecture that builds from a tiny config.

For each architecture of each task (causal LM, masked LM, seq2seq, image classification, CTC,
audio classification; see ``hf_tiny.py``), a tiny model with random weights and batch 4:

- the default estimate (nothing said: ``out = model(x)``, cross-entropy assumed) against the
  live-storage truth of that loop (tests/memory/memory_truth.py);
- the model's own loss (``step``: ``model(**batch, labels=...).loss.backward()``) against the
  truth of the same step.

Each case is one of: within 10 %, over by more than 10 %, under by more than 5 % (the issue's
"wrong"), refused (with the reason's first words; only where the loop runs for real), or not
built (the architecture does not build from a shrunk default config, its own forward fails on
the batch, or the loop fails for real too, e.g. its own loss on a text-only batch: not
devicekit's to size).
Printed: a table per task and the tally; ``--json FILE`` keeps every row. A case that takes
longer than ``--limit`` seconds is stopped and counted as "slow".

Run: ``python benchmarks/sweep_estimate_hf.py [--tasks causal-lm,masked-lm] [--limit 60]
[--skip N] [--json FILE]`` (the JSON is rewritten after every row, so a stopped sweep keeps its rows)
(the whole sweep takes tens of minutes on a 2-core machine; not part of ``make test``).
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
from hf_tiny import TASKS, labels_for, tiny_models  # noqa: E402
from tests.memory.memory_truth import measured_peak  # noqa: E402

import devicekit as dk  # noqa: E402
from devicekit.memory.losses import cross_entropy_loss  # noqa: E402

BATCH = 4
TOLERANCE, UNDER = 0.10, 0.05


class Slow(BaseException):  # not an Exception: the estimate's own fallbacks must not catch it
    pass


def _alarm(*_: Any) -> None:
    raise Slow()


def verdict(estimate: int, truth: int) -> str:
    error = estimate / truth - 1
    if error < -UNDER:
        return "under"
    return "within" if error <= TOLERANCE else "over"


def one(task: str, build: Any, sample: Any, limit: float) -> dict[str, Any]:
    row: dict[str, Any] = {}
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(int(limit))
    try:
        try:
            torch.manual_seed(0)
            model = build()
            batch = sample(BATCH)
            with torch.no_grad():
                model(**batch)
        except Slow:
            raise
        except Exception as exc:  # not devicekit's: the architecture does not build or run so
            return {"status": "not built", "why": f"{type(exc).__name__}: {str(exc)[:100]}"}
        def own_loss(m: Any, b: Any) -> Any:  # labels from its own batch: it may be resized
            out = m(**b, labels=labels_for(task, m, b))
            out.loss.backward()
            return out

        for name, kwargs, truth_kwargs in (
                ("default", {}, {"loss_fn": cross_entropy_loss}),
                ("own loss", {"step": own_loss}, {"step": own_loss})):
            start = time.perf_counter()
            try:
                est = dk.estimate_memory(model, batch, device="cpu", **kwargs)
            except Slow:
                raise
            except Exception as exc:
                row[name] = {"status": "refused", "why": f"{type(exc).__name__}: {str(exc)[:120]}"}
                try:  # a refusal is right when the loop fails for real: not devicekit's to size
                    measured_peak(model, batch, **truth_kwargs)
                except Slow:
                    raise
                except Exception as real:
                    row[name] = {"status": "not built", "why": f"fails for real too: "
                                 f"{type(real).__name__}: {str(real)[:100]}", "refusal": row[name]["why"]}
                continue
            seconds = time.perf_counter() - start
            try:
                truth = measured_peak(model, batch, **truth_kwargs)
            except Slow:
                raise
            except Exception as exc:  # the loop itself does not run (e.g. no loss for labels)
                row[name] = {"status": "not built", "why": f"truth: {type(exc).__name__}: {str(exc)[:100]}"}
                continue
            row[name] = {"status": verdict(est.peak, truth), "error": est.peak / truth - 1,
                         "seconds": seconds, "method": est.method.split(" (")[0]}
        return row
    except Slow:
        return {"status": "slow", "why": f"over {limit:g} s"}
    finally:
        signal.alarm(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=float, default=60.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip", type=int, default=0, help="skip the first N of each task")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rows = []
    for task in args.tasks.split(","):
        for index, (model_type, class_name, build, sample) in enumerate(tiny_models(task)):
            if index < args.skip:
                continue
            result = one(task, build, sample, args.limit)
            rows.append({"task": task, "model_type": model_type, "class": class_name, **result})
            cells = [f"{k}: {v['status']}" + (f" {v['error']:+.3f}" if "error" in v else "")
                     for k, v in result.items() if isinstance(v, dict)] or [result.get("status", "")]
            print(f"{task:20s} {model_type:28s} {'; '.join(cells)}", flush=True)
            if args.json:  # kept row by row: a stopped sweep keeps what it measured
                args.json.write_text(json.dumps(rows, indent=1, default=str))
    tally: collections.Counter[tuple[str, str]] = collections.Counter()
    for row in rows:
        for kind in ("default", "own loss"):
            status = row[kind]["status"] if kind in row else row.get("status", "?")
            tally[(kind, status)] += 1
    print("\n| loop | within 10 % | over > 10 % | under > 5 % | refused | slow | not built |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("default", "own loss"):
        cells = [tally[(kind, s)] for s in ("within", "over", "under", "refused", "slow", "not built")]
        sized = sum(cells[:3])
        share = f" ({cells[0] / sized:.0%} of sized)" if sized else ""
        print(f"| {kind} | {cells[0]}{share} | " + " | ".join(str(c) for c in cells[1:]) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
