"""The reference docs cannot drift from the program: every option of every command and every
``DEVICEKIT_*`` variable the code reads is documented, and nothing documented is gone.

- each command has one options table in docs/, marked ``<!-- options: COMMAND -->``; its first
  column names exactly the options ``devicekit COMMAND --help`` lists (``--gpu_ids`` spellings
  count as ``--gpu-ids``);
- docs/environment.md has one row per ``DEVICEKIT_*`` name that appears as a string in src/.
- docs/architecture.md names every wing (every package under src/devicekit).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import click
import pytest

import devicekit
from devicekit.cli.main import COMMANDS, cli

ROOT = Path(__file__).resolve().parents[1]
SRC = Path(devicekit.__file__).resolve().parent
DOCS = sorted((ROOT / "docs").rglob("*.md"))
MARKED = re.compile(r"<!-- options: ([\w ]+) -->\n((?:\|.*\n)+)")
OPTION = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def _commands() -> dict[str, click.Command]:
    found: dict[str, click.Command] = {"devicekit": cli}
    for name in COMMANDS:
        command = cli.get_command(click.Context(cli), name)
        assert command is not None
        found[name] = command
        for sub, subcommand in getattr(command, "commands", {}).items():
            found[f"{name} {sub}"] = subcommand
    return found


def _options(command: click.Command) -> set[str]:
    names = {opt for p in command.params if isinstance(p, click.Option) and not p.hidden
             for opt in (*p.opts, *p.secondary_opts)}
    return {n.replace("_", "-") for n in names} - {"-h", "--help"}


def _tables() -> dict[str, list[tuple[str, str]]]:
    """command -> [(page, table)] for every marked options table."""
    tables: dict[str, list[tuple[str, str]]] = {}
    for page in DOCS:
        for m in MARKED.finditer(page.read_text()):
            tables.setdefault(m.group(1).strip(), []).append((page.name, m.group(2)))
    return tables


def _documented(table: str) -> set[str]:
    firsts = [line.replace("\\|", "/").split("|")[1]  # past the header and its rule
              for line in table.splitlines()[2:]]
    return {o.replace("_", "-") for cell in firsts for o in OPTION.findall(cell)} - {"-h", "--help"}


@pytest.mark.parametrize("name", sorted(_commands()))
def test_every_option_of_every_command_is_in_its_table(name: str) -> None:
    tables = _tables().get(name, [])
    assert len(tables) == 1, f"devicekit {name}: {len(tables)} tables marked " \
                             f"'<!-- options: {name} -->' in docs/ (want one)"
    page, table = tables[0]
    options, documented = _options(_commands()[name]), _documented(table)
    assert options <= documented, f"{page}: devicekit {name}: not documented: " \
                                  f"{sorted(options - documented)}"
    assert documented <= options, f"{page}: devicekit {name} has no " \
                                  f"{sorted(documented - options)}"


def test_no_table_is_marked_for_a_command_that_does_not_exist() -> None:
    assert set(_tables()) <= set(_commands())


def _variables_in_src() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"DEVICEKIT_[A-Z0-9_]+", node.value):
                found.add(node.value)
    return found


def test_every_environment_variable_is_documented() -> None:
    text = (ROOT / "docs" / "environment.md").read_text()
    documented = set(re.findall(r"^\| `(DEVICEKIT_[A-Z0-9_]+)`", text, re.M))
    in_src = _variables_in_src()
    assert "DEVICEKIT_BENCH_CACHE" in in_src and "DEVICEKIT_SIMULATE" in in_src  # the scan works
    assert in_src <= documented, f"docs/environment.md lacks {sorted(in_src - documented)}"
    assert documented <= in_src, f"docs/environment.md names {sorted(documented - in_src)}, " \
                                 "which nothing reads"


def test_the_architecture_page_names_every_wing() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    wings = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    assert len(wings) >= 14
    missing = [w for w in wings if not re.search(rf"`{w}/?`", text)]
    assert not missing, f"docs/architecture.md does not name {missing}"
    from tests.test_house import FLOORS

    for floor in FLOORS:  # the nine floors, each wing on its floor's line
        line = next((line for line in text.splitlines()
                     if line.startswith("|") and all(f"`{w}" in line for w in floor)), None)
        assert line is not None, f"docs/architecture.md has no floor line for {sorted(floor)}"
