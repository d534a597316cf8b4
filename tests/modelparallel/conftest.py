"""Model-parallel tests run as the process tests do: no launcher variables, no GPU."""

from __future__ import annotations

from tests.ranks import no_launcher  # noqa: F401  (autouse fixture, shared)
