"""The directory ``devicekit run`` puts first on its ranks' ``PYTHONPATH``: it holds only
:mod:`sitecustomize`, which lets a plain-torch script's ranks record their collectives.

Usage (what :class:`devicekit.jobs.run_doctor.RunDoctor` does)::

    from devicekit.parallel import boot

    env["PYTHONPATH"] = os.pathsep.join([boot.DIRECTORY, env.get("PYTHONPATH", "")])
"""

from __future__ import annotations

import os

__all__ = ["DIRECTORY"]

#: the directory to put first on ``PYTHONPATH``
DIRECTORY = os.path.dirname(os.path.abspath(__file__))
