"""Sweep: the fake step's op memo changes nothing, on every transformers architecture.

For each tiny architecture of each task (``hf_tiny.py``), batch 4, the default loop and the
model's own loss: the estimate with the memo (``devicekit.memory.fake_memo``) and without it
must be the same (peak, parts, phase; or the same refusal), and every op the memo replays is
also dispatched for real and compared (shape, stride, offset, dtype, device, storage, dispatch
keys). Prints a line per architecture that differs and the tally; exit status 1 if any did.

Run: ``python benchmarks/sweep_fake_memo.py [--tasks causal-lm,masked-lm] [--limit 120]``
(about 25 minutes for all six tasks on a 2-core machine; not part of ``make test``).
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from hf_tiny import TASKS, labels_for, tiny_models  # noqa: E402

import devicekit as dk  # noqa: E402
from devicekit.memory import fake_memo  # noqa: E402
from devicekit.memory.fake_memo import OpMemo  # noqa: E402

_REPLAY = OpMemo.replay


class Slow(BaseException):  # not an Exception: the estimate's own fallbacks must not catch it
    pass


def _alarm(*_: Any) -> None:
    raise Slow()


class Checked:
    """Patches OpMemo.replay: off (always a miss) or on, each replay compared with the real op."""

    def __init__(self) -> None:
        self.on = True
        self.hits = 0
        self.wrong: collections.Counter[str] = collections.Counter()

    def replay(self, memo: OpMemo, func: Any, args: Any, kwargs: Any) -> Any:
        if not self.on:
            return OpMemo.MISS
        out = _REPLAY(memo, func, args, kwargs)
        if out is not OpMemo.MISS:
            self.hits += 1
            if not fake_memo._same(out, func(*args, **kwargs), fake_memo._tensors(args)):
                self.wrong[str(func)] += 1
        return out


def estimate(checked: Checked, on: bool, model: Any, batch: Any, **kwargs: Any) -> Any:
    checked.on = on
    try:
        est = dk.estimate_memory(model, batch, device="cpu", **kwargs)
    except Exception as exc:  # a refusal: it must be the same refusal
        return ("refused", type(exc).__name__, str(exc)[:200])
    return (est.peak, est.parts, est.peak_phase)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--limit", type=float, default=120.0, help="seconds per architecture")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    checked = Checked()
    OpMemo.replay = lambda memo, func, a, kw: checked.replay(memo, func, a, kw)  # type: ignore[method-assign]
    signal.signal(signal.SIGALRM, _alarm)
    tally: collections.Counter[str] = collections.Counter()
    for task in args.tasks.split(","):
        for _, name, build, sample in tiny_models(task):
            signal.alarm(int(args.limit))
            try:
                try:
                    torch.manual_seed(0)
                    model, batch = build(), sample(4)
                except Exception:
                    tally["not built"] += 1
                    continue

                def own(m: Any, b: Any, task: str = task) -> Any:
                    out = m(**b, labels=labels_for(task, m, b))
                    out.loss.backward()
                    return out

                for loop, kwargs in (("default", {}), ("own loss", {"step": own})):
                    checked.wrong.clear()
                    with_memo = estimate(checked, True, model, batch, **kwargs)
                    without = estimate(checked, False, model, batch, **kwargs)
                    kind = "refused" if with_memo[0] == "refused" else "estimated"
                    if with_memo == without and not checked.wrong:
                        tally[f"{loop}: {kind}, the same"] += 1
                    else:
                        tally[f"{loop}: DIFFERENT"] += 1
                        print(f"{task} {name} {loop}: with {with_memo} without {without} "
                              f"wrong replays {dict(checked.wrong)}", flush=True)
            except Slow:
                tally["slow"] += 1
            finally:
                signal.alarm(0)
    for line, count in sorted(tally.items()):
        print(f"{count:5d}  {line}")
    print(f"{checked.hits} replayed ops compared with the real dispatch")
    sys.exit(1 if any("DIFFERENT" in line for line in tally) else 0)


if __name__ == "__main__":
    main()
