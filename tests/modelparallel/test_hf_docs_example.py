"""docs/model-parallel.md's Hugging Face example runs as shown and prints the plan the page shows."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("torch_one_thread")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "model-parallel.md"


def test_the_hf_pipeline_example_runs_and_prints_its_plan() -> None:
    text = PAGE.read_text()
    found = re.search(r"```python\n(import torch\nimport transformers\n.*?)```\n\n```\n(.*?)```", text, re.S)
    assert found, "the Hugging Face example is missing from docs/model-parallel.md"
    code, shown = found.groups()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(PAGE), "exec"), {"__name__": "docs_example"})
    assert printed.getvalue().strip() == shown.strip()
