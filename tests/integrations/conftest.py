"""Framework tests run offline, on the CPU (no GPU visible), with no launcher variables."""

from __future__ import annotations

import pytest

from tests.ranks import no_launcher, no_leftover_children  # noqa: F401  (fixtures; no_launcher is autouse)


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"),
                        ("WANDB_DISABLED", "true"), ("TOKENIZERS_PARALLELISM", "false")):
        monkeypatch.setenv(name, value)
