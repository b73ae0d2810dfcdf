import torch

from kvboost_rag.core.model.kv import kv_nbytes
from kvboost_rag.core.store.memory import MemoryStore


def _kv(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(1, 2, n, 4), torch.zeros(1, 2, n, 4))]


def test_evicts_least_recently_used_under_budget() -> None:
    size = kv_nbytes(_kv(4))
    store = MemoryStore(max_bytes=2 * size)
    store.put(b"a", (1,), _kv(4))
    store.put(b"b", (2,), _kv(4))
    assert store.get(b"a", (1,)) is not None  # a is now most recent
    store.put(b"c", (3,), _kv(4))
    assert b"b" not in store and b"a" in store and b"c" in store
    stats = store.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 2 * size, 1)


def test_token_mismatch_is_a_miss_not_a_hit() -> None:
    store = MemoryStore(max_bytes=10**6)
    store.put(b"k", (1, 2), _kv(2))
    assert store.get(b"k", (1, 3)) is None
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.collisions) == (0, 1, 1)


def test_entry_over_whole_budget_is_refused() -> None:
    store = MemoryStore(max_bytes=10)
    assert store.put(b"k", (1,), _kv(4)) is False
    assert store.stats().entries == 0


def test_a_writer_survives_an_item_that_raises() -> None:
    from kvboost_rag.core.store.writer import Writer

    done: list[int] = []

    def apply(item: int) -> None:
        if item == 1:
            raise RuntimeError("boom")
        done.append(item)

    writer: Writer[int] = Writer("test-writer", apply)
    for item in range(3):
        writer.submit(item)
    writer.join()  # returns: the failing item neither stops the thread nor blocks join
    assert done == [0, 2]
    writer.close()
    assert not writer.submit(4)
