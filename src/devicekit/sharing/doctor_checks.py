"""``devicekit doctor``'s checks: each returns pass/warn/fail lines that say what to do.

:func:`run_checks` runs them all and returns :class:`Check` results; the CLI only prints them.
The driver, GPU, variable and lease checks here import no torch; the torch build and NCCL checks
(:mod:`devicekit.hardware.torch_checks`) and the launcher variables
(:mod:`devicekit.hardware.launcher_checks`) live in their own modules. ``status`` is ``"pass"``,
``"warn"``, ``"fail"`` or ``"skip"`` (not applicable here); only ``"fail"`` makes doctor exit 1.

Usage::

    from devicekit.sharing.doctor_checks import run_checks

    for check in run_checks():
        print(check.status.upper(), check.name, check.message)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence

from devicekit.errors import DeviceKitError
from devicekit.hardware.check_result import STATUSES, Check, Inventory, take_inventory

__all__ = [
    "Check",
    "Inventory",
    "take_inventory",
    "run_checks",
    "iter_checks",
    "check_backend",
    "check_gpus",
    "check_device_order",
    "check_visible_devices",
    "check_lease_dir",
    "check_queue_policy",
    "speed_order",
]

def check_backend(inv: Inventory) -> Check:
    """NVML and the driver: loadable, working, which versions."""
    if inv.failed:
        return Check("nvml", "fail", inv.problem or "the GPU backend failed")
    if inv.backend == "simulated":
        path = os.environ.get("DEVICEKIT_SIMULATE", "?")
        return Check("nvml", "pass", f"simulated GPUs from {path} (DEVICEKIT_SIMULATE); NVML not used")
    if inv.backend == "none":
        return Check("nvml", "warn", inv.problem or "NVML not available: no GPUs can be used")
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
    if len(names) > 1:
        from devicekit.hardware.capability import capabilities

        ranked = sorted(zip(inv.gpus, capabilities(inv.gpus), strict=True),
                        key=lambda pair: -pair[1].score)
        order = speed_order([(g.index, c.score) for g, c in ranked])
        return Check("gpus", "warn", (
            f"{summary}; mixed GPU models (16-bit TFLOP/s: {order}): an equal split of a batch "
            "makes the fast GPUs wait for the slowest; devicekit run/dk.launch give rank 0 the "
            "strongest GPU, 'select --order fastest' picks the strongest, and "
            "BalancedDataParallel(weights='auto') splits batches by speed; "
            "'devicekit bench' measures them"))
    mig = [str(g.index) for g in inv.gpus if g.mig_enabled]
    if mig:
        summary += f"; GPU {','.join(mig)} in MIG mode (address instances by MIG UUID)"
    return Check("gpus", "pass", summary)


def speed_order(ranked: Sequence[tuple[int, float]]) -> str:
    """``(index, score)`` pairs, fastest first, as ``GPU 0 989 = GPU 1 989 > GPU 2 312``: equal
    where the printed (rounded) scores are equal, ``>`` between different ones."""
    text = ""
    previous = None
    for index, score in ranked:
        shown = f"{score:.0f}"
        if previous is not None:
            text += " = " if shown == previous else " > "
        text += f"GPU {index} {shown}"
        previous = shown
    return text


def _index_based(raw: str | None) -> bool:
    return bool(raw) and any(t.strip().isdigit() for t in (raw or "").split(","))


def check_device_order(inv: Inventory, env: Mapping[str, str]) -> Check:
    """CUDA_DEVICE_ORDER: garbage values, and the FASTEST_FIRST trap on mixed machines."""
    from devicekit.hardware.visible import cuda_order, ordering_note

    name = "cuda_device_order"
    try:
        order = cuda_order(env)
    except DeviceKitError as exc:
        return Check(name, "fail", str(exc))
    note = ordering_note(inv.gpus, env)
    if note:
        raw = env.get("CUDA_VISIBLE_DEVICES")
        if _index_based(raw):
            return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={raw!r} uses indices but {note}")
        return Check(name, "warn", note[0].upper() + note[1:])
    if order == "PCI_BUS_ID":
        return Check(name, "pass", "PCI_BUS_ID: CUDA numbers GPUs like nvidia-smi")
    set_or_not = "unset (FASTEST_FIRST)" if not env.get("CUDA_DEVICE_ORDER") else order
    return Check(name, "pass", f"{set_or_not}; harmless here (no mix of GPU models)")


def check_visible_devices(inv: Inventory, env: Mapping[str, str]) -> Check:
    """CUDA_VISIBLE_DEVICES: parseable, names GPUs that exist, no duplicates."""
    from devicekit.hardware.visible import visible_devices

    name = "cuda_visible_devices"
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return Check(name, "pass", f"unset: all {len(inv.gpus)} GPU(s) visible")
    if inv.failed or not inv.gpus:
        return Check(name, "skip", f"CUDA_VISIBLE_DEVICES={raw!r}; no GPUs here to check it against")
    try:
        devices = visible_devices(inv.gpus, env, warn=False)  # the ordering trap is check_device_order's line
    except DeviceKitError as exc:
        return Check(name, "fail", str(exc))
    if not devices:
        return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={raw!r} hides every GPU, so CUDA sees "
                     "none; unset it to use the GPUs")
    migs = [d for d in devices if d.mig is not None]
    if migs and len(devices) > 1:
        return Check(name, "warn", f"CUDA_VISIBLE_DEVICES={raw!r} lists several devices with a MIG "
                     "instance among them; a CUDA process can use only one MIG instance")
    shown = ", ".join(f"cuda:{d.ordinal}=GPU {d.gpu.index}" + (f" MIG {d.mig.index}" if d.mig else "")
                      for d in devices)
    return Check(name, "pass", f"{raw!r}: {shown}")


def check_lease_dir() -> Check:
    """The lease directory exists (or can be made), is not a symlink, is safe and writable."""
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.leases import read_leases

    try:
        path = lease_dir()
        if not os.access(path, os.W_OK | os.X_OK):
            return Check("lease_dir", "fail", f"lease directory {str(path)!r} is not writable by "
                         "you; set DEVICEKIT_LEASE_DIR to a directory you can write")
        ignored: list = []
        live = read_leases(path, ignored=ignored)
    except DeviceKitError as exc:
        return Check("lease_dir", "fail", str(exc))
    info = os.stat(path)
    mode = oct(info.st_mode & 0o7777)[2:]
    from devicekit.sharing.lock_squatting import squatted_files

    squatted = squatted_files(path)
    if squatted:  # devicekit run refuses these GPUs: someone pre-created their lock files
        return Check("lease_dir", "warn", f"{len(squatted)} unusable lock file(s), their GPUs "
                     f"blocked: {'; '.join(squatted[:4])}; ask the owner or an admin to remove them")
    if ignored:  # another user's junk or attack: status lists them, the admin should hear of it
        owners = ", ".join(sorted({i.user for i in ignored}))
        return Check("lease_dir", "warn", f"{path} (mode {mode}), {len(live)} live lease(s);"
                     f" {len(ignored)} live lease file(s) of {owners} ignored (they fail the lease"
                     f" schema, so they hold no GPU), e.g. {ignored[0].name}: {ignored[0].why};"
                     " 'devicekit status --json' lists them (ignored_leases)")
    return Check("lease_dir", "pass", f"{path} (mode {mode}), {len(live)} live lease(s)")


def check_queue_policy() -> Check:
    """The admin's queue policy (``policy.toml``) is in force, or there is none; an ignored one
    (malformed, writable by others) means no quotas and no limits, which the admin must know."""
    from devicekit.sharing.lease_directory import lease_dir
    from devicekit.sharing.policy import load_policy

    try:
        policy = load_policy(lease_dir())
    except DeviceKitError as exc:
        return Check("queue_policy", "skip", f"no lease directory to read a policy from ({exc})")
    if policy.note:
        return Check("queue_policy", "warn", f"{policy.note}: the queue runs with no quotas,"
                     " priorities or default time limit until it is fixed")
    if not policy.path:
        return Check("queue_policy", "pass", "no policy.toml: first come, first served, no quotas")
    return Check("queue_policy", "pass", f"{policy.path} in force")


def run_checks(env: Mapping[str, str] | None = None, *, torch: bool = True) -> list[Check]:
    """Run every check; ``torch=False`` leaves out the (slow to import) torch and NCCL checks."""
    return list(iter_checks(env, torch=torch))


def iter_checks(env: Mapping[str, str] | None = None, *, torch: bool = True) -> Iterator[Check]:
    """The checks of :func:`run_checks`, each yielded as soon as it has run (to show progress)."""
    from devicekit.hardware.launcher_checks import check_launcher

    env = os.environ if env is None else env
    inv = take_inventory()
    yield check_backend(inv)
    yield check_gpus(inv)
    if torch:
        from devicekit.hardware.torch_checks import (
            check_nccl,
            check_torch_build,
            check_torch_version,
        )

        yield check_torch_build(inv)
        yield check_torch_version()
        yield check_nccl()
    yield check_device_order(inv, env)
    yield check_visible_devices(inv, env)
    yield check_lease_dir()
    yield check_queue_policy()
    yield check_pid_namespace(inv, env)
    yield check_launcher(env, visible_gpus=_visible_count(inv, env))
    from devicekit.hardware.slurm_node import check_slurm

    slurm = check_slurm(env)  # inside a Slurm job only: its id and its GPUs (scontrol)
    if slurm is not None:
        yield slurm


def check_pid_namespace(inv: Inventory, env: Mapping[str, str]) -> Check:
    """A container's own PID namespace hides who uses the GPUs (NVML gives host pids)."""
    from devicekit.hardware.container import pid_isolation

    # simulated processes are made up: only NVML's pids say anything about this /proc
    pids = [p.pid for g in inv.gpus for p in g.processes] if inv.backend == "nvml" else []
    iso = pid_isolation(pids, env)
    hints = f" (hints: {', '.join(iso.hints)})" if iso.hints else ""
    if iso.own_namespace is None and not iso.foreign_pids:
        return Check("pid_namespace", "skip", "no /proc here: cannot tell")
    note = iso.note()
    if note is None:
        return Check("pid_namespace", "pass", "the host's: GPU processes are named in status")
    return Check("pid_namespace", "warn", note + "; run 'devicekit run' (and leases) in the"
                 " same container or mount one lease directory into every container" + hints)


def _visible_count(inv: Inventory, env: Mapping[str, str]) -> int | None:
    """How many devices CUDA will show (None where that cannot be told)."""
    from devicekit.hardware.visible import visible_devices

    if inv.failed or not inv.gpus:
        return None
    try:
        return len(visible_devices(inv.gpus, env, warn=False))
    except DeviceKitError:
        return None


def summarize(checks: Sequence[Check]) -> dict[str, int]:
    """Count of checks per status: ``{"pass": 5, "warn": 1, "fail": 0, "skip": 1}``."""
    return {status: sum(1 for c in checks if c.status == status) for status in STATUSES}
