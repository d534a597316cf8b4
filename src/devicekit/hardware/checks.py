"""``devicekit doctor``'s checks: each returns pass/warn/fail lines that say what to do.

:func:`run_checks` runs them all and returns :class:`Check` results; the CLI only prints them.
The driver, GPU, variable and lease checks here import no torch; the torch build and NCCL checks
(:mod:`devicekit.hardware.torch_checks`) and the launcher variables
(:mod:`devicekit.hardware.launcher_checks`) live in their own modules. ``status`` is ``"pass"``,
``"warn"``, ``"fail"`` or ``"skip"`` (not applicable here); only ``"fail"`` makes doctor exit 1.

Usage::

    from devicekit.hardware.checks import run_checks

    for check in run_checks():
        print(check.status.upper(), check.name, check.message)
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from devicekit.errors import DeviceKitError
from devicekit.hardware.gpu import GPU

__all__ = [
    "Check",
    "Inventory",
    "take_inventory",
    "run_checks",
    "check_backend",
    "check_gpus",
    "check_device_order",
    "check_visible_devices",
    "check_lease_dir",
]

Status = Literal["pass", "warn", "fail", "skip"]
STATUSES: tuple[Status, ...] = ("pass", "warn", "fail", "skip")

_UUID_TOKEN = re.compile(r"^(GPU|MIG)-[0-9A-Za-z/_-]+$")


@dataclass(frozen=True)
class Check:
    """One doctor line: ``name`` (what was checked), ``status`` and a one-line ``message``."""

    name: str
    status: Status
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Inventory:
    """What the checks need to know about the GPUs, taken once."""

    backend: str
    gpus: tuple[GPU, ...]
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    nvml_version: str | None = None
    #: why there are no GPUs facts (NVML missing or failing), if so
    problem: str | None = None
    #: True when the problem is a failure (driver present but broken), not an absence
    failed: bool = False


def take_inventory() -> Inventory:
    """Read the backend once; a missing or broken driver is recorded, not raised."""
    from devicekit.hardware.inventory import backend

    try:
        source = backend()
        gpus = tuple(source.snapshot())
    except DeviceKitError as exc:
        name = "simulated" if os.environ.get("DEVICEKIT_SIMULATE") else "nvml"
        return Inventory(backend=name, gpus=(), problem=str(exc), failed=True)

    def optional(attr: str) -> str | None:
        fn = getattr(source, attr, None)
        try:
            return fn() if callable(fn) else None
        except DeviceKitError:
            return None

    return Inventory(
        backend=source.name,
        gpus=gpus,
        driver_version=source.driver_version(),
        cuda_driver_version=optional("cuda_driver_version"),
        nvml_version=optional("nvml_version"),
        problem=getattr(source, "reason", None),
    )


def check_backend(inv: Inventory) -> Check:
    """NVML and the driver: loadable, working, which versions."""
    if inv.failed:
        return Check("nvml", "fail", inv.problem or "the GPU backend failed")
    if inv.backend == "simulated":
        path = os.environ.get("DEVICEKIT_SIMULATE", "?")
        return Check("nvml", "pass", f"simulated GPUs from {path} (DEVICEKIT_SIMULATE); NVML not used")
    if inv.backend == "none":
        return Check("nvml", "warn", f"{inv.problem or 'NVML not available'}; GPUs cannot be used")
    parts = [f"driver {inv.driver_version or '?'}"]
    if inv.cuda_driver_version:
        parts.append(f"supports CUDA <= {inv.cuda_driver_version}")
    if inv.nvml_version:
        parts.append(f"NVML {inv.nvml_version}")
    return Check("nvml", "pass", ", ".join(parts))


def check_gpus(inv: Inventory) -> Check:
    """The GPUs themselves: how many, and modes that stop jobs from sharing or using them."""
    if inv.failed:
        return Check("gpus", "skip", "no GPU facts (the backend failed)")
    if not inv.gpus:
        return Check("gpus", "skip" if inv.backend == "none" else "warn", "no GPUs found")
    names = sorted({g.name for g in inv.gpus})
    summary = f"{len(inv.gpus)} GPU(s): " + ", ".join(names)
    prohibited = [str(g.index) for g in inv.gpus if g.compute_mode == "prohibited"]
    if prohibited:
        return Check("gpus", "fail", f"{summary}; GPU {','.join(prohibited)} in compute mode "
                     "'prohibited' accept no CUDA work: run 'nvidia-smi -c DEFAULT'")
    exclusive = [str(g.index) for g in inv.gpus if g.compute_mode in ("exclusive_process",
                                                                        "exclusive_thread")]
    empty_mig = [str(g.index) for g in inv.gpus if g.mig_enabled and not g.mig_devices]
    notes = []
    if exclusive:
        notes.append(f"GPU {','.join(exclusive)} exclusive-process: one process at a time")
    if empty_mig:
        notes.append(f"GPU {','.join(empty_mig)} in MIG mode without instances: create them "
                     "with 'nvidia-smi mig' or disable MIG")
    if notes:
        return Check("gpus", "warn", f"{summary}; " + "; ".join(notes))
    mig = [str(g.index) for g in inv.gpus if g.mig_enabled]
    if mig:
        summary += f"; GPU {','.join(mig)} in MIG mode (address instances by MIG UUID)"
    return Check("gpus", "pass", summary)


def _is_index(token: str) -> bool:
    return re.fullmatch(r"[+-]?\d+", token) is not None


def check_device_order(inv: Inventory, env: Mapping[str, str]) -> Check:
    """CUDA_DEVICE_ORDER: garbage values, and the FASTEST_FIRST trap on mixed machines."""
    order = env.get("CUDA_DEVICE_ORDER")
    if order is not None and order not in ("PCI_BUS_ID", "FASTEST_FIRST"):
        return Check("cuda_device_order", "fail",
                     f"CUDA_DEVICE_ORDER={order!r} is not PCI_BUS_ID or FASTEST_FIRST; "
                     "set CUDA_DEVICE_ORDER=PCI_BUS_ID")
    mixed = len({g.name for g in inv.gpus}) > 1
    visible = env.get("CUDA_VISIBLE_DEVICES")
    index_based = bool(visible) and any(_is_index(t.strip()) for t in visible.split(","))
    if order != "PCI_BUS_ID" and mixed:
        what = "CUDA_VISIBLE_DEVICES indices and torch ordinals" if index_based else \
            "torch's cuda:N"
        return Check("cuda_device_order", "warn",
                     f"CUDA_DEVICE_ORDER is {order or 'unset (FASTEST_FIRST)'} on a machine with "
                     f"mixed GPU models, so {what} may not match nvidia-smi's numbering; "
                     "export CUDA_DEVICE_ORDER=PCI_BUS_ID (or use GPU UUIDs)")
    if order == "PCI_BUS_ID":
        return Check("cuda_device_order", "pass", "PCI_BUS_ID: torch ordinals follow nvidia-smi")
    return Check("cuda_device_order", "pass",
                 f"{order or 'unset'}; harmless here (all GPUs are the same model)")


def check_visible_devices(inv: Inventory, env: Mapping[str, str]) -> Check:
    """CUDA_VISIBLE_DEVICES: parseable, names GPUs that exist, no duplicates."""
    name = "cuda_visible_devices"
    raw = env.get("CUDA_VISIBLE_DEVICES")
    count = len(inv.gpus)
    if raw is None:
        return Check(name, "pass", f"unset: all {count} GPU(s) visible")
    if raw.strip() == "":
        return Check(name, "warn", "CUDA_VISIBLE_DEVICES is set but empty, so CUDA sees no GPU; "
                     "unset it to use the GPUs")
    tokens = [t.strip() for t in raw.split(",")]
    known_uuids = [g.uuid for g in inv.gpus] + [m.uuid for g in inv.gpus for m in g.mig_devices]
    seen: dict[str, str] = {}
    for position, token in enumerate(tokens):
        if _is_index(token):
            index = int(token)
            if index < 0:
                if position == 0:
                    return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU "
                                 "(a negative index ends the list); unset it to use the GPUs")
                return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={raw!r}: {token!r} is negative, "
                             "so CUDA ignores it and every entry after it; remove it")
            if inv.gpus and index >= count:
                return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={raw!r} names GPU {index} but only "
                             f"{count} exist (0..{count - 1}); CUDA ignores it and every entry "
                             "after it")
            key = inv.gpus[index].uuid if inv.gpus else token.lstrip("+")
        elif _UUID_TOKEN.match(token):
            matches = [u for u in known_uuids if u.startswith(token)]
            if inv.gpus and not matches:
                return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={raw!r}: {token!r} matches no GPU "
                             "here; see 'devicekit status' for the UUIDs")
            if len(matches) > 1:
                return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={raw!r}: {token!r} matches "
                             f"{len(matches)} GPUs; write more of the UUID")
            key = matches[0] if matches else token
        else:
            return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={raw!r}: {token!r} is not a GPU index "
                         "or UUID; write e.g. CUDA_VISIBLE_DEVICES=0,1 or GPU-<uuid>")
        if key in seen:
            return Check(name, "fail", f"CUDA_VISIBLE_DEVICES={raw!r} lists {seen[key]!r} and "
                         f"{token!r}, the same GPU twice; list each GPU once")
        seen[key] = token
    if any(t.startswith("MIG-") for t in tokens) and len(tokens) > 1:
        return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={raw!r} lists several MIG instances; "
                     "a CUDA process can use only one of them")
    return Check(name, "pass", f"{raw!r}: {len(tokens)} device(s) visible")


def check_lease_dir() -> Check:
    """The lease directory exists (or can be made), is not a symlink, is safe and writable."""
    from devicekit.hardware.leases import lease_dir, read_leases

    try:
        path = lease_dir()
        if not os.access(path, os.W_OK | os.X_OK):
            return Check("lease_dir", "fail", f"lease directory {str(path)!r} is not writable by "
                         "you; set DEVICEKIT_LEASE_DIR to a directory you can write")
        live = read_leases(path)
    except DeviceKitError as exc:
        return Check("lease_dir", "fail", str(exc))
    mode = oct(os.stat(path).st_mode & 0o7777)[2:]
    return Check("lease_dir", "pass", f"{path} (mode {mode}), {len(live)} live lease(s)")


def run_checks(env: Mapping[str, str] | None = None, *, torch: bool = True) -> list[Check]:
    """Run every check; ``torch=False`` leaves out the (slow to import) torch and NCCL checks."""
    from devicekit.hardware.launcher_checks import check_launcher

    env = os.environ if env is None else env
    inv = take_inventory()
    checks: list[Check] = [check_backend(inv), check_gpus(inv)]
    if torch:
        from devicekit.hardware.torch_checks import check_nccl, check_torch_build

        checks += [check_torch_build(inv), check_nccl()]
    checks += [
        check_device_order(inv, env),
        check_visible_devices(inv, env),
        check_lease_dir(),
        check_launcher(env, visible_gpus=_visible_count(inv, env)),
    ]
    return checks


def _visible_count(inv: Inventory, env: Mapping[str, str]) -> int | None:
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if inv.failed:
        return None
    if raw is None:
        return len(inv.gpus)
    return len([t for t in raw.split(",") if t.strip() and not t.strip().startswith("-")])


def summarize(checks: Sequence[Check]) -> dict[str, int]:
    """Count of checks per status: ``{"pass": 5, "warn": 1, "fail": 0, "skip": 1}``."""
    return {status: sum(1 for c in checks if c.status == status) for status in STATUSES}
