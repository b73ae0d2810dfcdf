"""What a start measured on this machine, kept for the next start (small JSON files).

The first engine on a model measures which way its linear layers are fastest per row
count (``linears.py``), whether its head packs right and faster (``packed.py``) and
whether its keys re-rotate (``arch.py``). On a real model that is several forwards and
hundreds of timed products: on Qwen2.5-Coder-1.5B (bf16, 2-core Xeon) they cost more than
loading the model. Each answer is a pure function of the machine, the software and what
was measured, so it is kept under a key naming all of them and recalled by a later start
with the same key.

A key always holds the CPU (its model name and a digest of its feature flags), the
Python, torch and transformers versions, torch's thread count and OpenMP's environment
settings; the caller adds what was measured (the weights' shapes and dtype, or the model's
fingerprint). An entry is trusted only when its stored key equals the key asked with,
field for field: a changed CPU, a torch upgrade, another dtype or shape measures again. A
file that cannot be read or parsed counts as missing; one that cannot be written is skipped
(the next start measures again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvboost_rag.core.model import torch_compat

FORMAT = 1  # bumped when what an entry holds changes meaning
OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_PROC_BIND", "OMP_PLACES")


class Measurements:
    """A folder of measurements; ``None`` keeps nothing (every start measures).

    Thread-safe: files are written whole and renamed into place, and read whole."""

    def __init__(self, folder: str | Path | None, model: str = "") -> None:
        self.folder = None if folder is None else Path(folder)
        # The model's fingerprint (hex), for verdicts on its outputs; "" keeps none of them.
        self.model = model

    def recall(self, what: str, key: dict[str, Any]) -> Any | None:
        """The value kept for ``what`` under ``key`` on this machine, or None."""
        path = self._path(what, key)
        if path is None:
            return None
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(entry, dict) or entry.get("key") != _full(what, key):
            return None
        return entry.get("value")

    def keep(self, what: str, key: dict[str, Any], value: Any) -> None:
        """Keep ``value`` (JSON-serializable) for ``what`` under ``key``."""
        path = self._path(what, key)
        if path is None:
            return
        text = json.dumps({"key": _full(what, key), "value": value}, indent=1, sort_keys=True)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(handle, "w") as file:
                file.write(text)
            os.replace(tmp, path)
        except OSError:
            return

    def _path(self, what: str, key: dict[str, Any]) -> Path | None:
        if self.folder is None:
            return None
        name = hashlib.blake2b(_canonical(_full(what, key)), digest_size=12).hexdigest()
        return self.folder / f"{what}-{name}.json"


FORGETFUL = Measurements(None)  # recalls nothing and keeps nothing


def default_folder() -> Path | None:
    """Where engines keep measurements unless told not to: under the cache root."""
    from kvboost_rag.core.model.loading import default_cache_root

    return default_cache_root() / "measurements"


def _full(what: str, key: dict[str, Any]) -> dict[str, Any]:
    """``key`` with the machine and software it was measured on; JSON's own form (tuples
    become lists), so a key compares equal to the one read back."""
    full = {"what": what, "format": FORMAT, **machine(), "threads": torch.get_num_threads(), **key}
    return json.loads(_canonical(full))  # type: ignore[no-any-return]


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, default=str).encode()


@functools.cache
def machine() -> dict[str, str]:
    """The CPU and software a measurement holds for (constant for a process)."""
    import transformers

    name, flags = _cpu()
    bf16 = torch.backends.mkldnn.is_available() and torch_compat.mkldnn_bf16_supported()
    return {
        "cpu": name,
        "cpu_flags": hashlib.blake2b(flags.encode(), digest_size=12).hexdigest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onednn_bf16": str(bf16),
        # How OpenMP's workers wait between parallel regions changes which way is fastest
        # (on a busy 2-core machine a passive wait ran products 3-8x faster than spinning).
        "openmp": " ".join(f"{name}={os.environ.get(name, '')}" for name in OPENMP_SETTINGS),
    }


def _cpu() -> tuple[str, str]:
    """The CPU's model name and its feature flags (Linux's /proc/cpuinfo; elsewhere what
    ``platform`` says, with no flags)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    flags = " ".join(sorted((fields.get("flags") or fields.get("Features") or "").split()))
    return f"{name} ({sys.platform}, {os.cpu_count()} CPUs)", flags
