"""The passage cache's lookup reads the tiers in batches: every passage's own variant in
one, the nearest-prefix fallback's in two more (which candidates hold one, then their KV),
with the same answers as a passage-by-passage walk."""

from collections.abc import Sequence

import torch

from kvboost_rag.core.reuse.passages import PassageCache
from kvboost_rag.core.store.memory import Entry
from kvboost_rag.core.store.tiers import TieredStore


class BatchLog(TieredStore):
    """Records each batch the caches ask of the tiers."""

    def __init__(self) -> None:
        super().__init__(10**9)
        self.batches: list[tuple[str, int]] = []

    def get_many(
        self, items: Sequence[tuple[bytes, tuple[int, ...] | None]], share: bool = True
    ) -> list[Entry | None]:
        self.batches.append(("get", len(items)))
        return super().get_many(items, share)

    def contains_many(self, keys: Sequence[bytes], share: bool = True) -> list[bool]:
        self.batches.append(("contains", len(keys)))
        return super().contains_many(keys, share)


def kv(tag: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 1, 2, 2), tag), torch.full((1, 1, 2, 2), tag))]


def store_variant(cache: PassageCache, prefix, passage: tuple[int, ...], tag: float) -> None:
    cache.store.put(cache.key(prefix, passage), prefix.tokens + passage, kv(tag))


def tag_of(found) -> float | None:
    return None if found[1] is None else float(found[1][0][0].flatten()[0])


def test_own_variants_in_one_batch_and_the_fallback_in_two() -> None:
    store = BatchLog()
    cache = PassageCache(store, None, b"model", [1], nearest=True)  # type: ignore[arg-type]
    own, near, far = cache.prefix([9, 5, 6]), cache.prefix([9, 5, 7]), cache.prefix([3])
    passages = [(20, 21), (30, 31), (40, 41), (50, 51)]
    store_variant(cache, own, passages[0], 1.0)
    store_variant(cache, near, passages[1], 2.0)
    store_variant(cache, far, passages[1], 3.0)  # farther: not chosen
    store_variant(cache, far, passages[2], 4.0)
    for prefix in (far, near):  # known prefixes, the nearest most recently
        cache.find(prefix, [])
    store.batches.clear()
    found = cache.find(own, passages)
    assert [tag_of(f) for f in found] == [1.0, 2.0, 4.0, None]
    assert [f[0] for f in found] == [own, near, far, None]
    # One batch for the four own variants; then, for the three missing, one asking which
    # of the two other prefixes and the anchor hold a variant and one reading the chosen two.
    assert store.batches == [("get", 4), ("contains", 9), ("get", 2)]


def test_a_variant_gone_before_its_read_falls_back_to_the_next_candidate() -> None:
    store = BatchLog()
    cache = PassageCache(store, None, b"model", [1], nearest=True)  # type: ignore[arg-type]
    own, near, far = cache.prefix([9, 5, 6]), cache.prefix([9, 5, 7]), cache.prefix([3])
    passage = (20, 21)
    store_variant(cache, near, passage, 2.0)
    store_variant(cache, far, passage, 3.0)
    for prefix in (far, near):
        cache.find(prefix, [])
    held = store.contains_many

    def evict_after_asking(keys: Sequence[bytes], share: bool = True) -> list[bool]:
        answer = held(keys, share)
        store.memory.clear()  # both gone from memory...
        store_variant(cache, far, passage, 3.0)  # ...and only the farther one stored again
        return answer

    store.contains_many = evict_after_asking  # type: ignore[method-assign]
    (found,) = cache.find(own, [passage])
    assert (found[0], tag_of(found)) == (far, 3.0)
