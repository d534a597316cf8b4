"""The suite's own budget tooling (tests/suite_budget.py): slowest modules first, what counts as
the whole suite, and the record a run leaves (issue 46, item 5)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from tests.suite_budget import (
    _ROOT,
    BUDGET_SECONDS,
    Budget,
    is_whole_suite,
    load_durations,
    module_order,
)


def test_modules_with_the_slowest_recorded_test_go_first_and_unknown_ones_keep_their_place() -> None:
    ids = ["tests/a.py::x", "tests/a.py::y", "tests/b.py::x", "tests/c.py::x", "tests/d.py::x"]
    durations = {"tests/a.py::x": 0.2, "tests/a.py::y": 0.3, "tests/c.py::x": 30.0, "tests/d.py::x": 4.0}
    # b is not recorded: it counts as 1 s, more than a's slowest (0.3 s)
    assert module_order(ids, durations) == ["tests/c.py", "tests/d.py", "tests/b.py", "tests/a.py"]
    # equal slowest: the larger total first, then as collected
    assert module_order(["tests/e.py::x", "tests/f.py::x", "tests/f.py::y"], {}) == ["tests/f.py", "tests/e.py"]


def _config(*args: str, **options: object) -> SimpleNamespace:
    option = SimpleNamespace(keyword="", markexpr="", lf=False, deselect=None)
    for name, value in options.items():
        setattr(option, name, value)
    return SimpleNamespace(args=list(args), option=option)


def test_only_a_run_of_every_test_is_the_whole_suite(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(_ROOT)
    assert is_whole_suite(_config("tests"))  # `make test`: testpaths
    assert is_whole_suite(_config(str(_ROOT)))
    assert not is_whole_suite(_config("tests/sharing"))
    assert not is_whole_suite(_config("tests/test_readme.py::test_every_dk_name_in_the_readme_exists"))
    assert not is_whole_suite(_config("tests", keyword="queue"))
    assert not is_whole_suite(_config("tests", markexpr="not slow"))


def _report(nodeid: str, when: str, seconds: float, outcome: str = "passed") -> SimpleNamespace:
    return SimpleNamespace(nodeid=nodeid, when=when, duration=seconds, outcome=outcome)


def test_a_run_lists_tests_over_budget_and_records_a_whole_run(tmp_path: Path) -> None:
    budget = Budget()
    for when, seconds in (("setup", 2.0), ("call", 3.5), ("teardown", 0.1)):
        budget.note(_report("tests/slow.py::t", when, seconds))  # type: ignore[arg-type]
    budget.note(_report("tests/quick.py::t", "call", 0.1))  # type: ignore[arg-type]
    assert [n for n, _ in budget.over()] == ["tests/slow.py::t"]  # 5.6 s in all > 5 s
    assert BUDGET_SECONDS == 5.0
    path = tmp_path / "durations.json"
    budget.record(path, workers=4)
    doc = load_durations(path)
    assert doc["suite"] is None and doc["durations"] == {"tests/quick.py::t": 0.1, "tests/slow.py::t": 5.6}
    budget.whole_suite = True
    budget.record(path, workers=4)
    suite = json.loads(path.read_text())["suite"]
    assert suite["tests"] == 2 and suite["passed"] == 2 and suite["workers"] == 4
