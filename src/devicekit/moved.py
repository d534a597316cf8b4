"""Old import paths that keep working for one release, with a ``DeprecationWarning``.

When a module moves to another wing (``devicekit.parallel.run`` became
``devicekit.jobs.run``), the old package registers the old names here. Importing an old name
warns once and hands back the module at its new place (the same module object, so state and
``isinstance`` checks are shared). The new place is named as a string and imported only when the
old name is used, so a lower wing never imports a higher one.

Usage (in the old package's ``__init__.py``)::

    from devicekit.moved import alias_modules

    alias_modules("devicekit.parallel", {"run": "devicekit.jobs.run"})

    # user code, still working until the next release:
    from devicekit.parallel.run import RunRequest   # DeprecationWarning: ... moved to devicekit.jobs.run
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Any

__all__ = ["alias_modules", "moved_attribute", "MOVED"]

#: every old module name -> its new name (all packages together)
MOVED: dict[str, str] = {}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in the next "
                  "release)", DeprecationWarning, stacklevel=stacklevel + 1)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        _warn(spec.name, self.new, 2)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at its new place is already executed."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(new))


_FINDER = _AliasFinder()


def alias_modules(package: str, moved: dict[str, str]) -> None:
    """Make ``package.<old>`` import ``moved[old]`` (a full module name), with a warning."""
    for old, new in moved.items():
        MOVED[f"{package}.{old}"] = new
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def moved_attribute(module: str, name: str, new_module: str) -> Any:
    """``module.name`` now lives in ``new_module``: warn and return it (for a module ``__getattr__``)."""
    _warn(f"{module}.{name}", f"{new_module}.{name}", 3)
    return getattr(importlib.import_module(new_module), name)
