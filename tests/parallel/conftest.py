"""Fixtures for the parallel tests (what runs inside a rank): see tests/ranks.py."""

from tests.ranks import no_launcher, no_leftover_children  # noqa: F401  (fixtures; no_launcher is autouse)
