"""The machine's read bandwidth, measured by the benchmark itself: the floor under a step.

A one-row decoding step streams its weights from memory once (``core/model/footprint.py``
counts the bytes), so bytes / bandwidth is the least time it can take on this machine. The
bandwidth is read STREAM-style, the way such a step reads: a sum over a float32 buffer
larger than the caches (so every pass comes from memory), on torch's threads as set,
best of a few passes after a warm one (the best is the machine's, the others its
neighbours' load).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

GIB = 1 << 30
CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


def last_level_cache() -> int | None:
    """The bytes of this CPU's largest cache (sysfs; None where it cannot be read)."""
    sizes = []
    for entry in CACHES.glob("index*/size"):
        text = entry.read_text().strip()
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
    return max(sizes, default=None)


def buffer_bytes() -> int:
    """1 GiB, or 4x the last-level cache where that is larger: a pass cannot stay cached."""
    return max(GIB, 4 * (last_level_cache() or 0))


def read_bandwidth(nbytes: int | None = None, passes: int = 5) -> float:
    """GB/s (1e9 bytes a second) read by ``torch.sum`` over a float32 buffer of ``nbytes``
    (default ``buffer_bytes()``): the best of ``passes`` timed passes after one warm pass."""
    size = nbytes if nbytes is not None else buffer_bytes()
    buffer = torch.ones(max(1, size // 4), dtype=torch.float32)
    read = buffer.numel() * buffer.element_size()
    torch.sum(buffer)  # pages touched and threads woken: not timed
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        torch.sum(buffer)
        best = min(best, time.perf_counter() - start)
    return read / max(best, 1e-9) / 1e9
