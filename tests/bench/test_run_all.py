"""``benchmarks/run_all.py`` checks its anchors before running anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run_all  # noqa: E402


def test_missing_anchor_is_one_line_saying_how_to_install(monkeypatch, capsys) -> None:
    monkeypatch.setattr(run_all, "ANCHORS", ("accelerate", "no_such_anchor_module"))
    assert run_all.main([]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1
    assert "no_such_anchor_module" in err
    assert "make bench" in err and "pip install -e '.[bench]'" in err


@pytest.mark.skipif(not run_all.missing_anchors(), reason="every anchor is installed here")
def test_script_without_anchors_exits_non_zero_without_traceback() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run_all.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1
