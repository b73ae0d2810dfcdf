"""The systems the benchmark puts side by side, all on one loaded model, and the machine."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Sequence
from typing import Any

import torch
import transformers

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.bench.common.memory import method
from kvboost_rag.bench.common.peer import PeerEngine, peer_version

LEVELS: list[tuple[str, dict[str, Any]]] = [
    ("exact prefix cache", {"fidelity": "exact"}),
    ("fast", {"fidelity": "fast"}),
    ("balanced", {"fidelity": "balanced"}),
]


def peer_name() -> str:
    return f"kvboost {peer_version() or ''} (PyPI peer)".replace("  ", " ")


def build(base: KVBoost, with_peer: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """One engine per fidelity level (and the peer when installed), each with its own
    empty cache over ``base``'s model. The notes say why a system did not run."""
    systems: dict[str, Any] = {
        name: KVBoost(base.model, base.tokenizer, KVBoostConfig(**cfg)) for name, cfg in LEVELS
    }
    notes: dict[str, str] = {}
    if not with_peer:
        notes[peer_name()] = "not run: --no-peer"
    elif peer_version() is None:
        notes[peer_name()] = "not run: not installed (pip install 'kvboost-rag[bench]')"
    else:
        try:
            systems[peer_name()] = PeerEngine(base)
        except (ImportError, RuntimeError, ValueError, TypeError) as err:
            notes[peer_name()] = f"not run: {type(err).__name__}: {err}"
    return systems, notes


def warm(
    systems: dict[str, Any], texts: Sequence[str], prefix: str | list[dict[str, str]] | None
) -> dict[str, dict[str, Any]]:
    """Preload ``texts`` into every system that can take passages ahead of time, timed.
    The exact prefix cache cannot: a passage's KV depends on everything before it.
    ``prefix`` is the layout of the prompts they will be used in (``warm_passages``); the
    peer and engines with ``passage_prefix="anchor"`` take none (they encode after BOS)."""
    out = {}
    for name, system in systems.items():
        if isinstance(system, KVBoost) and system.config.fidelity == "exact":
            continue
        start = time.perf_counter()
        if isinstance(system, KVBoost) and system.config.passage_prefix == "prompt":
            stored = system.warm_passages(list(texts), prefix=prefix)
        else:
            stored = system.warm_passages(list(texts))
        seconds = time.perf_counter() - start
        tokens = stored.tokens if isinstance(system, KVBoost) else None
        out[name] = {"seconds": seconds, "passages": len(texts), "tokens": tokens}
    return out


def cache_mib(system: Any) -> float:
    """KV held in the system's memory cache now."""
    held = system.stats().cache.bytes if isinstance(system, KVBoost) else system.cache_bytes()
    return float(held) / 2**20


def machine(base: KVBoost) -> dict[str, Any]:
    """What the numbers were measured on."""
    device = base.model.device
    cpu = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
        platform.processor() or platform.machine(),
    )
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": round(pages / 2**30, 1),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "dtype": str(base.model.dtype).replace("torch.", ""),
        "peak_memory_method": method(device),
    }


def _cpuinfo() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read().splitlines()
    except OSError:
        return []
