"""Whose code a file is: devicekit's, torch's, the standard library's, or the user's.

Reports that name "the user's line" (the hang doctor's "rank 1 is at train.py:41", the line
a collective was called from) skip the frames of devicekit, torch and the standard library.
They are recognised by where those are installed (the package directories, ``sysconfig``'s
standard-library paths), never by a folder name in the path: a user's own project in a folder
named ``devicekit`` or ``torch`` (the name ``git clone`` gives a checkout) is the user's code.
Standard library only, and torch is found without being imported.

Usage::

    from devicekit.code_origin import library_of

    library_of(torch.distributed.__file__)   # 'torch'
    library_of(threading.__file__)           # 'stdlib'
    library_of("/home/me/devicekit/train.py")  # None: the user's own file
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sysconfig

__all__ = ["library_of"]

_DEVICEKIT = os.path.dirname(os.path.realpath(__file__))
#: the bundled example job (what ``devicekit run`` runs by default) is a user's script
_EXAMPLES = os.path.join(_DEVICEKIT, "examples")


@functools.lru_cache(maxsize=1)
def _torch_dirs() -> tuple[str, ...]:
    """torch's package directories, from its import spec (torch itself is not imported)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return ()
    if spec is None:
        return ()
    return tuple(os.path.realpath(p) for p in (spec.submodule_search_locations or ()))


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(standard-library directories, the package directories inside them to leave out)."""
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    packages = {os.path.realpath(paths[k]) for k in ("purelib", "platlib") if paths.get(k)}
    return tuple(stdlib), tuple(packages)


def _under(path: str, directories: tuple[str, ...]) -> bool:
    return any(path == d or path.startswith(d + os.sep) for d in directories)


@functools.lru_cache(maxsize=4096)
def library_of(filename: str) -> str | None:
    """``'devicekit'``, ``'torch'`` or ``'stdlib'`` for a file of theirs, else None (user code).

    Names such as ``<frozen importlib._bootstrap>`` and ``<string>`` count as ``'stdlib'``:
    they are no file a user could open at a line.
    """
    if filename.startswith("<"):
        return "stdlib"
    path = os.path.realpath(filename)
    if _under(path, (_DEVICEKIT,)) and not _under(path, (_EXAMPLES,)):
        return "devicekit"
    if _under(path, _torch_dirs()):
        return "torch"
    stdlib, packages = _stdlib_dirs()
    if _under(path, stdlib) and not _under(path, packages):
        return "stdlib"
    return None
