"""Memory, then disk, then the shared Redis tier: hits promote upward, memory evictions
spill to disk, passages are written through to disk, and passages and exact prefix blocks
are written through to the shared tier (in the background), so a corpus warmed on one
machine serves every other. Session KV stays local. A request's lookups go in batches
(``get_many``, ``contains_many``): each tier is asked once for what the tiers above it
lack, so the shared tier costs one round trip per batch, not one per entry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.store.disk import DiskStats, DiskStore
from kvboost_rag.core.store.memory import Entry, MemoryStore, StoreStats
from kvboost_rag.core.store.remote import RemoteStats, RemoteStore


@dataclass(frozen=True)
class CacheStats:
    memory: StoreStats
    disk: DiskStats | None  # None without a cache_dir
    remote: RemoteStats | None  # None without a remote_url


class TieredStore:
    """The store the caches use. ``MemoryStore``'s interface plus ``persist`` and the
    batched ``get_many`` / ``get_chain`` / ``contains_many``."""

    def __init__(
        self, max_bytes: int, disk: DiskStore | None, remote: RemoteStore | None = None
    ) -> None:
        self.disk = disk
        self.remote = remote
        self.memory = MemoryStore(max_bytes, on_evict=self._spill if disk else None)

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        return self.get_many([(key, tokens)])[0]

    def get_many(
        self, items: Sequence[tuple[bytes, tuple[int, ...] | None]], share: bool = True
    ) -> list[Entry | None]:
        """Per ``(key, tokens)``, what ``MemoryStore.get`` answers, from the first tier
        holding it: memory, then disk for the rest, then the shared tier for what is
        still missing, in one batch (one round trip per server or cluster node). Hits
        below memory are promoted. ``share=False``: not the shared tier (KV that is
        never written there)."""
        found = [self.memory.get(key, tokens) for key, tokens in items]
        if self.disk is not None:
            for i in _missing(found):
                key, tokens = items[i]
                if (entry := self.disk.get(key, tokens)) is not None:
                    self.memory.put(key, entry.tokens, entry.kv, entry.approximate)
                    found[i] = entry
        rest = _missing(found)
        if share and self.remote is not None and rest:
            for i, entry in zip(rest, self.remote.get_many([items[i] for i in rest])):
                if entry is not None:
                    self._promote(items[i][0], entry)
                    found[i] = entry
        return found

    def get_chain(
        self, items: Sequence[tuple[bytes, tuple[int, ...] | None]], share: bool = True
    ) -> list[Entry]:
        """The entries of the longest leading run of ``items`` some tier holds (a chain of
        prefix blocks: a missing one ends it), read as ``get_many`` reads: in one batch.
        Entries after a gap are read too: a chain's blocks are used together, so the
        tiers' LRU drops them together and such reads are rare, where a walk block by
        block costs a round trip each."""
        chain: list[Entry] = []
        for entry in self.get_many(items, share):
            if entry is None:
                break
            chain.append(entry)
        return chain

    def __contains__(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes], share: bool = True) -> list[bool]:
        """Whether some tier holds each key (no KV read; it may still be evicted before
        use): the shared tier is asked, in one batch, for those the local tiers lack."""
        held = [key in self.memory or (self.disk is not None and key in self.disk) for key in keys]
        rest = [i for i, h in enumerate(held) if not h]
        if share and self.remote is not None and rest:
            for i, h in zip(rest, self.remote.contains_many([keys[i] for i in rest])):
                held[i] = h
        return held

    def put(
        self,
        key: bytes,
        tokens: tuple[int, ...],
        kv: LayerKV,
        persist: bool = False,
        approximate: bool = False,
        share: bool = True,
    ) -> bool:
        """Store in memory and (in the background) the shared tier; with ``persist`` also
        on disk now (not only when evicted). ``approximate``: passage or session KV, which
        the lower tiers may store under a lossy codec. ``share=False`` keeps it out of the
        shared tier."""
        if persist and self.disk is not None and key not in self.disk:
            self.disk.put_later(key, tokens, kv, approximate)
        if share and self.remote is not None:
            self.remote.put_later(key, tokens, kv, approximate)
        return self.memory.put(key, tokens, kv, approximate)

    def flush(self) -> None:
        """Wait until queued disk and shared-tier writes are made; raises a failed disk write."""
        if self.remote is not None:
            self.remote.flush()
        if self.disk is not None:
            self.disk.flush()

    def clear(self) -> None:
        """Empty the memory tier; the disk and shared tiers are persistent by design."""
        self.memory.clear()

    def stats(self) -> CacheStats:
        return CacheStats(
            self.memory.stats(),
            self.disk.stats() if self.disk else None,
            self.remote.stats() if self.remote else None,
        )

    def _promote(self, key: bytes, entry: Entry) -> None:
        """A shared-tier hit, kept in memory and (in the background) on disk."""
        self.memory.put(key, entry.tokens, entry.kv, entry.approximate)
        if self.disk is not None and key not in self.disk:
            self.disk.put_later(key, entry.tokens, entry.kv, entry.approximate)

    def _spill(self, key: bytes, entry: Entry) -> None:
        assert self.disk is not None
        if key not in self.disk:  # a failed write must not fail the request evicting it
            self.disk.put_or_report(key, entry.tokens, entry.kv, entry.approximate)


def _missing(found: list[Entry | None]) -> list[int]:
    return [i for i, entry in enumerate(found) if entry is None]


def open_tiers(config: KVBoostConfig, fingerprint: bytes) -> TieredStore:
    """The tiers ``config`` asks for, keyed by the model's ``fingerprint``."""
    disk = remote = None
    secret = config.secret()
    if config.cache_dir is not None:
        disk = DiskStore(
            config.cache_dir, fingerprint, config.max_disk_bytes, config.kv_codec, secret
        )
    if config.remote_url is not None:
        remote = RemoteStore(
            config.remote_url,
            fingerprint,
            namespace=config.remote_namespace,
            timeout=config.remote_timeout,
            kv_codec=config.kv_codec,
            secret=secret,
        )
    return TieredStore(config.max_cache_bytes, disk, remote)
