"""The exact prefix cache: its index finds matches without reading KV it does not use."""

from collections.abc import Sequence
from pathlib import Path

import torch
from conftest import make_model
from hypothesis import given, settings
from hypothesis import strategies as st

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.kv import kv_nbytes
from kvboost_rag.core.reuse.prefix import PrefixCache
from kvboost_rag.core.store.disk import DiskStore
from kvboost_rag.core.store.memory import Entry
from kvboost_rag.core.store.tiers import TieredStore

BLOCK = 4
FINGERPRINT = b"model-a"


class CountingStore(TieredStore):
    """Records every key whose KV is read (a lookup that found it), and each batch asked."""

    def __init__(self, max_bytes: int, disk: DiskStore | None = None) -> None:
        super().__init__(max_bytes, [disk] if disk else [])
        self.reads: list[bytes] = []
        self.batches: list[list[bytes]] = []

    def get_many(
        self, items: Sequence[tuple[bytes, tuple[int, ...] | None]], share: bool = True
    ) -> list[Entry | None]:
        found = super().get_many(items, share)
        self.batches.append([key for key, _ in items])
        self.reads += [key for (key, _), entry in zip(items, found) if entry is not None]
        return found

    def get_chain(
        self, items: Sequence[tuple[bytes, tuple[int, ...] | None]], share: bool = True
    ) -> list[Entry]:
        chain = super().get_chain(items, share)
        self.batches.append([key for key, _ in items])
        self.reads += [key for (key, _), _ in zip(items, chain)]
        return chain


def cache_for(tokens: Sequence[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV whose keys hold each position's token id and values its position, so a matched
    slice shows which stored stream and positions it came from."""
    n = len(tokens)
    keys = torch.tensor(tokens, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3)
    values = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1).expand(1, 2, n, 3)
    return [(keys.clone(), values.clone()) for _ in range(2)]


def store_stream(prefix: PrefixCache, tokens: list[int]) -> None:
    prefix.insert(tokens, cache_for(tokens), len(tokens))


def matched_tokens(match) -> list[int]:
    return [int(t) for block in match.blocks for t in block[0][0][0, 0, :, 0].tolist()]


def block_bytes() -> int:
    return kv_nbytes([(t, t) for t in [torch.zeros(1, 2, BLOCK, 3)] * 2])


def test_matching_among_siblings_reads_only_the_chosen_one() -> None:
    store = CountingStore(10**9)
    prefix = PrefixCache(store, FINGERPRINT, BLOCK)
    for i in range(6):  # six full blocks under one parent, and a tail
        store_stream(prefix, [1, 2, 3, 4, 10 + i, 20, 30, 40])
    store_stream(prefix, [1, 2, 3, 4, 12, 20, 50])
    store.reads.clear()
    hits = store.stats().memory.hits
    match = prefix.match([1, 2, 3, 4, 13, 20, 30, 99, 5])
    assert match.length == 7 and matched_tokens(match) == [1, 2, 3, 4, 13, 20, 30]
    assert store.reads == prefix.keys([1, 2, 3, 4, 13, 20, 30, 40])  # the chosen blocks only
    assert store.stats().memory.hits - hits == 2  # one hit per block used


def test_the_chain_of_full_blocks_is_read_in_one_batch() -> None:
    store = CountingStore(10**9)
    prefix = PrefixCache(store, FINGERPRINT, BLOCK)
    stream = list(range(1, 18))  # four full blocks and a 1-token tail
    store_stream(prefix, stream)
    store.batches.clear()
    assert prefix.match(stream).length == 17
    assert store.batches == [prefix.keys(stream), [store.batches[1][0]]]  # chain, then tail


def test_tail_matches_to_the_token() -> None:
    store = CountingStore(10**9)
    prefix = PrefixCache(store, FINGERPRINT, BLOCK)
    stream = list(range(1, 12))  # two full blocks and a 3-token tail
    store_stream(prefix, stream)
    match = prefix.match([*stream[:10], 77, 78])
    assert match.length == 10 and matched_tokens(match) == stream[:10]
    assert len(store.reads) == 3
    assert prefix.match(stream).length == 11
    assert prefix.match([*stream, 5, 6]).length == 11


def test_block_evicted_from_every_tier_ends_the_match_before_it() -> None:
    store = CountingStore(3 * block_bytes())  # room for three blocks, no disk
    prefix = PrefixCache(store, FINGERPRINT, BLOCK)
    stream = list(range(1, 13))
    store_stream(prefix, stream)
    first, second, third = prefix.keys(stream)
    store.get(first, None), store.get(third, None)  # the second is least recently used
    store.put(b"other", (0,), [(torch.zeros(1, 2, BLOCK, 3),) * 2] * 2)  # evicts it
    assert second not in store
    match = prefix.match(stream)
    assert match.length == BLOCK and matched_tokens(match) == stream[:BLOCK]
    store.reads.clear()
    assert prefix.match(stream).length == BLOCK
    assert second not in store.reads and second not in prefix._blocks  # dropped from the index
    store_stream(prefix, stream)  # stored again, so the chain is whole again
    assert prefix.match(stream).length == 12


def test_evicted_tail_falls_back_to_the_next_best_child() -> None:
    store = CountingStore(10**9)
    prefix = PrefixCache(store, FINGERPRINT, BLOCK)
    store_stream(prefix, [1, 2, 3, 4, 5, 6, 7, 8])  # a full child sharing two tokens
    store_stream(prefix, [1, 2, 3, 4, 5, 6, 9])  # the tail shares three
    store.memory.clear()  # every block's KV is gone; only the index remains
    store_stream(prefix, [1, 2, 3, 4, 5, 6, 7, 8])  # the first block and the full child again
    match = prefix.match([1, 2, 3, 4, 5, 6, 9, 0])
    assert match.length == 6 and matched_tokens(match) == [1, 2, 3, 4, 5, 6]


def test_blocks_on_disk_from_an_earlier_process_are_found(tmp_path: Path) -> None:
    stream = list(range(1, 13))
    earlier = TieredStore(block_bytes(), [DiskStore(tmp_path, FINGERPRINT, 10**9)])
    store_stream(PrefixCache(earlier, FINGERPRINT, BLOCK), stream)  # two blocks spill to disk
    store = CountingStore(10**9, DiskStore(tmp_path, FINGERPRINT, 10**9))  # a restart
    match = PrefixCache(store, FINGERPRINT, BLOCK).match(stream)
    assert match.length == 2 * BLOCK and matched_tokens(match) == stream[: 2 * BLOCK]
    assert store.stats().disk.hits == 2


# -- against a plain longest-prefix cache -------------------------------------------------

PIECE = st.sampled_from(["The depot ", "ships ", "crates ", "north ", "to ", "Q: why? ", "a"])


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(PIECE, min_size=1, max_size=12).map("".join), min_size=2, max_size=8))
def test_exact_matches_at_least_what_a_longest_prefix_cache_over_the_last_64_prompts_does(
    tokenizer, texts: list[str]
) -> None:
    """Whatever the prompts, the exact prefix cache holds for each at least the longest
    common prefix with any of the last 64 prompts (partial blocks too, token by token)."""
    engine = KVBoost(
        make_model("llama"), tokenizer, KVBoostConfig(fidelity="exact", block_tokens=4)
    )
    seen: list[list[int]] = []
    for text in texts:
        tokens = engine.tokenize(text)
        best = max((_common(tokens, old) for old in seen[-64:]), default=0)
        assert engine._caches.look_up(engine._prompts.text(text)).matched >= best
        engine.generate(text, max_new_tokens=2)
        seen.append(tokens)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_branches_ending_in_one_block_are_all_kept() -> None:
    """Two streams that part inside a block both keep their partial last block (one tail
    per parent would leave only the latest)."""
    store = CountingStore(10**9)
    prefix = PrefixCache(store, FINGERPRINT, BLOCK)
    store_stream(prefix, [1, 2, 3, 4, 5, 6])
    store_stream(prefix, [1, 2, 3, 4, 7, 8])
    assert prefix.match([1, 2, 3, 4, 5, 6, 9]).length == 6
    assert prefix.match([1, 2, 3, 4, 7, 8, 9]).length == 6
