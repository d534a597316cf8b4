"""Which physical GPU is ``cuda:N``: ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER`` done right.

NVML (and ``devicekit status``) numbers GPUs in PCI bus order. CUDA numbers them in
``CUDA_DEVICE_ORDER``: ``FASTEST_FIRST`` (the default!) or ``PCI_BUS_ID``. On a machine with
mixed models the two orders differ, so ``CUDA_VISIBLE_DEVICES=1`` may not be ``GPU 1`` of
``nvidia-smi``. UUIDs (``GPU-5d9b...``) mean the same card under every order, which is why
devicekit hands out UUIDs by default. Then ``CUDA_VISIBLE_DEVICES`` reorders and hides devices:
torch's ``cuda:0`` is the first entry of the list.

``CUDA_VISIBLE_DEVICES`` accepts indices, full or unique-prefix ``GPU-`` UUIDs and ``MIG-``
UUIDs; an empty value (or ``-1``) hides every GPU. CUDA itself *silently* stops at the first
entry it cannot use, hiding every GPU after it; devicekit raises
:class:`~devicekit.errors.VisibleDevicesError` naming the entry instead.

Usage::

    from devicekit.hardware.visible import visible_devices, torch_ordinal

    for dev in visible_devices():          # what this process's CUDA will see
        print(f"cuda:{dev.ordinal} is GPU {dev.gpu.index} ({dev.uuid})")
    torch_ordinal(gpu)                     # ordinal of a GPU in this process, matched by UUID
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from devicekit.errors import VisibleDevicesError
from devicekit.hardware.gpu import GPU, MigDevice

__all__ = [
    "VISIBLE_ENV",
    "ORDER_ENV",
    "DeviceOrderWarning",
    "VisibleDevice",
    "visible_devices",
    "cuda_order",
    "enumeration_order",
    "ordering_note",
    "visible_value",
    "torch_ordinal",
]

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"
_ORDERS = ("FASTEST_FIRST", "PCI_BUS_ID")
_NONE_VALUES = ("", "-1", "NoDevFiles", "none")  # NoDevFiles: what Slurm sets for zero GPUs


class DeviceOrderWarning(UserWarning):
    """Indices in ``CUDA_VISIBLE_DEVICES`` may not mean what ``nvidia-smi`` numbers say."""


@dataclass(frozen=True)
class VisibleDevice:
    """One device as CUDA in this process sees it: ``cuda:{ordinal}``."""

    ordinal: int
    gpu: GPU
    #: the MIG instance when the entry named one (``MIG-...``), else None
    mig: MigDevice | None = None

    @property
    def uuid(self) -> str:
        return self.mig.uuid if self.mig is not None else self.gpu.uuid


def cuda_order(env: Mapping[str, str] | None = None) -> str:
    """``CUDA_DEVICE_ORDER`` in force (``FASTEST_FIRST`` when unset, as CUDA does)."""
    env = os.environ if env is None else env
    raw = env.get(ORDER_ENV)
    if raw is None or raw.strip() == "":
        return "FASTEST_FIRST"
    value = raw.strip().upper()
    if value not in _ORDERS:
        raise VisibleDevicesError(
            f"{ORDER_ENV}={raw!r} is neither PCI_BUS_ID nor FASTEST_FIRST (CUDA ignores it); "
            f"set {ORDER_ENV}=PCI_BUS_ID"
        )
    return value


def _speed_key(gpu: GPU) -> tuple[int, int, int, int]:
    cc = gpu.compute_capability or (0, 0)
    return (-cc[0], -cc[1], -gpu.memory_total, gpu.index)


def enumeration_order(gpus: Sequence[GPU], order: str = "FASTEST_FIRST") -> list[GPU]:
    """Physical GPUs in the order CUDA numbers them before ``CUDA_VISIBLE_DEVICES`` applies.

    ``PCI_BUS_ID``: NVML order. ``FASTEST_FIRST``: CUDA's own speed guess, which devicekit can
    only estimate (newest compute capability, then most memory, ties in PCI order); on a machine
    whose GPUs are all the same model both orders are the same.
    """
    by_pci = sorted(gpus, key=lambda g: g.index)
    if order == "PCI_BUS_ID" or not _mixed(by_pci):
        return by_pci
    return sorted(by_pci, key=_speed_key)


def _mixed(gpus: Sequence[GPU]) -> bool:
    return len({(g.name, g.compute_capability, g.memory_total) for g in gpus}) > 1


def ordering_note(gpus: Sequence[GPU], env: Mapping[str, str] | None = None) -> str | None:
    """One line explaining why CUDA indices may differ from ``nvidia-smi``'s here, else None."""
    if cuda_order(env) == "PCI_BUS_ID" or not _mixed(gpus):
        return None
    names = ", ".join(sorted({g.name for g in gpus}))
    return (
        f"this machine mixes GPU models ({names}) and {ORDER_ENV} is not PCI_BUS_ID, so CUDA "
        f"numbers them fastest first, unlike nvidia-smi/devicekit status; use GPU UUIDs in "
        f"{VISIBLE_ENV} or set {ORDER_ENV}=PCI_BUS_ID"
    )


def visible_devices(gpus: Sequence[GPU] | None = None, env: Mapping[str, str] | None = None, *,
                    warn: bool = True) -> list[VisibleDevice]:
    """The devices CUDA will show a process with environment ``env`` (default: this one).

    Indices on a machine whose CUDA order differs from ``nvidia-smi``'s give a
    :class:`DeviceOrderWarning` (once per process; ``warn=False`` for a caller that reports the
    trap itself, as ``doctor`` does). Raises :class:`VisibleDevicesError` for an entry CUDA would silently stop at (garbage, an
    index or UUID that matches no GPU, an ambiguous short UUID, a duplicate).
    """
    if gpus is None:
        from devicekit.hardware.inventory import gpus as snapshot

        gpus = snapshot()
    env = os.environ if env is None else env
    order = cuda_order(env)
    enumerated = enumeration_order(gpus, order)
    raw = env.get(VISIBLE_ENV)
    if raw is None:
        return [VisibleDevice(i, gpu) for i, gpu in enumerate(enumerated)]
    if raw.strip() in _NONE_VALUES:
        return []
    result: list[VisibleDevice] = []
    seen: set[str] = set()
    entries = [e.strip() for e in raw.split(",")]
    while len(entries) > 1 and entries[-1] == "":  # "0,1,": CUDA stops after every GPU listed
        entries.pop()
    for position, entry in enumerate(entries):
        if entry.startswith("-") and entry[1:].isdigit():
            break  # a negative index ends the list: the documented way to hide the rest
        device = _resolve_entry(entry, raw, position, enumerated, result)
        if device.uuid in seen:
            raise _bad(raw, entry, result, "names a GPU already listed")
        seen.add(device.uuid)
        result.append(VisibleDevice(len(result), device.gpu, device.mig))
    note = ordering_note(gpus, env)
    if warn and note and any(e.strip().isdigit() for e in raw.split(",")):
        _warn_order(f"{VISIBLE_ENV}={raw!r} uses indices but {note}")
    return result


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_warned: set[str] = set()  # DeviceOrderWarning texts already given in this process


def _warn_order(text: str) -> None:
    """Warn once per distinct text per process, at the first caller outside devicekit.

    One selection reaches this through several paths (``select_gpus``, each GPU's
    ``Selection.devices`` ordinal, ``visible_devices``): the trap is one fact about the
    environment, so the user sees it once, pointing at their own line, not devicekit's.
    """
    if text in _warned:
        return
    _warned.add(text)
    warnings.warn(text, DeviceOrderWarning, stacklevel=_stacklevel_outside_devicekit())


def _stacklevel_outside_devicekit() -> int:
    """``stacklevel`` (for a ``warnings.warn`` in the caller) of the innermost frame not in devicekit."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level


def _bad(raw: str, entry: str, before: Sequence[VisibleDevice], why: str) -> VisibleDevicesError:
    kept = ",".join(str(d.gpu.index) for d in before)
    effect = f"only GPU(s) {kept} would be visible" if kept else "no GPU would be visible"
    return VisibleDevicesError(
        f"{VISIBLE_ENV}={raw!r}: entry {entry!r} {why}; CUDA silently stops at such an entry "
        f"({effect}); list indices or UUIDs from 'devicekit status', e.g. "
        "the value 'devicekit select' prints"
    )


def _resolve_entry(entry: str, raw: str, position: int, enumerated: Sequence[GPU],
                   before: Sequence[VisibleDevice]) -> VisibleDevice:
    if entry.isdigit():
        index = int(entry)
        if index >= len(enumerated):
            count = len(enumerated)
            raise _bad(raw, entry, before, f"is not a GPU index (this machine has {count} GPU(s))")
        return VisibleDevice(position, enumerated[index])
    lowered = entry.lower()
    if lowered.startswith("gpu-") and len(entry) > 4:
        matches = [g for g in enumerated if g.uuid.lower().startswith(lowered)]
        if len(matches) == 1:
            return VisibleDevice(position, matches[0])
        why = "matches several GPUs (write more of the UUID)" if matches else "matches no GPU's UUID"
        raise _bad(raw, entry, before, why)
    if lowered.startswith("mig-") and len(entry) > 4:
        for gpu in enumerated:
            for mig in gpu.mig_devices:
                if mig.uuid.lower() == lowered or (
                    lowered.startswith("mig-gpu-") and _legacy_mig(lowered, gpu, mig)
                ):
                    return VisibleDevice(position, gpu, mig)
        raise _bad(raw, entry, before, "matches no MIG instance")
    raise _bad(raw, entry, before, "is not a GPU index, GPU- UUID or MIG- UUID")


def _legacy_mig(lowered: str, gpu: GPU, mig: MigDevice) -> bool:
    """``MIG-GPU-<uuid>/<gi>/<ci>`` (CUDA 11.0-11.x form): match the parent and the instance."""
    parent, _, rest = lowered[4:].partition("/")
    return parent == gpu.uuid.lower() and rest.split("/")[0] == str(mig.index)


def visible_value(gpus: Sequence[GPU], fmt: str = "uuid") -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value naming ``gpus``: UUIDs, or NVML indices.

    Indices only mean the same cards with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``.
    """
    if fmt == "uuid":
        return ",".join(g.uuid for g in gpus)
    if fmt == "index":
        return ",".join(str(g.index) for g in gpus)
    raise VisibleDevicesError(f"format {fmt!r} is not 'uuid' or 'index'")


def _normalise(uuid: str) -> str:
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def _cuda_initialised() -> bool:
    """True once CUDA in this process has read ``CUDA_VISIBLE_DEVICES``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        if torch.cuda.is_initialized():
            return True
    except Exception:  # a half-imported or broken torch: fall back to the environment
        return False
    # torch.cuda.is_available() / device_count() call cuInit without marking torch initialised
    return _driver_initialised()


def _driver_initialised() -> bool:
    """True when this process has already called ``cuInit`` (e.g. ``torch.cuda.is_available()``).

    Asks an already loaded ``libcuda.so.1`` only (``RTLD_NOLOAD``), so the driver is never
    loaded nor initialised here: ``cuDeviceGetCount`` fails with NOT_INITIALIZED before ``cuInit``.
    """
    import ctypes

    no_load = getattr(os, "RTLD_NOLOAD", None)
    if no_load is None:
        return False
    try:
        lib = ctypes.CDLL("libcuda.so.1", mode=no_load)
        count = ctypes.c_int(0)
        return int(lib.cuDeviceGetCount(ctypes.byref(count))) == 0  # 0: CUDA_SUCCESS
    except (OSError, AttributeError):  # not loaded (or no such symbol): CUDA not initialised
        return False


def torch_ordinal(gpu: GPU | str, gpus: Sequence[GPU] | None = None,
                  env: Mapping[str, str] | None = None) -> int:
    """The ordinal ``N`` such that ``cuda:N`` is ``gpu`` in this process.

    If CUDA is already initialised here (by torch, or by the driver call behind
    ``torch.cuda.is_available()``), CUDA's own device list is searched by UUID
    (``torch.cuda.get_device_properties(i).uuid``): ``CUDA_VISIBLE_DEVICES`` was read at
    initialisation and later changes to it no longer matter. Otherwise the ordinal is computed
    from ``CUDA_VISIBLE_DEVICES``/``CUDA_DEVICE_ORDER`` as they are now, which is what CUDA will
    read when it initialises. torch is never imported (nor CUDA initialised) by this function.
    """
    uuid = gpu.uuid if isinstance(gpu, GPU) else gpu
    simulated = isinstance(gpu, GPU) and gpu.backend == "simulated"
    if not simulated and _cuda_initialised():
        import torch

        wanted = _normalise(uuid)
        for i in range(torch.cuda.device_count()):
            if _normalise(str(torch.cuda.get_device_properties(i).uuid)) == wanted:
                return i
        raise VisibleDevicesError(
            f"GPU {uuid} is not among this process's CUDA devices (CUDA was initialised with "
            f"{VISIBLE_ENV}={os.environ.get(VISIBLE_ENV)!r}); set {VISIBLE_ENV} before torch "
            f"first touches CUDA, or select among visible GPUs"
        )
    env = os.environ if env is None else env
    if gpus is None:
        from devicekit.hardware.inventory import gpus as snapshot

        gpus = snapshot()
    raw = env.get(VISIBLE_ENV)
    note = ordering_note(gpus, env)
    if note and raw is None:  # CUDA's FASTEST_FIRST numbering can only be estimated here
        _warn_order(f"cuda ordinal of {uuid} is estimated: {note}")
    for device in visible_devices(gpus, env):
        if _normalise(device.uuid) == _normalise(uuid):
            return device.ordinal
    raise VisibleDevicesError(
        f"GPU {uuid} is not visible in this process ({VISIBLE_ENV}={env.get(VISIBLE_ENV)!r}); "
        f"set {VISIBLE_ENV} to the selection's value before CUDA initialises, or unset it"
    )
