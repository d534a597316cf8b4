"""What ``devicekit bench`` measured: figures per device, beside the known peak, and as JSON.

Usage::

    report = dk.bench(quick=True)
    for dev in report.devices:
        for fig in dev.figures:
            print(dev.device, fig.label, fig.value, fig.unit, fig.percent_of_peak)
    report.to_dict()          # the ``devicekit bench --json`` document (schema 1)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Figure", "DeviceBench", "BenchReport", "SCHEMA_VERSION"]

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Figure:
    """One measured number: ``key`` is stable (for JSON and the cache), ``label`` for people."""

    key: str
    label: str
    value: float
    unit: str
    #: the datasheet peak in the same unit, None where unknown
    peak: float | None = None
    #: extra facts (matrix size, dtype, bytes moved, ...)
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def percent_of_peak(self) -> float | None:
        return 100.0 * self.value / self.peak if self.peak else None

    def to_dict(self) -> dict[str, Any]:
        pct = self.percent_of_peak
        return {"key": self.key, "label": self.label, "value": round(self.value, 4),
                "unit": self.unit, "peak": self.peak,
                "percent_of_peak": round(pct, 1) if pct is not None else None, **self.detail}


@dataclass
class DeviceBench:
    """Everything measured on one device (``"cpu"`` or ``"cuda:N"``)."""

    device: str
    name: str
    uuid: str | None = None
    #: the model in the known-GPU table, or "unknown"
    known_model: str = "unknown"
    figures: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def get(self, key: str) -> Figure | None:
        return next((f for f in self.figures if f.key == key), None)

    def best(self, prefix: str) -> Figure | None:
        """The highest figure whose key starts with ``prefix`` (e.g. ``"matmul.bf16."``)."""
        found = [f for f in self.figures if f.key.startswith(prefix)]
        return max(found, key=lambda f: f.value) if found else None

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "name": self.name, "uuid": self.uuid,
                "known_model": self.known_model,
                "figures": [f.to_dict() for f in self.figures], "notes": list(self.notes)}


@dataclass
class BenchReport:
    """The whole run: per-device results, cross-device figures (P2P, scaling), notes."""

    devices: list[DeviceBench]
    system: list[Figure] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    quick: bool = False
    gpu_count: int = 0
    seconds: float = 0.0
    cache_files: list[str] = field(default_factory=list)

    def device(self, name: str) -> DeviceBench:
        for dev in self.devices:
            if dev.device == name:
                return dev
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, "quick": self.quick, "gpu_count": self.gpu_count,
                "seconds": round(self.seconds, 2), "notes": list(self.notes),
                "devices": [d.to_dict() for d in self.devices],
                "system": [f.to_dict() for f in self.system],
                "cache_files": list(self.cache_files)}
