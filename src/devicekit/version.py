"""devicekit's version, on the ground floor so that any wing may print it without importing
the package's front door (``devicekit/__init__.py``). Keep equal to pyproject.toml's version.

Usage::

    from devicekit.version import __version__
"""

__version__ = "0.1.0"
