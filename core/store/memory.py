"""In-memory KV store: least-recently-used entries under a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvboost_rag.core.model.kv import LayerKV, kv_nbytes


@dataclass(frozen=True)
class Entry:
    """One cached span: the token ids it covers and their per-layer KV."""

    tokens: tuple[int, ...]  # compared on every hit, so a key collision is never served
    kv: LayerKV
    nbytes: int
    approximate: bool = False  # passage or session KV: a lossy storage codec may apply


@dataclass(frozen=True)
class StoreStats:
    entries: int  # entries held now
    bytes: int  # bytes of KV held now
    max_bytes: int  # the budget
    hits: int  # lookups that returned an entry
    misses: int  # lookups that found nothing (or a token mismatch)
    evictions: int  # entries dropped to stay under the budget
    collisions: int  # keys whose stored tokens differed from the requested ones


class MemoryStore:
    """LRU map from key to ``Entry``. Thread-safe: every method takes the store's lock.
    The first of ``TieredStore``'s tiers (its ``Tier`` protocol: writes are made at once)."""

    name = "memory"
    shared = False
    batched = False
    write_through = True

    def __init__(
        self, max_bytes: int, on_evict: Callable[[bytes, Entry], None] | None = None
    ) -> None:
        self.max_bytes = max_bytes
        self._on_evict = on_evict  # called (under the lock) with each evicted entry
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._collisions = 0

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        """The entry under ``key`` if its stored tokens equal ``tokens`` (``None``: the
        caller compares them itself)."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and tokens is not None and entry.tokens != tokens:
                self._collisions += 1
                entry = None
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def get_many(self, items: Sequence[tuple[bytes, tuple[int, ...] | None]]) -> list[Entry | None]:
        return [self.get(key, tokens) for key, tokens in items]

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._entries for key in keys]

    def put(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> bool:
        """Store an entry; returns False when it is larger than the whole budget."""
        entry = Entry(tokens, kv, kv_nbytes(kv), approximate)
        with self._lock:
            if entry.nbytes > self.max_bytes:
                return False
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = entry
            self._bytes += entry.nbytes
            while self._bytes > self.max_bytes:
                old_key, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
                self._evictions += 1
                if self._on_evict is not None:
                    self._on_evict(old_key, evicted)
            return True

    def put_later(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        self.put(key, tokens, kv, approximate)

    def spill(self, key: bytes, entry: Entry) -> None:
        """Nothing: the memory tier is the one that evicts."""

    def flush(self) -> None:
        """Nothing: every write was made when it was asked for."""

    def catalogue(self) -> None:
        """None: what memory holds is indexed as it is stored."""
        return None

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                len(self._entries),
                self._bytes,
                self.max_bytes,
                self._hits,
                self._misses,
                self._evictions,
                self._collisions,
            )
