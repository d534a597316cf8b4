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
