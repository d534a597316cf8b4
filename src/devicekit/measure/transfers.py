"""Copy bandwidths: host <-> device (pinned and pageable), within a device, between GPUs (P2P),
and the CPU's own memory bandwidth.

Figures are GB/s (1e9 bytes/s) of bytes moved per second; copies *within* one memory (device to
device on one GPU, CPU memory) count each byte twice, read and written, as NVIDIA's
``bandwidthTest`` does, so they compare with the datasheet's memory bandwidth.

Usage::

    from devicekit.measure.transfers import host_device_gbs, within_device_gbs, peer_gbs

    host_device_gbs(torch.device("cuda:0"), 256 << 20, pinned=True, to_device=True)
"""

from __future__ import annotations

import torch

from devicekit.measure.timing import median_seconds, on_device

__all__ = ["host_device_gbs", "within_device_gbs", "peer_gbs", "peer_enabled"]


def host_device_gbs(device: torch.device, nbytes: int, *, pinned: bool, to_device: bool) -> float:
    """Host-to-device (``to_device``) or device-to-host bandwidth of one ``nbytes`` copy."""
    with on_device(device):
        host = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            host = host.pin_memory()
        host.fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        src, dst = (host, dev) if to_device else (dev, host)
        seconds = median_seconds(lambda: dst.copy_(src, non_blocking=pinned), device, target=0.05)
    return nbytes / seconds / 1e9


def within_device_gbs(device: torch.device, nbytes: int) -> float:
    """Copy bandwidth inside one device's memory (read + write counted), GPU or CPU."""
    with on_device(device):
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        seconds = median_seconds(lambda: dst.copy_(src), device, target=0.05)
    return 2 * src.numel() * 4 / seconds / 1e9


def peer_enabled(src: torch.device, dst: torch.device) -> bool:
    """Whether ``src`` can read/write ``dst``'s memory directly (P2P over NVLink or PCIe)."""
    return bool(torch.cuda.can_device_access_peer(src.index, dst.index))


def peer_gbs(src: torch.device, dst: torch.device, nbytes: int) -> float:
    """Bandwidth of copying ``nbytes`` from GPU ``src`` to GPU ``dst``."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)

    # torch runs a GPU-to-GPU copy on the *source's* current stream (the destination's stream
    # waits for it), so events on the source device bracket it
    torch.cuda.synchronize(dst)
    seconds = median_seconds(lambda: b.copy_(a, non_blocking=True), src, target=0.05)
    torch.cuda.synchronize(dst)
    return nbytes / seconds / 1e9
