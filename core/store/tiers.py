"""Memory, then disk, then the shared Redis tier: hits promote upward, memory evictions
spill to disk, passages are written through to disk, and passages and exact prefix blocks
are written through to the shared tier (in the background), so a corpus warmed on one
machine serves every other. Session KV stays local. A request's lookups go in batches
(``get_many``, ``contains_many``): each tier is asked once for what the tiers above it
lack, so the shared tier costs one round trip per batch, not one per entry."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvboost_rag.core.caller_warnings import warn
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
        holding it: memory, then disk, then the shared tier for what is still missing, in
        one batch (one round trip per server or cluster node). Hits below memory are
        promoted. ``share=False``: not the shared tier (KV that is never written there)."""
        found = [self._local(key, tokens) for key, tokens in items]
        rest = [i for i, entry in enumerate(found) if entry is None]
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
        prefix blocks: a missing one ends it). The local tiers are walked entry by entry
        (nothing past the chain's end is read from disk); the shared tier is asked once,
        from the first entry they lack to the end of ``items``, in one batch."""
        chain: list[Entry] = []
        shared: list[Entry | None] | None = None  # its answers from ``gap`` on
        gap = 0
        for i, (key, tokens) in enumerate(items):
            entry = self._local(key, tokens)
            if entry is None and share and self.remote is not None:
                if shared is None:
                    gap, shared = i, self.remote.get_many(items[i:])
                if (entry := shared[i - gap]) is not None:
                    self._promote(key, entry)
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

    def _local(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        """The entry from memory, else from disk (then kept in memory)."""
        entry = self.memory.get(key, tokens)
        if entry is None and self.disk is not None:
            if (entry := self.disk.get(key, tokens)) is not None:
                self.memory.put(key, entry.tokens, entry.kv, entry.approximate)
        return entry

    def _promote(self, key: bytes, entry: Entry) -> None:
        """A shared-tier hit, kept in memory and (in the background) on disk."""
        self.memory.put(key, entry.tokens, entry.kv, entry.approximate)
        if self.disk is not None and key not in self.disk:
            self.disk.put_later(key, entry.tokens, entry.kv, entry.approximate)

    def _spill(self, key: bytes, entry: Entry) -> None:
        assert self.disk is not None
        if key not in self.disk:  # a failed write must not fail the request evicting it
            self.disk.put_or_report(key, entry.tokens, entry.kv, entry.approximate)


def open_tiers(config: KVBoostConfig, fingerprint: bytes) -> TieredStore:
    """The tiers ``config`` asks for, keyed by the model's ``fingerprint``."""
    disk = remote = None
    secret = config.secret()
    if config.cache_dir is not None:
        disk = _disk(config, fingerprint, secret)
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


def _disk(config: KVBoostConfig, fingerprint: bytes, secret: bytes | None) -> DiskStore | None:
    """The disk tier, or None with one warning when ``cache_dir`` cannot hold one (a file,
    a folder that cannot be made): then every request and warm keeps KV in memory, as
    without a ``cache_dir``, instead of failing at each read and write."""
    assert config.cache_dir is not None
    try:
        return DiskStore(
            config.cache_dir, fingerprint, config.max_disk_bytes, config.kv_codec, secret
        )
    except OSError as error:
        warn(
            f"kvboost-rag: cache_dir {str(config.cache_dir)!r} cannot hold the cache "
            f"({error.strerror or error}); the disk tier is off: KV is kept in memory only"
        )
        return None
