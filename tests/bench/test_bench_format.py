"""``devicekit bench``'s logging rows (``.item()`` per step vs ``dk.MetricLog``): the two times
shown and the speed-up beside them come from the same round, so they cannot disagree. Made-up
round times, no timing."""

from __future__ import annotations

import re
from io import StringIO

import pytest

from devicekit.measure.bench_runner import logging_figures
from devicekit.measure.bench_table import render_report
from devicekit.measure.exercises import median_round
from devicekit.measure.report import BenchReport, DeviceBench

#: rounds where each side's median says MetricLog is faster (1.30 s vs 1.25 s) while most
#: rounds say it is slower (0.96x): the contradiction the old rows printed
ITEM = [1.30, 1.20, 1.25, 2.00, 2.10]
LOG = [1.35, 1.25, 1.30, 0.30, 0.20]


def rendered(item: list[float], log: list[float]) -> str:
    figures, note = logging_figures(median_round(item, log), steps=100)
    entry = DeviceBench("cpu", "test CPU", figures=figures, notes=[note] if note else [])
    out = StringIO()
    render_report(BenchReport([entry]), out)
    return out.getvalue()


def shown(text: str, label: str) -> float:
    line = next(line for line in text.splitlines() if label in line)
    return float(re.findall(r"(\d+(?:\.\d+)?) ?(?:ms|x)\s*$", line)[0])


@pytest.mark.parametrize(("item", "log"), [
    (ITEM, LOG),
    ([ITEM[0], 1.0], [LOG[0], 1.1]),  # an even number of rounds: the lower median round
    ([0.0241, 0.0300, 0.0260], [0.0204, 0.0310, 0.0230]),
    ([0.050], [0.050]),
])
def test_times_shown_agree_with_the_speedup_shown(item: list[float], log: list[float]) -> None:
    text = rendered(item, log)
    item_ms = shown(text, ".item() each (the median round)")
    log_ms = shown(text, "dk.MetricLog (the same round)")
    speedup = shown(text, "MetricLog speedup (median of")
    assert item_ms / log_ms == pytest.approx(speedup, abs=0.01 + 0.1 / log_ms)  # rounding only
    if speedup > 1:
        assert item_ms >= log_ms
    elif speedup < 1:
        assert item_ms <= log_ms


def test_the_contradicting_rounds_show_one_verdict() -> None:
    text = rendered(ITEM, LOG)
    assert shown(text, "MetricLog speedup (median of") == 0.96  # most rounds
    assert shown(text, ".item() each") < shown(text, "dk.MetricLog")  # so .item() was faster
    assert "median of 5 rounds" in text and "noisy" in text  # spread 10x


def test_median_round_is_one_real_round() -> None:
    result = median_round(ITEM, LOG)
    assert (result["item_per_step"], result["metric_log"]) in set(zip(ITEM, LOG, strict=True))
    assert result["speedup"] == result["item_per_step"] / result["metric_log"]
    assert result["rounds"] == 5 and result["spread"] == pytest.approx((2.1 / 0.2) / (1.2 / 1.25))
