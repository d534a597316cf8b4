"""Model-parallel tests run as the process tests do: no launcher variables, no GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.ranks import no_launcher  # noqa: F401  (autouse fixture, shared)


@pytest.fixture
def torch_one_thread() -> Iterator[None]:
    """One intra-op thread while a test runs tiny models: on 2 shared cores, OpenMP's second thread
    costs each small op far more than it saves (micro-batch threads overlap the stages instead)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
