"""The house stays in order: wings import only wings below them, no two files import each other,
``devicekit.hardware`` imports no torch, and the old import paths of the unreleased 0.1.0 line
are gone (no alias, no import hook)."""

from __future__ import annotations

import ast
import functools
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import devicekit

SRC = Path(devicekit.__file__).resolve().parent
#: floors from the ground up; a file may import its own floor and those below
FLOORS = [
    {"errors", "units", "teardown", "version", "code_origin"},
    {"hardware"},
    {"sharing"},
    {"selection", "placement"},
    {"memory", "measure"},
    {"parallel", "modelparallel"},
    {"jobs"},
    {"strategy"},
    {"cli", "examples", "integrations", "serve"},
]


def _floor(wing: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if wing in names)


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A source file parsed once per test process (the house tests each walk every file)."""
    return ast.parse(path.read_text())


def _imports(name: str, path: Path) -> set[str]:
    found = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: (None if path.name == "__init__.py" else -1)]
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("devicekit.")}


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports (read, never changed, by the tests below)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        if path.name == "__init__.py":  # packages re-export; their names load lazily
            continue
        targets = set()
        for imp in _imports(name, path):
            while imp and imp not in modules:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and modules[imp].name != "__init__.py":
                targets.add(imp)
        graph[name] = targets
    return graph


def _wing(module: str) -> str:
    return module.split(".")[1]


def test_every_wing_has_a_floor() -> None:
    wings = {_wing(m) for m in _modules() if m.count(".") >= 1}
    known = set().union(*FLOORS) | {"__main__"}
    assert wings <= known, f"new wing(s) {sorted(wings - known)}: give them a floor in FLOORS"


def test_no_import_runs_up_a_floor() -> None:
    up = [f"{a} imports {b}" for a, targets in _graph().items()
          if a.count(".") >= 1 and _wing(a) != "__main__"
          for b in targets if _floor(_wing(b)) > _floor(_wing(a))]
    assert not up, "imports from a lower wing to a higher one:\n" + "\n".join(sorted(up))


def test_no_wing_imports_the_front_door() -> None:
    """``from devicekit import X`` inside a wing below the front doors runs up to the top package
    (which imports every wing lazily): take X from the module that defines it."""
    front = []
    for name, path in _modules().items():
        if name == "devicekit" or _wing(name) == "__main__" or _floor(_wing(name)) == len(FLOORS) - 1:
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "devicekit":
                front.append(f"{name}: from devicekit import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name == "devicekit" for a in node.names):
                front.append(f"{name}: import devicekit")
    assert not front, "wings importing the front door:\n" + "\n".join(sorted(front))


def test_no_two_files_import_each_other() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in list(graph):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


GROUND = ("errors", "units", "teardown", "version", "code_origin")


@pytest.mark.parametrize("modules,allowed", [
    ("devicekit.hardware, devicekit.hardware.inventory, devicekit.hardware.capability, "
     "devicekit.hardware.torch_checks", ("hardware",)),
    ("devicekit.sharing, devicekit.sharing.machine_status, devicekit.sharing.status_table, "
     "devicekit.sharing.doctor_checks, devicekit.sharing.queue_turn", ("hardware", "sharing")),
    ("devicekit.selection, devicekit.selection.choose", ("hardware", "sharing", "selection")),
])
def test_status_wings_import_no_torch_and_no_wing_above(modules: str, allowed: tuple[str, ...]) -> None:
    """``status``, ``select`` and ``doctor`` start fast and work where torch is broken."""
    code = (f"import sys, {modules}\n"
            "bad = sorted(m for m in sys.modules if m == 'torch' or (m.startswith('devicekit.') and\n"
            f"    m.split('.')[1] not in {(*GROUND, *allowed)!r}))\n"
            "assert not bad, bad")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


#: the old import paths of the 0.1.0 development line; 0.1.0 was never released, so they went
#: without a deprecation cycle (CHANGELOG.md), and nothing may bring them back half-way
OLD_PATHS = (
    "devicekit.moved", "devicekit.parallel.run", "devicekit.parallel.launch",
    "devicekit.parallel.advise", "devicekit.hardware.leases", "devicekit.hardware.status",
    "devicekit.hardware.table", "devicekit.hardware.selection", "devicekit.memory.table",
    "devicekit.measure.run", "devicekit.placement.metrics", "devicekit.serve.metrics",
    "devicekit.parallel.environments", "devicekit.hardware.slurm_job",
)


@pytest.mark.parametrize("old", OLD_PATHS)
def test_old_module_paths_are_gone(old: str) -> None:
    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_import_installs_no_import_hook() -> None:
    """``import devicekit`` and its wings leave ``sys.meta_path`` as Python's own."""
    code = ("import sys; before = list(sys.meta_path)\n"
            "import devicekit, devicekit.hardware, devicekit.parallel, devicekit.memory, "
            "devicekit.measure, devicekit.placement, devicekit.serve\n"
            "added = [f for f in sys.meta_path if f not in before]\n"
            "assert not added, added")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_show_utilization_lives_in_one_place() -> None:
    import devicekit.sharing.status_table as table

    assert not hasattr(table, "show_utilization")
    from devicekit.memory.utilization import show_utilization

    assert show_utilization is devicekit.show_utilization


def test_type_checkers_see_every_public_name() -> None:
    """The ``if TYPE_CHECKING:`` block of ``devicekit/__init__.py`` imports every name of
    ``_EXPORTS`` from the module it loads from at run time, and nothing else."""
    import devicekit.errors as errors

    tree = ast.parse((SRC / "__init__.py").read_text())
    block = next(n for n in tree.body if isinstance(n, ast.If)
                 and isinstance(n.test, ast.Name) and n.test.id == "TYPE_CHECKING")
    static: dict[str, str] = {}
    for node in block.body:
        assert isinstance(node, ast.ImportFrom), ast.dump(node)
        for alias in node.names:
            if alias.name == "*":
                static.update({name: f"{node.module}:{name}" for name in errors.__all__})
            elif node.module in ("devicekit", "devicekit.parallel"):  # a module: dk.memory, dk.dist
                static[alias.name] = f"{node.module}.{alias.name}"
            else:
                static[alias.asname or alias.name] = f"{node.module}:{alias.name}"
    assert static == devicekit._EXPORTS


#: the house's file size: one concept a file (issue 46, item 6: detector.py had grown to 455)
MAX_LINES = 450


def test_no_source_file_is_over_the_house_size() -> None:
    long = {str(path.relative_to(SRC)): n for path in SRC.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines, split where a reader would: {long}"
