"""Exact prefix cache: the longest run of cached blocks from position 0.

KV stored here always comes from a full-attention prefill of the whole token stream up to
that block, so reusing it is lossless. Full blocks chain like vLLM's block hashes; the
partial block at the end of a stored stream is kept as a "tail" child of its parent. Where
the full blocks stop matching, the parent's children are compared token by token (like a
radix tree), so a conversation's next turn reuses its history to the token, not the block.

The index of blocks (key -> parent, tokens, bytes) lives in memory apart from their KV, as
in vLLM's block pool: a match walks the index and reads KV from the store only for the
blocks it uses. KV the store has dropped is found missing when loaded; the block then
leaves the index and the match ends before it. Full blocks stored by an earlier process
(on disk, not yet in this index) are found by their chained key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from transformers import DynamicCache

from kvboost_rag.core.model.kv import LayerKV, kv_nbytes, slice_cache
from kvboost_rag.core.store.keys import digest, prefix_block_keys
from kvboost_rag.core.store.tiers import TieredStore


class PrefixMatch(NamedTuple):
    length: int  # tokens covered from position 0
    blocks: list[LayerKV]  # per-block KV, in order


class Block(NamedTuple):
    """What the index knows of a stored block without reading its KV."""

    parent: bytes  # key of the block before it (the root key for the first block)
    tokens: tuple[int, ...]  # its token ids; a tail has fewer than block_tokens
    nbytes: int  # size of its KV in the store


class PrefixCache:
    """Not thread-safe: the engine calls it under the model's lock."""

    def __init__(
        self,
        store: TieredStore,
        fingerprint: bytes,
        block_tokens: int,
        namespace: bytes = b"prefix-root",
        approximate: bool = False,
        shared: bool = True,
    ) -> None:
        self.store = store
        self.approximate = approximate  # session KV: lower tiers may store it lossily
        self.shared = shared  # written through to the shared (Redis) tier
        self.block_tokens = block_tokens
        self._root = digest(namespace, fingerprint, str(block_tokens).encode())
        self._blocks: dict[bytes, Block] = {}
        # parent key -> keys indexed under it (full blocks and the tail), in insertion order
        self._children: dict[bytes, dict[bytes, None]] = {}

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        return prefix_block_keys(self._root, tokens, self.block_tokens)

    def match(self, tokens: Sequence[int], first: int = 0) -> PrefixMatch:
        """Longest cached prefix of ``tokens``: whole blocks, then the child of the last
        one that shares the most tokens with the rest (cut to the shared tokens).

        ``first``: the blocks before this one are not looked at (the caller has their KV
        from elsewhere); ``blocks`` then starts at block ``first`` while ``length``
        still counts from position 0."""
        chain = self._chain(tokens, first)
        blocks = self._load_chain(tokens, chain, first)
        length = (first + len(blocks)) * self.block_tokens
        parent = chain[len(blocks) - 1] if blocks else self.parent_key(tokens, first)
        rest = tuple(tokens[length:])
        while rest and (best := self._best_child(parent, rest)) is not None:
            key, shared = best
            entry = self.store.get(key, self._blocks[key].tokens)
            if entry is not None:
                blocks.append([(k[:, :, :shared], v[:, :, :shared]) for k, v in entry.kv])
                return PrefixMatch(length + shared, blocks)
            self._forget(key)  # evicted from every tier: try the next best child
        return PrefixMatch(length, blocks)

    def insert(
        self, tokens: Sequence[int], cache: DynamicCache, exact_upto: int, first: int = 0
    ) -> int:
        """Store every full block of ``tokens[:exact_upto]`` not yet cached, from block
        ``first`` on; returns how many.

        ``cache`` holds full-attention KV for at least ``exact_upto`` positions of ``tokens``.
        """
        assert cache.get_seq_length() >= exact_upto
        stored, parent = 0, self.parent_key(tokens, first)
        keys = self.keys(tokens[:exact_upto])
        for i, key in enumerate(keys[first:], first):
            if key not in self.store:
                start = i * self.block_tokens
                kv = slice_cache(cache, start, start + self.block_tokens)
                stored += self._put(parent, key, self._block(tokens, i), kv)
            parent = key
        start = len(keys) * self.block_tokens
        tail, key = tuple(tokens[start:exact_upto]), self._tail_key(parent)
        known = self._blocks.get(key)
        if tail and (known is None or known.tokens != tail or key not in self.store):
            # the partial last block: one tail per parent, the latest wins
            self._put(parent, key, tail, slice_cache(cache, start, exact_upto))
        return stored

    def parent_key(self, tokens: Sequence[int], index: int) -> bytes:
        """The key block ``index`` chains from."""
        return self.keys(tokens[: index * self.block_tokens])[-1] if index else self._root

    def _chain(self, tokens: Sequence[int], first: int = 0) -> list[bytes]:
        """Keys of the leading full blocks (from ``first``) the index or the store holds
        (no KV read)."""
        chain: list[bytes] = []
        for i, key in enumerate(self.keys(tokens)[first:], first):
            block = self._blocks.get(key)
            known = block is not None and block.tokens == self._block(tokens, i)
            if not (known or (block is None and key in self.store)):
                break
            chain.append(key)
        return chain

    def _load_chain(
        self, tokens: Sequence[int], chain: list[bytes], first: int = 0
    ) -> list[LayerKV]:
        """KV of the chained blocks, up to the first one gone from every tier."""
        blocks: list[LayerKV] = []
        parent = self.parent_key(tokens, first)
        for i, key in enumerate(chain, first):
            entry = self.store.get(key, self._block(tokens, i))
            if entry is None:
                self._forget(key)
                break
            if key not in self._blocks:  # stored by an earlier process, found on disk
                self._index(parent, key, entry.tokens, entry.nbytes)
            blocks.append(entry.kv)
            parent = key
        return blocks

    def _best_child(self, parent: bytes, rest: tuple[int, ...]) -> tuple[bytes, int] | None:
        """The indexed child of ``parent`` sharing the most leading tokens with ``rest``."""
        best, shared = None, 0
        for key in self._children.get(parent, ()):
            n = common_prefix(self._blocks[key].tokens, rest)
            if n > shared:
                best, shared = key, n
        return None if best is None else (best, shared)

    def _put(self, parent: bytes, key: bytes, tokens: tuple[int, ...], kv: LayerKV) -> bool:
        if not self.store.put(key, tokens, kv, approximate=self.approximate, share=self.shared):
            return False  # larger than the whole memory budget: not stored, not indexed
        self._index(parent, key, tokens, kv_nbytes(kv))
        return True

    def _index(self, parent: bytes, key: bytes, tokens: tuple[int, ...], nbytes: int) -> None:
        self._blocks[key] = Block(parent, tokens, nbytes)
        self._children.setdefault(parent, {})[key] = None

    def _forget(self, key: bytes) -> None:
        block = self._blocks.pop(key, None)
        if block is not None:
            siblings = self._children.get(block.parent, {})
            siblings.pop(key, None)
            if not siblings:
                self._children.pop(block.parent, None)

    def _tail_key(self, parent: bytes) -> bytes:
        return digest(b"tail", parent)

    def _block(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.block_tokens
        return tuple(tokens[start : start + self.block_tokens])


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
