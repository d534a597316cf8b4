"""Run every benchmark in this folder, one after the other, and print their tables.

Usage::

    make bench                      # installs the anchors (extra `bench`) and runs this
    python benchmarks/run_all.py bench_to_device   # only the named ones

Each ``bench_*.py`` prints a table of ratios against its anchor, measured in the same run.
The recorded tables, with the machine they ran on, live in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: the libraries the benchmarks measure devicekit against (pyproject's extra ``bench``)
ANCHORS = ("accelerate", "lightning", "GPUtil", "gpustat", "pytorch_memlab")


def missing_anchors(names: tuple[str, ...] | None = None) -> list[str]:
    """The anchor modules (default :data:`ANCHORS`) that cannot be imported here, found
    without importing them."""
    return [name for name in (ANCHORS if names is None else names)
            if importlib.util.find_spec(name) is None]


def main(argv: list[str]) -> int:
    wanted = set(argv)
    scripts = sorted(p for p in HERE.glob("bench_*.py") if not wanted or p.stem in wanted)
    if wanted and not scripts:
        print(f"no benchmark named {sorted(wanted)}; have: "
              f"{', '.join(p.stem for p in sorted(HERE.glob('bench_*.py')))}", file=sys.stderr)
        return 1
    missing = missing_anchors()
    if missing:
        print(f"run_all: missing benchmark anchors: {', '.join(missing)}; install them with "
              "'make bench' or \"pip install -e '.[bench]'\"", file=sys.stderr)
        return 1
    failed = []
    for script in scripts:
        print(f"\n=== {script.stem} ===", flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, str(script)])
        print(f"--- {script.stem}: exit {code}, {time.perf_counter() - start:.1f} s", flush=True)
        if code:
            failed.append(script.stem)
    if failed:
        print(f"\nfailed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
