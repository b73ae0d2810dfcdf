"""Peak memory of one request: how far it pushed memory above where it started.

On CUDA this is ``torch.cuda.max_memory_allocated`` (tensors only). On Linux CPUs it is
the process's resident-set high-water mark (``VmHWM``), reset before each request by
writing ``5`` to ``/proc/self/clear_refs``; RSS counts everything the process touches
(weights, caches, allocator slack), which is what a user's machine has to hold.
``tracemalloc`` would miss torch's tensors entirely.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def method(device: torch.device) -> str | None:
    """How peaks are measured on ``device``, or None when they cannot be."""
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated (tensors)"
    if _CLEAR_REFS.exists() and _kib("VmHWM") is not None:
        return "process RSS high-water (VmHWM, reset per request)"
    return None


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.mib``: the request's peak
    above the memory in use when it started, and ``peak.total_mib``: the absolute peak
    during it (both None where they cannot be measured)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.mib: float | None = None
        self.total_mib: float | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        elif method(self.device) is not None:
            _CLEAR_REFS.write_text("5")  # the high-water mark restarts at the current RSS
            self._start = (_kib("VmRSS") or 0) * 1024
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._done(torch.cuda.max_memory_allocated(self.device))
        elif method(self.device) is not None:
            self._done((_kib("VmHWM") or 0) * 1024)

    def _done(self, peak: int) -> None:
        self.mib = max(0, peak - self._start) / 2**20  # RSS can fall below the start
        self.total_mib = peak / 2**20


def _kib(field: str) -> int | None:
    try:
        found = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None
