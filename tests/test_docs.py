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


#: how a page defines a file: a block marked <!-- file: NAME -->, or a shell redirection into it
_DEFINES = re.compile(r"(?:cat\s*>|>)\s*(\S+?)(?:\s|$|<<)")
_SIMULATE = re.compile(r"(?:--simulate[ =]|DEVICEKIT_SIMULATE=)(\S+)")


def _simulate_uses() -> list[tuple[str, str, set[str]]]:
    """(page, file named after --simulate, the files the page defines) for every use."""
    out = []
    for page in PAGES:
        text = page.read_text()
        defined = set()
        uses = []
        for m in BLOCK.finditer(text):
            marker, kind, body = m.group(1) or "", m.group(2), m.group(3)
            if marker.startswith("file: "):
                defined.add(marker[len("file: "):])
            if kind in ("bash", "console", "sh"):
                defined.update(Path(name.strip("'\"")).name for name in _DEFINES.findall(body))
                uses += [u.strip("'\"") for u in _SIMULATE.findall(body)]
        out += [(page.relative_to(ROOT).as_posix(), use, defined) for use in uses
                if not use.startswith(("$", "PATH", "FILE"))]
    return out


@pytest.mark.parametrize("page,name,defined", _simulate_uses())
def test_every_simulate_example_names_a_file_the_page_defines(page, name, defined):
    """Issue 46, item 4: cli.md's `--simulate cluster.json` named a file no page defined."""
    assert Path(name).name in defined, f"{page}: --simulate {name}: the page never defines {name}"


def _status_samples() -> list[tuple[str, str, str]]:
    """(page, sample, the simulation file's text) for `devicekit --simulate F status` samples."""
    out = []
    for page in PAGES:
        text = page.read_text()
        files = {m.group(1)[len("file: "):]: m.group(3) for m in BLOCK.finditer(text)
                 if m.group(1) and m.group(1).startswith("file: ")}
        for m in BLOCK.finditer(text):
            body = m.group(3)
            first = body.splitlines()[0] if body.strip() else ""
            found = re.fullmatch(r"\$ devicekit --simulate (\S+) status", first)
            if m.group(2) == "console" and found and found.group(1) in files:
                out.append((page.relative_to(ROOT).as_posix(), body, files[found.group(1)]))
    return out


def _gpu_rows(text: str) -> list[str]:
    """The GPU table up to its Lease column (leases are the jobs', not the file's), then the
    Processes table."""
    lines = text.rstrip("\n").splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("GPU  Name"))
    cut = lines[header].index("Lease")
    end = next(i for i, line in enumerate(lines) if line.startswith(("Processes", "Leases")))
    rows = [line[:cut].rstrip() for line in lines[header:end]]
    if lines[end] == "Processes":
        stop = next((i for i in range(end + 1, len(lines)) if lines[i] == "Leases"), len(lines))
        rows += [line.rstrip() for line in lines[end:stop]]
    return rows


@pytest.mark.parametrize("page,sample,simulation", _status_samples())
def test_a_status_sample_is_what_its_pages_simulation_file_prints(page, sample, simulation, tmp_path):
    """The table cli.md printed matched neither its page's JSON nor choosing-gpus.md's."""
    path = tmp_path / "gpus.json"
    path.write_text(simulation)
    env = {**os.environ, "PYTHONPATH": SRC, "DEVICEKIT_LEASE_DIR": str(tmp_path / "leases"),
           "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "devicekit", "--simulate", str(path), "status"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert _gpu_rows(done.stdout) == _gpu_rows(sample.split("\n", 1)[1]), f"{page}: the sample's table differs"
