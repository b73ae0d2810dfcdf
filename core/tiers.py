"""Memory in front of disk: hits promote to memory, evictions spill to disk, passages are
written through so a warmed corpus survives restarts and is shared by processes."""

from __future__ import annotations

from dataclasses import dataclass

from kvboost_rag.core.disk import DiskStats, DiskStore
from kvboost_rag.core.kv import LayerKV
from kvboost_rag.core.store import Entry, MemoryStore, StoreStats


@dataclass(frozen=True)
class CacheStats:
    memory: StoreStats
    disk: DiskStats | None  # None without a cache_dir


class TieredStore:
    """The store the caches use. Same interface as ``MemoryStore`` plus ``persist``."""

    def __init__(self, max_bytes: int, disk: DiskStore | None) -> None:
        self.disk = disk
        self.memory = MemoryStore(max_bytes, on_evict=self._spill if disk else None)

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        entry = self.memory.get(key, tokens)
        if entry is not None or self.disk is None:
            return entry
        entry = self.disk.get(key, tokens)
        if entry is not None:
            self.memory.put(key, entry.tokens, entry.kv)
        return entry

    def __contains__(self, key: bytes) -> bool:
        return key in self.memory or (self.disk is not None and key in self.disk)

    def put(self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, persist: bool = False) -> bool:
        """Store in memory; with ``persist`` also on disk now (not only when evicted)."""
        if persist and self.disk is not None and key not in self.disk:
            self.disk.put_later(key, tokens, kv)
        return self.memory.put(key, tokens, kv)

    def flush(self) -> None:
        """Wait until queued disk writes are on disk."""
        if self.disk is not None:
            self.disk.flush()

    def clear(self) -> None:
        """Empty the memory tier; the disk tier is persistent by design."""
        self.memory.clear()

    def stats(self) -> CacheStats:
        return CacheStats(self.memory.stats(), self.disk.stats() if self.disk else None)

    def _spill(self, key: bytes, entry: Entry) -> None:
        assert self.disk is not None
        if key not in self.disk:
            self.disk.put(key, entry.tokens, entry.kv)
