"""Whose code a file is, by install place, never by a folder's name (issue 46, item 1)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import torch.distributed

import devicekit
import devicekit.examples
from devicekit.code_origin import library_of


def test_the_libraries_are_known_by_where_they_are_installed() -> None:
    assert library_of(torch.distributed.__file__) == "torch"
    assert library_of(devicekit.__file__) == "devicekit"
    assert library_of(threading.__file__) == "stdlib"
    assert library_of("<frozen importlib._bootstrap>") == "stdlib"


def test_a_folder_named_like_a_library_is_the_users_own(tmp_path: Path) -> None:
    for folder in ("devicekit", "torch", "torch/distributed", "devicekit/src/devicekit"):
        script = tmp_path / folder / "train.py"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text("print('hi')\n")
        assert library_of(str(script)) is None, folder


def test_a_link_to_a_users_file_from_inside_a_library_path_name_is_resolved(tmp_path: Path) -> None:
    # a symlink named like torch's path that points into the user's folder is the user's
    real = tmp_path / "mine.py"
    real.write_text("x = 1\n")
    link_dir = tmp_path / "site-packages" / "torch"
    link_dir.mkdir(parents=True)
    (link_dir / "mine.py").symlink_to(real)
    assert library_of(str(link_dir / "mine.py")) is None


def test_the_bundled_example_job_counts_as_a_users_script() -> None:
    example = next(Path(os.path.dirname(devicekit.examples.__file__)).glob("*.py"))
    assert library_of(str(example)) is None
