"""dk.dist.exit_without_teardown: atexit handlers run, output is flushed, the exit code is kept."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.ranks import child_env

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    import devicekit as dk
    atexit.register(lambda: open(sys.argv[1], "w").write("atexit ran"))
    sys.stdout.write("unflushed line")          # no newline, no flush: must still come out
    dk.dist.exit_without_teardown(3)
    print("never reached")
    """
)


def test_exit_without_teardown_runs_atexit_flushes_and_keeps_the_code(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    marker = tmp_path / "marker"
    done = subprocess.run([sys.executable, str(script), str(marker)], env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "unflushed line"
    assert marker.read_text() == "atexit ran"
