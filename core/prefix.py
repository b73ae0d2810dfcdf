"""Exact prefix cache: the longest run of cached blocks from position 0.

KV stored here always comes from a full-attention prefill of the whole token stream up to
that block, so reusing it is lossless. Full blocks chain like vLLM's block hashes; the
partial block at the end of a stored stream is kept as a "tail" child of its parent. Where
the full blocks stop matching, the parent's children are compared token by token (like a
radix tree), so a conversation's next turn reuses its history to the token, not the block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from transformers import DynamicCache

from kvboost_rag.core.keys import digest, prefix_block_keys
from kvboost_rag.core.kv import LayerKV, slice_cache
from kvboost_rag.core.tiers import TieredStore


class PrefixMatch(NamedTuple):
    length: int  # tokens covered from position 0
    blocks: list[LayerKV]  # per-block KV, in order


class PrefixCache:
    def __init__(self, store: TieredStore, fingerprint: bytes, block_tokens: int) -> None:
        self.store = store
        self.block_tokens = block_tokens
        self._root = digest(b"prefix-root", fingerprint, str(block_tokens).encode())
        # parent key -> keys stored under it (blocks and tails); pruned when found evicted
        self._children: dict[bytes, set[bytes]] = {}

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return prefix_block_keys(self._root, tokens, self.block_tokens)

    def match(self, tokens: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of ``tokens`` (whole blocks only)."""
        blocks: list[LayerKV] = []
        parent = self._root
        for i, key in enumerate(self.keys(tokens)):
            entry = self.store.get(key, self._block(tokens, i))
            if entry is None:
                break
            blocks.append(entry.kv)
            parent = key
        length = len(blocks) * self.block_tokens
        best, kv = 0, None
        for child in list(self._children.get(parent, ())):
            entry = self.store.get(child, None)
            if entry is None:
                self._children[parent].discard(child)
                continue
            n = _common_prefix(entry.tokens, tokens[length : length + len(entry.tokens)])
            if n > best:
                best, kv = n, entry.kv
        if kv is not None:
            blocks.append([(k[:, :, :best], v[:, :, :best]) for k, v in kv])
        return PrefixMatch(length + best, blocks)

    def insert(self, tokens: Sequence[int], cache: DynamicCache, exact_upto: int) -> int:
        """Store every full block of ``tokens[:exact_upto]`` not yet cached; returns how many.

        ``cache`` holds full-attention KV for at least ``exact_upto`` positions of ``tokens``.
        """
        assert cache.get_seq_length() >= exact_upto
        stored, parent = 0, self._root
        keys = self.keys(tokens[:exact_upto])
        for i, key in enumerate(keys):
            if key not in self.store:
                start = i * self.block_tokens
                kv = slice_cache(cache, start, start + self.block_tokens)
                stored += self._put(parent, key, self._block(tokens, i), kv)
            parent = key
        start = len(keys) * self.block_tokens
        if start < exact_upto:  # the partial last block: one tail per parent, latest wins
            tail = tuple(tokens[start:exact_upto])
            self._put(parent, self._tail_key(parent), tail, slice_cache(cache, start, exact_upto))
        return stored

    def _put(self, parent: bytes, key: bytes, tokens: tuple[int, ...], kv: LayerKV) -> bool:
        self._children.setdefault(parent, set()).add(key)
        return self.store.put(key, tokens, kv)

    def _tail_key(self, parent: bytes) -> bytes:
        return digest(b"tail", parent)

    def _block(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.block_tokens
        return tuple(tokens[start : start + self.block_tokens])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
