"""Status lines on stderr for what a person or a log waits on (issue 46, item 3): ``estimate``,
``advise``, ``bench`` and ``doctor`` say what runs once a phase has lasted a while, and say
nothing for an answer that comes at once. Thresholds are made short here; no timing is asserted
beyond "a phase that sleeps over ten times the threshold was shown"."""

from __future__ import annotations

import io
import json
import re
import time
from pathlib import Path

import pytest

from devicekit.cli.main import main
from devicekit.cli.phases import AFTER_ENV, PhaseStatus
from tests.conftest import h100

EXAMPLES = str(Path(__file__).resolve().parents[2] / "docs" / "examples")


def lines_of(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_phase_that_lasts_is_one_plain_line_and_a_quick_one_is_silent() -> None:
    stream = io.StringIO()
    with PhaseStatus("estimate", stream=stream, after=0.05, every=60) as status:
        status.phase("quick")
        status.phase("building the model")
        time.sleep(0.5)
    assert lines_of(stream) == ["devicekit estimate: building the model"]
    stream = io.StringIO()
    with PhaseStatus("estimate", stream=stream, after=30) as status:
        status.phase("importing torch")
    assert stream.getvalue() == ""  # answered within the threshold: nothing said


def test_a_long_phase_is_repeated_with_its_age_and_a_new_phase_gets_its_own_line() -> None:
    stream = io.StringIO()
    with PhaseStatus("bench", stream=stream, after=0.05, every=0.3) as status:
        status.phase("matmul")
        time.sleep(1.3)
        status.phase("copy")
        time.sleep(0.4)
    lines = lines_of(stream)
    assert lines[0] == "devicekit bench: matmul"
    assert any(re.fullmatch(r"devicekit bench: matmul \(\d s so far\)", line) for line in lines[1:]), lines
    switch = lines.index("devicekit bench: copy")  # the new phase's own line, then its repeats
    assert all(line.startswith("devicekit bench: copy") for line in lines[switch:]), lines


def test_a_terminal_gets_a_spinner_line_that_goes_away() -> None:
    stream = io.StringIO()
    with PhaseStatus("advise", stream=stream, after=0.05, terminal=True) as status:
        status.phase("ranking strategies")
        time.sleep(0.5)
    shown = stream.getvalue()
    assert "advise: ranking strategies" in shown and "\x1b[" in shown  # drawn, then erased


def test_estimate_names_the_slow_phase_on_stderr_and_keeps_stdout_clean(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from devicekit.cli import model_factory

    real = model_factory.load_factory

    def slow_build(spec: str) -> object:
        time.sleep(0.6)
        return real(spec)

    monkeypatch.setattr(model_factory, "load_factory", slow_build)
    monkeypatch.setenv(AFTER_ENV, "0.05")
    monkeypatch.chdir(EXAMPLES)
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "fit_models:small_mlp", "--input", "1024", "--json"])
    out, err = capsys.readouterr()
    assert exit_info.value.code in (0, None)
    assert "devicekit estimate: building the model (fit_models:small_mlp)" in err.splitlines()
    assert json.loads(out)["peak"] > 0  # stdout is the answer alone


def test_advise_names_the_slow_phase(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                     simulate) -> None:  # type: ignore[no-untyped-def]
    from devicekit.strategy import advise as advise_module

    simulate([h100()])
    real = advise_module.advise

    def slow_advise(*args: object, **kwargs: object) -> object:
        time.sleep(0.6)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(advise_module, "advise", slow_advise)
    monkeypatch.setenv(AFTER_ENV, "0.05")
    monkeypatch.chdir(EXAMPLES)
    with pytest.raises(SystemExit):
        main(["advise", "fit_models:small_mlp", "--input", "1024"])
    err = capsys.readouterr().err
    assert "devicekit advise: estimating the step and ranking strategies for these GPUs" in err.splitlines()


def test_doctor_says_it_is_still_checking_on_stderr(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch, simulate) -> None:  # type: ignore[no-untyped-def]
    from devicekit.sharing import doctor_checks

    simulate([h100()])
    real = doctor_checks.check_lease_dir

    def slow_lease_dir():  # type: ignore[no-untyped-def]
        time.sleep(0.6)
        return real()

    monkeypatch.setattr(doctor_checks, "check_lease_dir", slow_lease_dir)
    monkeypatch.setenv(AFTER_ENV, "0.05")
    for args in ([], ["--json"]):
        with pytest.raises(SystemExit):
            main(["doctor", "--no-torch", *args])
        out, err = capsys.readouterr()
        assert any(line.startswith("devicekit doctor: running checks") for line in err.splitlines()), err
        assert "devicekit doctor:" not in out
