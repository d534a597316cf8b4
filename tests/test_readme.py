"""The README stays true: every ``dk.<name>`` it shows exists, and its commands are real."""

from __future__ import annotations

import re
from pathlib import Path

import devicekit as dk
from devicekit.cli.main import COMMANDS

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_dk_name_in_the_readme_exists():
    text = README.read_text()
    names = set(re.findall(r"\bdk\.([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)", text))
    assert len(names) > 20
    missing = []
    for dotted in sorted(names):
        obj = dk
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                missing.append(dotted)
                break
    assert not missing, f"README names that devicekit lacks: {missing}"


def test_every_devicekit_subcommand_in_the_readme_exists():
    shell = "".join(re.findall(r"```bash\n(.*?)```", README.read_text(), re.S))
    commands = set(re.findall(r"devicekit (?:--simulate \S+ )?([a-z]+)", shell))
    assert {"status", "select", "run", "doctor"} <= set(COMMANDS)
    assert commands and commands <= set(COMMANDS)


def test_setup_commands_are_make_targets():
    makefile = (README.parent / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make test" in (README.parent / ".ci" / "run").read_text()


def test_readme_says_how_to_reach_the_installed_command():
    text = README.read_text()
    assert ".venv/bin/devicekit" in text and "source .venv/bin/activate" in text


def test_make_run_installs_only_the_package_and_make_test_the_dev_tools():
    makefile = (README.parent / "Makefile").read_text()
    rules = dict(re.findall(r"^(\S+):[^\n]*\n((?:\t[^\n]*\n)+)", makefile, re.M))
    package = rules["$(BIN)/devicekit"]
    assert "-e ." in package and "[dev]" not in package
    assert re.search(r"^run: \$\(BIN\)/devicekit$", makefile, re.M)
    assert re.search(r"^test: \$\(VENV\)/\.dev$", makefile, re.M)
    assert re.search(r"'\.\[dev(,\w+)*\]'", rules["$(VENV)/.dev"])  # the test tools, and the framework extras


def _readme_figures() -> tuple[int, float]:
    """(the test count, the minutes of pytest) the README states for `make test`."""
    text = " ".join(README.read_text().split())
    count = re.search(r"the whole suite \(about ([\d,]+) tests\)", text)
    minutes = re.search(r"about ([\d.]+) minutes of pytest on a 2-core machine", text)
    assert count and minutes, "the README no longer states the suite's size and time"
    return int(count.group(1).replace(",", "")), float(minutes.group(1))


def test_the_readmes_suite_figures_match_the_last_recorded_whole_run():
    """Issue 46, item 4: "about 2,050 tests" stayed while the suite grew to 2,230."""
    from tests.suite_budget import load_durations

    suite = load_durations()["suite"]
    if not suite:
        import pytest

        pytest.skip("no whole-suite run recorded: DEVICEKIT_RECORD_DURATIONS=1 make test")
    count, minutes = _readme_figures()
    assert abs(count - suite["tests"]) <= 0.05 * suite["tests"], (
        f"README says about {count:,} tests; the last whole run had {suite['tests']:,}")
    recorded = suite["pytest_seconds"] / 60
    assert abs(minutes - recorded) <= max(0.1 * recorded, 0.25), (
        f"README says about {minutes:g} minutes; the last whole run took {recorded:.1f}")


def test_the_readmes_test_count_matches_this_run_when_it_is_the_whole_suite(request):
    from tests.suite_budget import is_whole_suite

    if not is_whole_suite(request.config):
        import pytest

        pytest.skip("only a run of the whole suite knows its test count")
    count, _ = _readme_figures()
    collected = len(request.session.items)
    assert abs(count - collected) <= 0.05 * collected, (
        f"README says about {count:,} tests; this run collected {collected:,}")
