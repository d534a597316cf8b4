"""The house stays in order: wings import only wings below them, no two files import each other,
``devicekit.hardware`` imports no torch, and every old import path still works, with a warning."""

from __future__ import annotations

import ast
import functools
import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import devicekit

SRC = Path(devicekit.__file__).resolve().parent
#: floors from the ground up; a file may import its own floor and those below
FLOORS = [
    {"errors", "units", "moved", "teardown", "version", "code_origin"},
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


GROUND = ("errors", "units", "moved", "teardown", "version", "code_origin")


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


OLD_PATHS = {
    "devicekit.parallel.run": "devicekit.jobs.run",
    "devicekit.parallel.run_world": "devicekit.jobs.run_world",
    "devicekit.parallel.supervise": "devicekit.jobs.supervise",
    "devicekit.parallel.launch": "devicekit.jobs.launch",
    "devicekit.parallel.outer": "devicekit.jobs.outer",
    "devicekit.parallel.rank_process": "devicekit.jobs.rank_process",
    "devicekit.parallel.torchrun_entry": "devicekit.jobs.torchrun_entry",
    "devicekit.parallel.allocation": "devicekit.jobs.allocation",
    "devicekit.parallel.threads": "devicekit.jobs.threads",
    "devicekit.parallel.advise": "devicekit.strategy.advise",
    "devicekit.parallel.equivalence": "devicekit.strategy.equivalence",
    # the sharing wing split off hardware; names that meant two things renamed
    **{f"devicekit.hardware.{name}": f"devicekit.sharing.{name}" for name in (
        "lease_directory", "device_locks", "live_holder", "lease_records", "leases",
        "lock_squatting", "stopped_jobs", "tickets", "queue_order", "queue_state", "queue_turn",
        "policy", "fair_share")},
    "devicekit.hardware.status": "devicekit.sharing.machine_status",
    "devicekit.hardware.table": "devicekit.sharing.status_table",
    "devicekit.hardware.checks": "devicekit.sharing.doctor_checks",
    "devicekit.hardware.check": "devicekit.hardware.check_result",
    "devicekit.hardware.selection": "devicekit.selection",
    "devicekit.hardware.waiting": "devicekit.selection.waiting",
    "devicekit.hardware.exclude": "devicekit.selection.exclude",
    "devicekit.memory.table": "devicekit.memory.usage_table",
    "devicekit.measure.run": "devicekit.measure.bench_runner",
    "devicekit.measure.table": "devicekit.measure.bench_table",
    "devicekit.placement.metrics": "devicekit.placement.metric_log",
    "devicekit.serve.metrics": "devicekit.serve.prometheus",
}


def test_old_hardware_selection_still_gives_select_gpus() -> None:
    sys.modules.pop("devicekit.hardware.selection", None)
    with pytest.warns(DeprecationWarning):
        from devicekit.hardware.selection import Selection, select_gpus
    assert select_gpus is devicekit.select_gpus and Selection is devicekit.Selection


@pytest.mark.parametrize("old,new", sorted(OLD_PATHS.items()))
def test_old_module_paths_work_with_a_deprecation_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)  # one module: same state, same classes


def test_old_from_import_of_a_name_works() -> None:
    sys.modules.pop("devicekit.parallel.run", None)
    with pytest.warns(DeprecationWarning):
        from devicekit.parallel.run import RunRequest
    from devicekit.jobs.request import RunRequest as New

    assert RunRequest is New


def test_show_utilization_old_place_warns_and_works() -> None:
    import devicekit.sharing.status_table as table

    with pytest.warns(DeprecationWarning, match="devicekit.memory.utilization"):
        fn = table.show_utilization
    assert fn is devicekit.show_utilization


def test_new_paths_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        for new in OLD_PATHS.values():
            importlib.import_module(new)
        importlib.import_module("devicekit.memory.utilization")


#: the house's file size: one concept a file (issue 46, item 6: detector.py had grown to 455)
MAX_LINES = 450


def test_no_source_file_is_over_the_house_size() -> None:
    long = {str(path.relative_to(SRC)): n for path in SRC.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines, split where a reader would: {long}"
