"""The ``devicekit`` command line: one module per command, formatting only (see main.py)."""
