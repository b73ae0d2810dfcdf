"""An ordered list of tiers — memory, then disk, then the shared Redis (or Redis Cluster)
tier — behind one store. Hits promote upward, memory evictions spill to the local tier
that keeps them, passages are written through to disk, and passages and exact prefix
blocks are written through to the shared tier (in the background), so a corpus warmed on
one machine serves every other. Session KV stays local. A request's lookups go in batches
(``get_many``, ``contains_many``): each tier is asked once for what the tiers above it
lack, so the shared tier costs one round trip per batch, not one per entry. A new tier is
a class that implements ``Tier`` and a line in ``open_tiers``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvboost_rag.core.caller_warnings import warn
from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.store.catalogue import Catalogue, SharedCatalogue
from kvboost_rag.core.store.disk import DiskStats, DiskStore
from kvboost_rag.core.store.memory import Entry, MemoryStore, StoreStats
from kvboost_rag.core.store.remote import RemoteStats, RemoteStore

Item = tuple[bytes, tuple[int, ...] | None]  # a key and the tokens its entry must hold


class Tier(Protocol):
    """One level of the store. Lookups answer per item, in order; writes may be queued."""

    name: str  # its field in ``CacheStats`` ("memory", "disk", "remote")
    shared: bool  # every replica reads it: session KV (``share=False``) never goes there
    batched: bool  # each call is a round trip: asked once per batch, never entry by entry
    write_through: bool  # every put is copied to it, not only ``persist`` ones

    def get_many(self, items: Sequence[Item]) -> list[Entry | None]:
        """Per ``(key, tokens)``, the entry under ``key`` whose tokens equal ``tokens``
        (``None``: not compared), else None."""
        ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held or queued (no KV read)."""
        ...

    def put_later(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        """Store the entry, now or in the background (``flush`` waits); a key already held
        may be skipped. ``approximate``: passage or session KV, for a lossy codec."""
        ...

    def spill(self, key: bytes, entry: Entry) -> None:
        """Keep an entry the memory tier evicted, if this tier keeps evictions; called under
        the memory tier's lock, so it never raises (a failure is reported)."""
        ...

    def flush(self) -> None:
        """Wait until queued writes are made; raise a failed one the tier cannot lose."""
        ...

    def stats(self) -> Any: ...

    def catalogue(self) -> Catalogue | SharedCatalogue | None:
        """Where this tier lists the passages it holds, for the passage index; None if not."""
        ...


@dataclass(frozen=True)
class CacheStats:
    memory: StoreStats
    disk: DiskStats | None  # None without a cache_dir
    remote: RemoteStats | None  # None without a remote_url


class TieredStore:
    """The store the caches use: ``tiers[0]`` is the memory tier (its ``put`` answers
    whether the entry fit), the rest follow in the order they are asked."""

    def __init__(self, max_bytes: int, lower: Sequence[Tier] = ()) -> None:
        self.memory = MemoryStore(max_bytes, on_evict=self._spill)
        self.tiers: tuple[Tier, ...] = (self.memory, *lower)

    def tier(self, name: str) -> Tier | None:
        """The tier of that name (``"disk"``, ``"remote"``), None when it is not open."""
        return next((tier for tier in self.tiers if tier.name == name), None)

    def get(self, key: bytes, tokens: tuple[int, ...] | None) -> Entry | None:
        return self.get_many([(key, tokens)])[0]

    def get_many(self, items: Sequence[Item], share: bool = True) -> list[Entry | None]:
        """Per ``(key, tokens)``, the entry from the first tier holding it: each tier is
        asked once, for what the tiers above it lack. Hits are promoted into the tiers
        above. ``share=False``: not the shared tier (KV that is never written there)."""
        found: list[Entry | None] = [None] * len(items)
        rest = list(range(len(items)))
        for depth, tier in enumerate(self._asked(share)):
            if not rest:
                break
            for i, entry in zip(rest, tier.get_many([items[i] for i in rest])):
                if entry is not None:
                    self._promote(depth, items[i][0], entry)
                    found[i] = entry
            rest = [i for i in rest if found[i] is None]
        return found

    def get_chain(self, items: Sequence[Item], share: bool = True) -> list[Entry]:
        """The entries of the longest leading run of ``items`` some tier holds (a chain of
        prefix blocks: a missing one ends it). Tiers without round trips are walked entry
        by entry (nothing past the chain's end is read from disk); a batched tier is asked
        once, from the first entry the tiers above it lack to the end of ``items``."""
        tiers = self._asked(share)
        asked: dict[int, tuple[int, list[Entry | None]]] = {}  # depth -> (from, answers)
        chain: list[Entry] = []
        for i, (key, tokens) in enumerate(items):
            entry = None
            for depth, tier in enumerate(tiers):
                if not tier.batched:
                    entry = tier.get_many([(key, tokens)])[0]
                else:
                    if depth not in asked:
                        asked[depth] = (i, tier.get_many(items[i:]))
                    start, answers = asked[depth]
                    entry = answers[i - start]
                if entry is not None:
                    self._promote(depth, key, entry)
                    break
            if entry is None:
                break
            chain.append(entry)
        return chain

    def __contains__(self, key: bytes) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[bytes], share: bool = True) -> list[bool]:
        """Whether some tier holds each key (no KV read; it may still be evicted before
        use): each tier is asked, in one batch, for those the tiers above it lack."""
        held = [False] * len(keys)
        rest = list(range(len(keys)))
        for tier in self._asked(share):
            if not rest:
                break
            for i, h in zip(rest, tier.contains_many([keys[i] for i in rest])):
                held[i] = h
            rest = [i for i in rest if not held[i]]
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
        """Store in memory and (in the background) the write-through tiers; with
        ``persist`` in every tier (not only when evicted). ``approximate``: passage or
        session KV, which the lower tiers may store under a lossy codec. ``share=False``
        keeps it out of the shared tier. Answers whether memory could hold it."""
        for tier in self._asked(share)[1:]:
            if persist or tier.write_through:
                tier.put_later(key, tokens, kv, approximate)
        return self.memory.put(key, tokens, kv, approximate)

    def flush(self) -> None:
        """Wait until queued writes are made, the lowest tier first; raises a failed disk write."""
        for tier in reversed(self.tiers):
            tier.flush()

    def clear(self) -> None:
        """Empty the memory tier; the disk and shared tiers are persistent by design."""
        self.memory.clear()

    def stats(self) -> CacheStats:
        stats = {tier.name: tier.stats() for tier in self.tiers}
        return CacheStats(stats["memory"], stats.get("disk"), stats.get("remote"))

    def catalogues(self) -> list[Catalogue | SharedCatalogue]:
        """The passage catalogues of the tiers that keep one."""
        return [found for tier in self.tiers if (found := tier.catalogue()) is not None]

    def _asked(self, share: bool) -> tuple[Tier, ...]:
        return self.tiers if share else tuple(t for t in self.tiers if not t.shared)

    def _promote(self, depth: int, key: bytes, entry: Entry) -> None:
        """A hit in the tier at ``depth``, kept in the tiers above it (memory now, the
        others in the background)."""
        for tier in self.tiers[:depth]:
            tier.put_later(key, entry.tokens, entry.kv, entry.approximate)

    def _spill(self, key: bytes, entry: Entry) -> None:
        for tier in self.tiers[1:]:
            tier.spill(key, entry)


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
    lower = [tier for tier in (disk, remote) if tier is not None]
    return TieredStore(config.max_cache_bytes, lower)


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
