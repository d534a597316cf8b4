"""devicekit.cli: the ``devicekit`` command line, one small module per command.

``main.py`` is a thin click group that loads each command lazily (``status`` and ``select``
never import torch); each ``<name>.py`` parses its options, calls the library and formats the
result. No logic of its own: what a command does lives in the wing below it.

May import: every wing. Nothing imports ``cli``.

Entry points: ``devicekit`` / ``python -m devicekit`` (:func:`devicekit.cli.main.main`).

Usage::

    devicekit status --json
    devicekit run --gpus 2 -- python train.py
"""
