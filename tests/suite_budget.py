"""The suite's time budget: slowest modules first, tests over budget listed, durations recorded.

Hooks that tests/conftest.py installs:

- **Slowest first.** Test modules run in the order of their slowest test as recorded in
  ``tests/durations.json`` (ties: the module's total), the way CPython's test runner and torch's
  sharding use recorded durations, so no 30-s test starts last on a worker while the others sit
  idle. Tests keep their order within a module (module fixtures are set up once per stretch); a
  module not recorded yet counts as :data:`UNKNOWN_SECONDS`. The order is the same in every
  pytest-xdist worker (xdist requires it).
- **Budget.** At the end of a run, every test whose setup + call + teardown took more than
  :data:`BUDGET_SECONDS` is listed under "over the 5 s budget", slowest first.
- **Recording.** With ``DEVICEKIT_RECORD_DURATIONS=1`` the run's durations are merged into
  ``tests/durations.json``; a run of the whole suite also records its test count and its pytest
  time, which tests/test_readme.py holds the README's figures to.

Usage::

    make test                                              # ordered, budget listed at the end
    DEVICEKIT_RECORD_DURATIONS=1 make test                 # and record (on a quiet machine)
    python tests/suite_budget.py                           # the recorded tests over budget
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import pytest

#: a test's setup + call + teardown above this many seconds is over the budget
BUDGET_SECONDS = 5.0
#: what a module without a recorded duration counts as
UNKNOWN_SECONDS = 1.0
#: where durations are recorded
DURATIONS = Path(__file__).resolve().parent / "durations.json"
RECORD_ENV = "DEVICEKIT_RECORD_DURATIONS"
_ROOT = DURATIONS.parents[1]


def load_durations(path: Path = DURATIONS) -> dict[str, Any]:
    """The recorded document: ``{"suite": {...} or None, "durations": {nodeid: seconds}}``."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"suite": None, "durations": {}}
    durations = doc.get("durations") if isinstance(doc, dict) else None
    if not isinstance(durations, dict):
        return {"suite": None, "durations": {}}
    return {"suite": doc.get("suite"), "durations": {str(k): float(v) for k, v in durations.items()}}


def module_order(nodeids: list[str], durations: dict[str, float]) -> list[str]:
    """Module paths, slowest recorded test first (then largest total; then as collected)."""
    slowest: dict[str, float] = {}
    total: dict[str, float] = {}
    first: dict[str, int] = {}
    for index, nodeid in enumerate(nodeids):
        module = nodeid.split("::")[0]
        seconds = durations.get(nodeid, UNKNOWN_SECONDS)
        slowest[module] = max(slowest.get(module, 0.0), seconds)
        total[module] = total.get(module, 0.0) + seconds
        first.setdefault(module, index)
    return sorted(first, key=lambda m: (-slowest[m], -total[m], first[m]))


def slowest_modules_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: modules by :func:`module_order`, tests within as they were."""
    durations = load_durations()["durations"]
    rank = {m: i for i, m in enumerate(module_order([i.nodeid for i in items], durations))}
    position = {id(item): index for index, item in enumerate(items)}
    items.sort(key=lambda item: (rank[item.nodeid.split("::")[0]], position[id(item)]))


class Budget:
    """Collects each test's phases (on the xdist controller too) and reports at the end."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.outcomes: dict[str, str] = {}
        self.started = time.monotonic()
        self.collected = 0
        self.whole_suite = False

    def note(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + float(report.duration)
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome

    def over(self) -> list[tuple[str, float]]:
        return sorted(((n, s) for n, s in self.seconds.items() if s > BUDGET_SECONDS), key=lambda x: -x[1])

    def summary(self, terminal: Any) -> None:
        over = self.over()
        if not over:
            return
        terminal.section(f"over the {BUDGET_SECONDS:g} s budget: {len(over)} test(s)", sep="-")
        for nodeid, seconds in over:
            terminal.line(f"{seconds:7.1f} s  {nodeid}")

    def record(self, path: Path = DURATIONS, *, workers: int | None = None) -> None:
        doc = load_durations(path)
        durations = doc["durations"]
        durations.update({n: round(s, 2) for n, s in self.seconds.items()})
        suite = doc["suite"]
        if self.whole_suite:
            counts = {o: sum(v == o for v in self.outcomes.values()) for o in ("passed", "skipped", "failed")}
            suite = {"tests": len(self.seconds), **counts,
                     "pytest_seconds": round(time.monotonic() - self.started, 1),
                     "workers": workers,
                     "cpus": os.cpu_count(), "python": platform.python_version(),
                     "recorded_at": time.strftime("%Y-%m-%d", time.gmtime())}
        text = json.dumps({"suite": suite, "durations": dict(sorted(durations.items()))}, indent=0)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(text + "\n")
        tmp.replace(path)


def is_whole_suite(config: pytest.Config) -> bool:
    """A run of every test: no paths narrower than tests/, no -k, no -m, no --lf/--deselect."""
    args = [Path(str(a).split("::")[0]).resolve() for a in config.args] or [_ROOT]
    wide = all(a in (_ROOT, _ROOT / "tests") for a in args) and all("::" not in str(a) for a in config.args)
    option = config.option
    return (wide and not getattr(option, "keyword", "") and not getattr(option, "markexpr", "")
            and not getattr(option, "lf", False) and not getattr(option, "deselect", None))


def main() -> int:
    doc = load_durations()
    over = sorted(((n, s) for n, s in doc["durations"].items() if s > BUDGET_SECONDS), key=lambda x: -x[1])
    suite = doc["suite"] or {}
    print(f"recorded: {suite.get('tests', '?')} tests, {suite.get('pytest_seconds', '?')} s of pytest "
          f"({suite.get('recorded_at', 'never')}); {len(over)} test(s) over the {BUDGET_SECONDS:g} s budget")
    for nodeid, seconds in over:
        print(f"{seconds:7.1f} s  {nodeid}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
