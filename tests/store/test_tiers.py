"""The ``Tier`` protocol: memory, disk, a Redis server and a Redis Cluster answer it alike,
and ``TieredStore`` walks any ordered list of tiers (a new tier plugs in without touching
the store): each tier is asked once per batch for what the tiers above it lack, hits
promote upward, session KV never reaches a shared tier, a batched tier is asked once per
chain."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.store.catalogue import Catalogue, SharedCatalogue
from kvboost_rag.core.store.disk import DiskStore
from kvboost_rag.core.store.memory import Entry, MemoryStore
from kvboost_rag.core.store.remote import RemoteStore
from kvboost_rag.core.store.tiers import Item, Tier, TieredStore

MODEL = b"model-a"


def kv(tag: float) -> LayerKV:
    return [(torch.full((1, 1, 3, 2), tag), torch.full((1, 1, 3, 2), -tag))]


def key(i: int) -> bytes:
    return bytes([i]) * 16


def ids(i: int) -> tuple[int, ...]:
    return (i,) * 3  # as many token ids as kv() has positions


def tag(entry: Entry | None) -> float | None:
    return None if entry is None else float(entry.kv[0][0].flatten()[0])


@pytest.fixture(params=["memory", "disk", "server", "cluster"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    if request.param == "memory":
        return MemoryStore(10**9)
    if request.param == "disk":
        return DiskStore(tmp_path, MODEL, 10**9)
    fixture = "redis_server" if request.param == "server" else "redis_cluster"
    return RemoteStore(request.getfixturevalue(fixture).url, MODEL, timeout=10.0)


def test_every_tier_answers_the_protocol_alike(tier: Tier) -> None:
    tier.put_later(key(1), (1, 2, 3), kv(1.0), approximate=False)
    tier.put_later(key(2), (4, 5, 6), kv(2.0), approximate=True)
    tier.flush()
    assert tier.contains_many([key(1), key(3), key(2)]) == [True, False, True]
    found = tier.get_many([(key(2), (4, 5, 6)), (key(1), None), (key(3), None), (key(1), (9,))])
    assert [tag(e) for e in found] == [2.0, 1.0, None, None]  # other tokens: not served
    assert found[0] is not None and found[0].tokens == (4, 5, 6)
    assert tier.stats() is not None and tier.name in {"memory", "disk", "remote"}
    assert isinstance(tier.catalogue(), (Catalogue, SharedCatalogue, type(None)))


class DictTier:
    """A tier the store was not written for: a dict, logging each batch it is asked."""

    batched = True
    write_through = True

    def __init__(self, name: str, shared: bool) -> None:
        self.name, self.shared = name, shared
        self.entries: dict[bytes, Entry] = {}
        self.asked: list[list[bytes]] = []

    def get_many(self, items: Sequence[Item]) -> list[Entry | None]:
        self.asked.append([k for k, _ in items])
        found = [self.entries.get(k) for k, _ in items]
        return [
            e if e and (t is None or e.tokens == t) else None for e, (_, t) in zip(found, items)
        ]

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        self.asked.append(list(keys))
        return [k in self.entries for k in keys]

    def put_later(
        self, key: bytes, tokens: tuple[int, ...], kv: LayerKV, approximate: bool = False
    ) -> None:
        self.entries[key] = Entry(tokens, kv, 0, approximate)

    def spill(self, key: bytes, entry: Entry) -> None:
        pass

    def flush(self) -> None:
        pass

    def stats(self) -> int:
        return len(self.entries)

    def catalogue(self) -> None:
        return None


def test_a_new_tier_plugs_in_and_is_asked_once_per_batch_for_what_is_above_missing(
    tmp_path: Path,
) -> None:
    disk = DiskStore(tmp_path, MODEL, 10**9)
    far = DictTier("far", shared=True)
    store = TieredStore(10**9, [disk, far])
    far.put_later(key(1), ids(1), kv(1.0))
    far.put_later(key(2), ids(2), kv(2.0))
    disk.put_later(key(3), ids(3), kv(3.0))
    disk.flush()
    store.put(key(4), ids(4), kv(4.0))  # memory, and written through to `far`
    assert key(4) in far.entries and key(4) not in disk  # disk keeps persist / evictions
    far.asked.clear()
    items: list[Item] = [(key(i), ids(i)) for i in (1, 2, 3, 4, 5)]
    assert [tag(e) for e in store.get_many(items)] == [1.0, 2.0, 3.0, 4.0, None]
    assert far.asked == [[key(1), key(2), key(5)]]  # one batch, only what was missing
    disk.flush()
    assert key(1) in store.memory and key(1) in disk  # promoted into both tiers above
    far.asked.clear()
    assert store.get_many([(key(5), ids(5))], share=False) == [None]
    assert store.contains_many([key(5)], share=False) == [False]
    assert far.asked == []  # a shared tier is never asked for session KV
    store.put(key(6), ids(6), kv(6.0), share=False)
    assert key(6) not in far.entries  # nor written to


def test_a_batched_tier_is_asked_once_per_chain_from_the_first_gap(tmp_path: Path) -> None:
    far = DictTier("far", shared=True)
    store = TieredStore(10**9, [DiskStore(tmp_path, MODEL, 10**9), far])
    store.put(key(1), ids(1), kv(1.0))
    for i in (2, 3):
        far.put_later(key(i), ids(i), kv(float(i)))
    far.asked.clear()
    chain = store.get_chain([(key(i), ids(i)) for i in (1, 2, 3, 4, 5)])
    assert [tag(e) for e in chain] == [1.0, 2.0, 3.0]  # key 4 missing ends it
    assert far.asked == [[key(2), key(3), key(4), key(5)]]


def test_memory_evictions_spill_into_the_tier_that_keeps_them(tmp_path: Path) -> None:
    disk = DiskStore(tmp_path, MODEL, 10**9)
    far = DictTier("far", shared=True)
    one = kv(1.0)
    store = TieredStore(sum(t.numel() * t.element_size() for t in one[0]), [disk, far])
    store.put(key(1), ids(1), one, share=False)
    store.put(key(2), ids(2), kv(2.0), share=False)  # evicts key 1 from memory
    assert key(1) not in store.memory and key(1) in disk and key(1) not in far.entries
    assert [tag(e) for e in store.get_many([(key(1), ids(1))])] == [1.0]
