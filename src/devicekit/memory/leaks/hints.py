"""What the code around a leak does, read from its source: the fix and the projection fit it.

The measurement says how a holder grows; the source says why. :func:`hints` parses the file of
the line that extended a holder (``ast``, cached per file) and reports what the enclosing
function does: ``backward(retain_graph=True)``, ``autograd.grad(create_graph=True)``, an
exception chained to the last one (``e.__cause__ = self.last_error``, ``raise ... from``), a
hook registered, ``.numpy()``, a running value (``running = 0.98 * running + 0.02 * loss``),
and the line itself. It
also finds where the holder is emptied elsewhere in its class or module
(``self.training_step_outputs.clear()`` in ``on_train_epoch_end``): a holder cleared
periodically grows like a sawtooth, bounded by the period, and is not projected as unbounded.

Usage::

    from devicekit.memory.leaks.hints import hints

    found = hints("train.py", 42, "self.training_step_outputs")
    found.flags            # frozenset({"running"}) ...
    found.cleared_at       # ("train.py", 57, "on_train_epoch_end") or None
"""

from __future__ import annotations

import ast
import os
import re
from typing import NamedTuple

__all__ = ["Hints", "hints"]

#: flag -> what in the enclosing function's source shows it
_PATTERNS = {
    "retain_graph": re.compile(r"retain_graph\s*=\s*True"),
    "create_graph": re.compile(r"create_graph\s*=\s*True"),
    "cause_chain": re.compile(r"\.__(cause|context)__\s*=|\braise\b[^\n]*\bfrom\b"),
    "hook": re.compile(r"\.register_\w*hook\s*\("),
    "numpy": re.compile(r"\.numpy\s*\("),
}
_EMPTY_CALLS = ("clear",)
_EMPTY_VALUES = ("list", "dict", "set", "deque", "OrderedDict", "defaultdict")


class Hints(NamedTuple):
    flags: frozenset[str] = frozenset()
    #: (filename, line, function) of a statement that empties the holder, if one was found
    cleared_at: tuple[str, int, str] | None = None
    #: the source line that extended the holder, stripped
    line: str = ""


_trees: dict[str, tuple[float, ast.Module, list[str]] | None] = {}


def _parse(filename: str) -> tuple[ast.Module, list[str]] | None:
    try:
        mtime = os.stat(filename).st_mtime
    except OSError:
        return None
    cached = _trees.get(filename)
    if cached is not None and cached[0] == mtime:
        return cached[1], cached[2]
    try:
        with open(filename, encoding="utf-8") as handle:
            text = handle.read()
        tree = ast.parse(text, filename)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
    _trees[filename] = (mtime, tree, text.splitlines())
    return tree, text.splitlines()


#: id of a tree -> (the tree, its nodes by kinds): a file's tree is walked once per kind of node
_nodes: dict[int, tuple[ast.AST, dict[tuple[type, ...], list[ast.AST]]]] = {}


def _nodes_of(tree: ast.AST, kinds: tuple[type, ...]) -> list[ast.AST]:
    kept = _nodes.get(id(tree))
    if kept is None or kept[0] is not tree:
        if len(_nodes) > 64:
            _nodes.clear()
        kept = _nodes[id(tree)] = (tree, {})
    found = kept[1].get(kinds)
    if found is None:
        found = kept[1][kinds] = [node for node in ast.walk(tree) if isinstance(node, kinds)]
    return found


def _enclosing(tree: ast.AST, lineno: int, kinds: tuple[type, ...]) -> ast.AST | None:
    """The innermost node of ``kinds`` whose lines contain ``lineno``."""
    best: ast.AST | None = None
    for node in _nodes_of(tree, kinds):
        if isinstance(node, kinds) and node.lineno <= lineno <= (node.end_lineno or node.lineno):
            if best is None or node.lineno >= best.lineno:
                best = node
    return best


def hints(filename: str, lineno: int, holder: str) -> Hints:
    """What the code around ``filename:lineno`` (the line that extended ``holder``) does."""
    if not filename or lineno <= 0:
        return Hints()
    parsed = _parse(filename)
    if parsed is None:
        return Hints()
    tree, lines = parsed
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    function = _enclosing(tree, lineno, functions)
    flags = set()
    if function is not None:
        body = "\n".join(lines[function.lineno - 1:function.end_lineno])
        flags = {flag for flag, pattern in _PATTERNS.items() if pattern.search(body)}
    name = _last_name(holder)
    text = lines[lineno - 1].split("#", 1)[0].strip() if lineno <= len(lines) else ""
    if name and _is_running(text, name):
        flags.add("running")
    cleared = None
    if name:
        # the holder as it is named, in the outermost function or class around the line (a
        # closure's cells live there); and, when the line is a method, `self.<name>` in its class
        # (`module.outputs` from outside is `self.outputs` in the code)
        cls = _enclosing(tree, lineno, (ast.ClassDef,))
        if cls is not None and "." in holder.split("[", 1)[0]:
            cleared = _cleared(cls, f"self.{name}", lineno, filename)
        cleared = cleared or _cleared(_outermost(tree, lineno), holder, lineno, filename)
    return Hints(frozenset(flags), cleared, text)


def _outermost(tree: ast.Module, lineno: int) -> ast.AST:
    for node in tree.body:
        if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.lineno <= lineno <= (node.end_lineno or 0)):
            return node
    return tree


def _last_name(holder: str) -> str:
    """``self.training_step_outputs`` -> ``training_step_outputs``; ``stats['x']`` -> ``stats``."""
    head = holder.split("[", 1)[0]
    name = head.rsplit(".", 1)[-1]
    return name if name.isidentifier() else ""


def _is_running(text: str, name: str) -> bool:
    """``running = 0.98 * running + 0.02 * loss``: a value rebuilt from itself (not ``+=``: a sum)."""
    target = rf"(?:\b\w+\.)?{re.escape(name)}"
    match = re.match(rf"\s*{target}\s*=(?!=)(.*)", text)
    return bool(match and re.search(rf"\b{re.escape(name)}\b", match.group(1)))


#: methods a framework calls every epoch or step (Lightning's `on_train_epoch_end`, a `reset()`)
_PERIODIC = re.compile(r"epoch|batch|step|reset|clear|flush|log", re.IGNORECASE)


def _cleared(scope: ast.AST, holder: str, lineno: int, filename: str) -> tuple[str, int, str] | None:
    """A statement that empties ``holder`` (written as the holder is named) and runs again and again: in the function that grew it (a conditional clear), in
    a loop, or, for ``self.name``, in a method called every epoch or step. Creating it (in
    ``__init__``, or once before the loop) and emptying it after the run do not count."""
    grower = _enclosing(scope, lineno, (ast.FunctionDef, ast.AsyncFunctionDef))
    for function in ast.walk(scope):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)) or function.name == "__init__":
            continue
        periodic = function is grower or (isinstance(scope, ast.ClassDef) and bool(_PERIODIC.search(function.name)))
        for node, in_loop in _statements(function):
            if getattr(node, "lineno", lineno) == lineno or not (periodic or in_loop):
                continue
            if _empties(node, holder):
                return filename, node.lineno, function.name
    return None


def _statements(function: ast.AST) -> list[tuple[ast.AST, bool]]:
    """Every node of ``function`` (not of functions inside it), and whether it is in a loop."""
    found: list[tuple[ast.AST, bool]] = []
    stack: list[tuple[ast.AST, bool]] = [(child, False) for child in ast.iter_child_nodes(function)]
    while stack:
        node, in_loop = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        found.append((node, in_loop))
        loop = in_loop or isinstance(node, (ast.For, ast.While, ast.AsyncFor))
        stack.extend((child, loop) for child in ast.iter_child_nodes(node))
    return found


def _empties(node: ast.AST, holder: str) -> bool:
    def named(target: ast.AST) -> bool:
        try:
            return ast.unparse(target) == holder
        except Exception:  # noqa: BLE001 - an odd node: not the holder
            return False

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr in _EMPTY_CALLS and named(node.func.value) and not node.args
    if isinstance(node, ast.Assign) and _is_empty(node.value):
        return any(named(t.value if isinstance(t, ast.Subscript) else t) for t in node.targets)
    if isinstance(node, ast.Delete):
        return any(isinstance(t, ast.Subscript) and named(t.value) for t in node.targets)
    return False


def _is_empty(value: ast.AST) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.Tuple)):
        return not getattr(value, "elts", getattr(value, "keys", None))
    if isinstance(value, ast.Call):
        func = value.func
        called = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return called in _EMPTY_VALUES and not value.args
    return False
