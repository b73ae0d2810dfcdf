"""Exact prefix cache: the longest run of cached full blocks from position 0.

KV stored here always comes from a full-attention prefill of the whole token stream up to
that block, so reusing it is lossless.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from transformers import DynamicCache

from kvboost_rag.core.keys import digest, prefix_block_keys
from kvboost_rag.core.kv import LayerKV, slice_cache
from kvboost_rag.core.store import MemoryStore


class PrefixMatch(NamedTuple):
    length: int  # tokens covered from position 0
    blocks: list[LayerKV]  # per-block KV, in order


class PrefixCache:
    def __init__(self, store: MemoryStore, fingerprint: bytes, block_tokens: int) -> None:
        self.store = store
        self.block_tokens = block_tokens
        self._root = digest(b"prefix-root", fingerprint, str(block_tokens).encode())

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return prefix_block_keys(self._root, tokens, self.block_tokens)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (whole blocks only)."""
        blocks: list[LayerKV] = []
        for i, key in enumerate(self.keys(tokens)):
            entry = self.store.get(key, self._block(tokens, i))
            if entry is None:
                break
            blocks.append(entry.kv)
        return PrefixMatch(len(blocks) * self.block_tokens, blocks)

    def insert(self, tokens: Sequence[int], cache: DynamicCache, exact_upto: int) -> int:
        """Store every full block of ``tokens[:exact_upto]`` not yet cached; returns how many.

        ``cache`` holds full-attention KV for at least ``exact_upto`` positions of ``tokens``.
        """
        assert cache.get_seq_length() >= exact_upto
        stored = 0
        for i, key in enumerate(self.keys(tokens[:exact_upto])):
            if key in self.store:
                continue
            start = i * self.block_tokens
            kv = slice_cache(cache, start, start + self.block_tokens)
            stored += self.store.put(key, self._block(tokens, i), kv)
        return stored

    def _block(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.block_tokens
        return tuple(tokens[start : start + self.block_tokens])
