"""A simulated mixed machine for the tests: a T4, an H100 and an A100, in that PCI order.

The PCI order is deliberately not the speed order, so a test that passes by accident of the
index order would fail.
"""

from __future__ import annotations

from typing import Any

MIXED_UUIDS = {"t4": "GPU-7a000000-0000-0000-0000-000000000000",
               "h100": "GPU-4a000000-0000-0000-0000-000000000000",
               "a100": "GPU-a1000000-0000-0000-0000-000000000000"}


def mixed_machine() -> list[dict[str, Any]]:
    """Simulation entries with names only: the speed facts come from the known-model table."""
    return [
        {"name": "Tesla T4", "memory_total": "16GiB", "uuid": MIXED_UUIDS["t4"]},
        {"name": "NVIDIA H100 80GB HBM3", "memory_total": "80GiB", "memory_used": "10GiB",
         "uuid": MIXED_UUIDS["h100"]},
        {"name": "NVIDIA A100-SXM4-80GB", "memory_total": "80GiB", "uuid": MIXED_UUIDS["a100"]},
    ]
