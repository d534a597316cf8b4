"""Every zoo case through both callbacks, with the answer ``dk.find_leaks`` gives (issue 36).

Each case of :mod:`tests.memory.leaks.owner_zoo` (the memory zoo's leak kinds, kept on the model
object, and clean look-alikes) trains in a real ``lightning.Trainer.fit`` and a real
``transformers.Trainer.train`` on the CPU with devicekit's callback. The callback's report must
name the holder (below ``self.`` / ``model.``), kind, line and severity that ``dk.find_leaks``
names on the same step in a plain loop, with the same fix, and size it within 20 % of the live
storage the framework's run really keeps per step (measured without devicekit, by
:class:`tests.memory.memory_truth.LiveStorages`: a Lightning loop's frames, kept by a traceback,
hold more than a plain loop's); clean cases report nothing, not even a note.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import devicekit as dk
from tests.integrations.leak_zoo_frameworks import (
    hf_growth,
    hf_report,
    lightning_growth,
    lightning_report,
)
from tests.memory.leaks.owner_zoo import OWNER_CLEAN, OWNER_LEAKS, plain_step
from tests.memory.leaks.test_owner_zoo import assert_named, assert_size, verdict

FRAMEWORKS = ("lightning", "hf")


def fixes(report: dk.LeakReport) -> list[str]:
    """The fixes, with the root name the framework gave the owner left out."""
    return [re.sub(r"\b(owner|self|model)\.", "", leak.fix) for leak in [*report.leaks, *report.minor]]


def run(framework: str, spec, tmp_path: Path) -> tuple[dk.LeakReport, float]:
    if framework == "lightning":
        return lightning_report(spec), lightning_growth(spec) if spec.holder else 0.0
    return hf_report(spec, tmp_path), hf_growth(spec, tmp_path) if spec.holder else 0.0


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(OWNER_LEAKS))
def test_a_callback_names_each_zoo_leak_as_find_leaks_does(framework: str, name: str, tmp_path: Path) -> None:
    spec = OWNER_LEAKS[name]
    plain = dk.find_leaks(plain_step(spec.make()))
    report, truth = run(framework, spec, tmp_path)
    assert verdict(report) == verdict(plain), f"{report}\n--- find_leaks:\n{plain}"
    assert fixes(report) == fixes(plain), f"{report}\n--- find_leaks:\n{plain}"
    assert_size(assert_named(report, spec), truth)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("name", sorted(OWNER_CLEAN))
def test_a_callback_is_silent_on_each_clean_look_alike(framework: str, name: str, tmp_path: Path) -> None:
    report, _ = run(framework, OWNER_CLEAN[name], tmp_path)
    assert report.ok and not report.leaks and not report.minor and not report.notes, str(report)
