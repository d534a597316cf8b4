"""A zoo of leaks as users write them, and clean look-alikes: every leak named, every clean loop silent.

The cases are in :mod:`tests.memory.leaks.user_zoo_leaks` (with the model code of
:mod:`tests.memory.leaks.user_zoo_models`) and :mod:`tests.memory.leaks.user_zoo_clean`.
"""

from __future__ import annotations

import pytest

from tests.memory.leaks.user_zoo_clean import CLEAN
from tests.memory.leaks.user_zoo_leaks import LEAKS
from tests.memory.leaks.user_zoo_models import where


@pytest.mark.parametrize("case", sorted(LEAKS))
def test_leak_is_named_with_holder_and_line(case: str) -> None:
    report, holder, kind = LEAKS[case]()
    leak = report.leak(holder)
    assert leak is not None, f"{holder} not reported:\n{report}"
    if kind is not None:
        assert leak.kind == kind, str(report)
    marker = f"LEAK-{case.replace('_', '-')}"
    assert (leak.filename, leak.lineno) == where(marker), str(report)
    assert leak.bytes_per_step > 0 and leak.fix
    assert leak.severity == "leak"
    assert report.leaks[0].bytes_per_step >= leak.bytes_per_step  # ranked by rate
    assert not report.ok
    assert not [note for note in report.notes if "no holder found" in note], str(report)


@pytest.mark.parametrize("case", sorted(CLEAN))
def test_clean_look_alike_is_silent(case: str) -> None:
    report = CLEAN[case]()
    assert report.ok, str(report)
    assert not report.minor, str(report)
    assert not [note for note in report.notes if "no holder found" in note], str(report)


def test_zoo_is_big_enough() -> None:
    assert len(LEAKS) >= 20 and len(CLEAN) >= 8
