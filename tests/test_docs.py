"""Every code block in README.md and docs/ runs as shown or is checked.

- ``python`` blocks compile (they are fragments that name the reader's own model and data);
  docs/sizes.md's blocks run as they are.
- every ``devicekit`` command in ``bash`` / ``console`` blocks parses: the subcommand and its
  flags exist and their values pass click's checks.
- ``console`` blocks marked ``<!-- checked -->`` are run, with the files the page defines in
  blocks marked ``<!-- file: NAME -->``, and their output must match the sample line for line.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest

import devicekit as dk
from devicekit.cli.main import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SRC = str(Path(dk.__file__).parents[1])
BLOCK = re.compile(r"(?:<!-- (checked|file: [^ ]+)[^>]*-->\n)?```(\w*)\n(.*?)```", re.S)


def blocks(kind: str) -> list[tuple[str, str, str]]:
    """(page, marker, body) for every block of ``kind`` on every page."""
    return [(page.relative_to(ROOT).as_posix(), m.group(1) or "", m.group(3))
            for page in PAGES for m in BLOCK.finditer(page.read_text()) if m.group(2) == kind]


@pytest.mark.parametrize("page,marker,body", blocks("python"))
def test_python_blocks_compile(page, marker, body):
    code = compile(body, page, "exec")
    if page == "docs/sizes.md":
        exec(code, {})


def _devicekit_commands() -> list[tuple[str, list[str]]]:
    found = []
    for kind in ("bash", "console"):
        for page, _, body in blocks(kind):
            for line in body.splitlines():
                if kind == "console" and not line.startswith("$ "):
                    continue  # the program's output, not a command
                line = line.removeprefix("$ ")
                for m in re.finditer(r"(?:^|[\s(])devicekit((?: [^|&)#;]*)?)", line):
                    words = shlex.split(m.group(1).split(" -- ")[0])
                    # a shell redirection ends the command's own words: `devicekit bench > b.json`
                    cut = next((i for i, w in enumerate(words) if w[:1] in "<>" or w[:2] == "2>"), None)
                    words = words[:cut]
                    if words and not words[0].startswith("$"):
                        found.append((page, words))
    return found


@pytest.mark.parametrize("page,words", _devicekit_commands())
def test_every_devicekit_command_shown_parses(page, words):
    args = list(words)
    if args[:1] == ["--simulate"]:
        args = args[2:]
    name, rest = args[0], args[1:]
    command = cli.get_command(click.Context(cli), name)
    assert command is not None, f"{page}: no subcommand {name!r}"
    try:
        command.make_context(name, rest)
    except click.exceptions.Exit:
        pass  # --help
    except click.ClickException as exc:
        pytest.fail(f"{page}: devicekit {shlex.join(words)}: {exc.format_message()}")


def _checked_samples() -> list[tuple[str, str, dict[str, str]]]:
    out = []
    for page in PAGES:
        text = page.read_text()
        files = {m.group(1)[len("file: "):]: m.group(3) for m in BLOCK.finditer(text)
                 if m.group(1) and m.group(1).startswith("file: ")}
        out += [(page.relative_to(ROOT).as_posix(), m.group(3), files)
                for m in BLOCK.finditer(text) if m.group(1) == "checked"]
    return out


@pytest.mark.parametrize("page,body,files", _checked_samples())
def test_checked_console_samples_match_the_program(page, body, files, tmp_path, monkeypatch):
    import torch

    if "CPU-only build" in body and torch.version.cuda is not None:
        pytest.skip("the sample shows doctor on a CPU-only torch; this one is built for CUDA")
    work = tmp_path / "me"
    work.mkdir()
    for name, content in files.items():
        (work / name).write_text(content)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "devicekit").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m devicekit "$@"\n')
    (bin_dir / "devicekit").chmod(0o755)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # `$ python x.py`
    (bin_dir / "python").chmod(0o755)
    lines = body.rstrip("\n").splitlines()
    command, expected = lines[0].removeprefix("$ "), lines[1:]
    leases = tmp_path / "leases"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": SRC,
           "DEVICEKIT_LEASE_DIR": str(leases), "COLUMNS": "200"}
    done = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True,
                          text=True, timeout=60)
    got = (done.stdout + done.stderr).replace(str(work), "/home/me")
    got = got.replace(str(leases), "/tmp/devicekit-leases").replace(torch.__version__, "2.13.0+cpu")
    assert got.rstrip("\n").splitlines() == expected, f"{page}: sample differs from the program"
