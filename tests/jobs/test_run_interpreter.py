"""``devicekit run -- python train.py`` says so when ``python`` on PATH is not devicekit's own
interpreter (a virtual environment not activated: the script would fail on ``import torch``),
and still runs the ``python`` the user asked for. Checked with ``--dry-run``: nothing starts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from devicekit.cli.main import main


def dry_run(capsys: pytest.CaptureFixture[str], *command: str) -> tuple[list[str], list[str]]:
    """(stdout lines, stderr lines) of ``devicekit run --dry-run -- COMMAND``."""
    with pytest.raises(SystemExit) as done:
        main(["run", "--dry-run", "--", *command])
    out, err = capsys.readouterr()
    assert done.value.code in (0, None), err
    return out.splitlines(), err.splitlines()


def warnings_in(err: list[str]) -> list[str]:
    return [line for line in err if line.startswith("devicekit run: warning:")]


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """A folder holding a ``python`` and a ``python3`` that are not devicekit's interpreter."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name in ("python", "python3"):
        script = folder / name
        script.write_text("#!/bin/sh\necho 'not the venv'\n")
        script.chmod(0o755)
    return folder


@pytest.mark.parametrize("name", ["python", "python3"])
def test_python_elsewhere_on_path_is_one_warning_naming_both(
        name: str, fake_python: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(fake_python))
    out, err = dry_run(capsys, name, "train.py", "--lr", "3")
    (line,) = warnings_in(err)
    assert f"'{name}' here is {fake_python / name}" in line
    assert f"not devicekit's {sys.executable}" in line
    assert "devicekit run -- train.py ..." in line  # the fix: the script alone
    assert out[-1] == f"{name} train.py --lr 3"  # still what the user asked for


def test_python_missing_from_path_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no python at all
    _, err = dry_run(capsys, "python", "train.py")
    (line,) = warnings_in(err)
    assert "'python' is not on PATH at all" in line and sys.executable in line


def test_missing_python_is_refused_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Without --dry-run a missing command stops before leasing (exit 127), saying what to do."""
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit) as done:
        main(["run", "--", "python3.11", "train.py"])
    err = capsys.readouterr().err
    assert done.value.code == 127
    assert "cannot start 'python3.11': command not found on PATH" in err
    assert "devicekit run -- train.py" in err and len(err.strip().splitlines()) == 1


def test_no_warning_when_python_is_devicekits_own(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    folder = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", folder + os.pathsep + os.environ.get("PATH", ""))
    name = next(n for n in ("python", "python3") if os.path.exists(os.path.join(folder, n)))
    _, err = dry_run(capsys, name, "train.py")
    assert warnings_in(err) == []


def test_no_warning_for_a_script_alone_or_another_program(
        fake_python: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", str(fake_python))
    out, err = dry_run(capsys, "train.py")
    assert warnings_in(err) == [] and out[-1].startswith(f"{sys.executable} -u train.py")
    _, err = dry_run(capsys, "pythonista")
    assert warnings_in(err) == []


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="needs devicekit in a venv")
def test_link_to_the_venv_python_is_not_the_venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Same real file as sys.executable, but Python finds no pyvenv.cfg beside the link, so it
    starts the base interpreter without the venv's packages: a real path alone cannot tell."""
    (tmp_path / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", str(tmp_path))
    _, err = dry_run(capsys, "python", "train.py")
    (line,) = warnings_in(err)
    assert f"'python' here is {tmp_path / 'python'}" in line
