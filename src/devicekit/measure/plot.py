"""``devicekit bench --plot FILE``: matmul throughput against matrix size, one line per device
and dtype, dashed lines at the known peaks (matplotlib, the optional ``plot`` extra).

Usage::

    from devicekit.measure.plot import check_plot_path, save_plot

    check_plot_path("bench.png")      # before measuring: a bad name fails at once
    save_plot(report, "bench.png")
"""

from __future__ import annotations

from pathlib import Path

from devicekit.errors import InvalidValueError, MissingDependencyError
from devicekit.measure.report import BenchReport

__all__ = ["check_plot_path", "save_plot"]


def _pyplot():  # type: ignore[no-untyped-def]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingDependencyError(
            "--plot needs matplotlib; install it with: pip install 'devicekit[plot]'") from None
    return plt


def check_plot_path(path: str | Path) -> Path:
    """The plot file, if matplotlib can write that format into an existing folder."""
    path = Path(path)
    plt = _pyplot()
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    suffix = path.suffix.lstrip(".").lower()
    if suffix not in formats:
        raise InvalidValueError(
            f"plot file {str(path)!r} has no known image format; end it in one of "
            f"{', '.join('.' + f for f in sorted(formats))}")
    if not path.parent.is_dir():
        raise InvalidValueError(f"plot file {str(path)!r}: folder {str(path.parent)!r} does not exist")
    return path


def save_plot(report: BenchReport, path: str | Path) -> Path:
    """Draw the matmul figures of ``report`` into ``path``."""
    path = check_plot_path(path)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for dev in report.devices:
        by_dtype: dict[str, list[tuple[int, float]]] = {}
        peaks: dict[str, float] = {}
        for f in dev.figures:
            if f.key.startswith("matmul."):
                by_dtype.setdefault(f.detail["dtype"], []).append((f.detail["n"], f.value))
                if f.peak:
                    peaks[f.detail["dtype"]] = f.peak
        for dtype, points in by_dtype.items():
            points.sort()
            line, = ax.plot([n for n, _ in points], [v for _, v in points], marker="o",
                            label=f"{dev.device} {dtype}")
            if dtype in peaks:
                ax.axhline(peaks[dtype], linestyle="--", color=line.get_color(), alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("matrix size n (n x n @ n x n)")
    ax.set_ylabel("TFLOP/s (dashed: datasheet peak)")
    ax.set_title("devicekit bench: matmul throughput")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
