"""Fixtures for the launch tests (starting and supervising processes): see tests/ranks.py."""

from tests.ranks import no_launcher, no_leftover_children  # noqa: F401  (fixtures; no_launcher is autouse)
