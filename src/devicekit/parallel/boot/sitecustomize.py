"""Run by Python at start-up in every process ``devicekit run`` starts while its hang doctor is
on (this directory leads ``PYTHONPATH``): a script that calls torch's own
``init_process_group`` records its collectives as one that calls ``dk.dist.init`` does.

Nothing of torch or devicekit is imported here. An import hook waits for
``torch.distributed.distributed_c10d`` and wraps its ``init_process_group``: before it runs,
torch's Flight Recorder is switched on for NCCL groups (where the launcher asked for it and the
user did not choose); after it, :mod:`devicekit.parallel.collective_log` starts (importing devicekit also
registers :mod:`devicekit.teardown`'s wait at exit). A failure of the hook never
stops the user's script. A ``sitecustomize`` the environment had before runs next, as usual.

Usage: none; ``python -c 'import sitecustomize'`` with ``DEVICEKIT_HANG_DIR`` set installs it.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

#: the module whose ``init_process_group`` is wrapped
HOOKED = "torch.distributed.distributed_c10d"


class _Hook:
    """Meta-path finder that wraps ``init_process_group`` once its module has executed."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != HOOKED:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once, and no recursion below
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec

        def exec_module(module: Any) -> None:
            execute(module)
            try:
                _wrap(module)
            except Exception:  # noqa: BLE001, S110 - the user's script must run regardless
                pass

        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec


def _wrap(c10d: Any) -> None:
    original = c10d.init_process_group
    if getattr(original, "_devicekit_hooked", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args else None)
        try:
            from devicekit.parallel import collective_log

            collective_log.flight_recorder_for(backend)
        except Exception:  # noqa: BLE001, S110 - devicekit not importable here: plain torch
            collective_log = None  # type: ignore[assignment]
        result = original(*args, **kwargs)
        if collective_log is not None:
            try:
                collective_log.start_from_environment(
                    c10d.get_rank(), collective_log.group_timeout(kwargs.get("timeout"), backend))
            except Exception:  # noqa: BLE001, S110 - recording is a help, never a failure
                pass
        return result

    init_process_group._devicekit_hooked = True  # type: ignore[attr-defined]
    c10d.init_process_group = init_process_group


def _chain() -> None:
    """Run the ``sitecustomize`` that the rest of ``sys.path`` holds, as Python would have."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    spec.loader.exec_module(module)


if os.environ.get("DEVICEKIT_HANG_DIR") and HOOKED not in sys.modules:
    sys.meta_path.insert(0, _Hook())
_chain()
