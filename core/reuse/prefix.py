"""Exact prefix cache: the longest run of cached blocks from position 0.

KV stored here always comes from a full-attention prefill of the whole token stream up to
that block, so reusing it is lossless. Full blocks chain like vLLM's block hashes; the
partial block at the end of a stored stream is kept as a "tail" child of its parent. Where
the full blocks stop matching, the parent's children are compared token by token (like a
radix tree), so a conversation's next turn reuses its history to the token, not the block.

The index of blocks (key -> parent, tokens, bytes) lives in memory apart from their KV, as
in vLLM's block pool: a match reads the chain of full blocks in one batch (one round trip
to the shared tier, not one per block) and, among the children, only the one it uses. KV
the store has dropped is found missing when loaded; the block then leaves the index and
the match ends before it. Full blocks stored by an earlier process (on disk or in the
shared tier, not yet in this index) are found by their chained key.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import NamedTuple

from kvboost_rag.core.model.kv import LayerKV, kv_nbytes
from kvboost_rag.core.store.keys import digest, prefix_block_keys, token_bytes
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
    """Thread-safe: lookups run on callers' threads, inserts on the engine's indexer. The
    index is guarded by a lock held for dictionary work only, never across tier I/O."""

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
        self._lock = threading.Lock()
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
        keys = self.keys(tokens)
        blocks = self._load_chain(tokens, keys, first)
        length = (first + len(blocks)) * self.block_tokens
        last = first + len(blocks) - 1
        parent = keys[last] if last >= 0 else self._root
        rest = tuple(tokens[length:])
        while rest and (best := self._best_child(parent, rest)) is not None:
            key, child, shared = best
            entry = self.store.get_many([(key, child)], share=self.shared)[0]
            if entry is not None:
                blocks.append([(k[:, :, :shared], v[:, :, :shared]) for k, v in entry.kv])
                return PrefixMatch(length + shared, blocks)
            self._forget(key)  # evicted from every tier: try the next best child
        return PrefixMatch(length, blocks)

    def insert(
        self,
        tokens: Sequence[int],
        kv: LayerKV,
        exact_upto: int,
        first: int = 0,
        kv_start: int = 0,
        persist: bool = False,
    ) -> int:
        """Store every full block of ``tokens[:exact_upto]`` not yet cached, from block
        ``first`` on, and the partial block after them; returns how many entries it stored
        (blocks and the partial one).

        ``kv`` holds full-attention KV of ``tokens`` for positions [``kv_start``,
        ``exact_upto``), ``kv_start`` at most block ``first``'s start; stored blocks are
        copies. ``persist``: written to disk now, not only when memory evicts them (what
        is warmed ahead of time serves later processes too).
        """
        assert kv_start <= first * self.block_tokens
        assert kv[0][0].shape[-2] >= exact_upto - kv_start
        stored, parent = 0, self.parent_key(tokens, first)
        keys = self.keys(tokens[:exact_upto])
        shared = self._shared_only(keys[first:])
        for i, key in enumerate(keys[first:], first):
            # Asked here, not up front, where local: a block just stored may have evicted it.
            there = shared.get(key) or self.store.contains_many([key], share=False)[0]
            if not there:
                start = i * self.block_tokens
                block = _copy(kv, start - kv_start, start + self.block_tokens - kv_start)
                stored += self._put(parent, key, self._block(tokens, i), block, persist)
            parent = key
        start = len(keys) * self.block_tokens
        tail = tuple(tokens[start:exact_upto])
        if tail and not self._covered(parent, tail):
            # the partial last block, one per distinct tail: a conversation that branched
            # keeps every branch, as a longest-prefix cache over whole prompts does
            piece = _copy(kv, start - kv_start, exact_upto - kv_start)
            stored += self._put(parent, self._tail_key(parent, tail), tail, piece, persist)
        return stored

    def cached_blocks(self, tokens: Sequence[int]) -> int:
        """Leading full blocks of ``tokens`` indexed and held in memory (no tier I/O): the
        ones an insert would skip."""
        count = 0
        for i, key in enumerate(self.keys(tokens)):
            block = self._blocks.get(key)
            if block is None or block.tokens != self._block(tokens, i):
                break
            if key not in self.store.memory:
                break
            count += 1
        return count

    def _shared_only(self, keys: list[bytes]) -> dict[bytes, bool]:
        """For the keys the local tiers lack, whether the shared tier holds them: one batch."""
        if not self.shared:
            return {}
        local = self.store.contains_many(keys, share=False)
        elsewhere = [key for key, here in zip(keys, local) if not here]
        return dict(zip(elsewhere, self.store.contains_many(elsewhere)))

    def _covered(self, parent: bytes, tail: tuple[int, ...]) -> bool:
        """Whether a stored child of ``parent`` starts with ``tail`` (it would serve it)."""
        with self._lock:
            children = [(k, self._blocks[k].tokens) for k in self._children.get(parent, ())]
        serving = [k for k, t in children if t[: len(tail)] == tail]
        return any(self.store.contains_many(serving, share=self.shared))

    def parent_key(self, tokens: Sequence[int], index: int) -> bytes:
        """The key block ``index`` chains from."""
        return self.keys(tokens[: index * self.block_tokens])[-1] if index else self._root

    def _load_chain(self, tokens: Sequence[int], keys: list[bytes], first: int) -> list[LayerKV]:
        """KV of the leading full blocks from ``first`` on, up to the first one no tier
        holds, read in one batch (a block stored by an earlier process, not in the index,
        is found by its chained key)."""
        wanted = [(key, self._block(tokens, i)) for i, key in enumerate(keys[first:], first)]
        # An indexed block with other tokens under the key (a collision) ends the chain.
        for j, (key, block) in enumerate(wanted):
            known = self._blocks.get(key)  # one dict read: atomic, no lock needed
            if known is not None and known.tokens != block:
                wanted = wanted[:j]
                break
        entries = self.store.get_chain(wanted, share=self.shared)
        if len(entries) < len(wanted):
            self._forget(wanted[len(entries)][0])  # gone from every tier
        parent = keys[first - 1] if first else self._root
        for (key, _), entry in zip(wanted, entries):
            if self._blocks.get(key) is None:  # stored by an earlier process
                self._index(parent, key, entry.tokens, entry.nbytes)
            parent = key
        return [entry.kv for entry in entries]

    def _best_child(
        self, parent: bytes, rest: tuple[int, ...]
    ) -> tuple[bytes, tuple[int, ...], int] | None:
        """The indexed child of ``parent`` sharing the most leading tokens with ``rest``:
        its key, its tokens and how many it shares."""
        with self._lock:
            children = [(k, self._blocks[k].tokens) for k in self._children.get(parent, ())]
        best, shared = None, 0
        for key, tokens in children:
            n = common_prefix(tokens, rest)
            if n > shared:
                best, shared = (key, tokens), n
        return None if best is None else (*best, shared)

    def _put(
        self, parent: bytes, key: bytes, tokens: tuple[int, ...], kv: LayerKV, persist: bool
    ) -> bool:
        stored = self.store.put(
            key, tokens, kv, persist, approximate=self.approximate, share=self.shared
        )
        if not stored:
            return False  # larger than the whole memory budget: not stored, not indexed
        self._index(parent, key, tokens, kv_nbytes(kv))
        return True

    def _index(self, parent: bytes, key: bytes, tokens: tuple[int, ...], nbytes: int) -> None:
        with self._lock:
            self._blocks[key] = Block(parent, tokens, nbytes)
            self._children.setdefault(parent, {})[key] = None

    def _forget(self, key: bytes) -> None:
        with self._lock:
            block = self._blocks.pop(key, None)
            if block is not None:
                siblings = self._children.get(block.parent, {})
                siblings.pop(key, None)
                if not siblings:
                    self._children.pop(block.parent, None)

    def _tail_key(self, parent: bytes, tail: tuple[int, ...]) -> bytes:
        return digest(b"tail", parent, token_bytes(tail))

    def _block(self, tokens: Sequence[int], index: int) -> tuple[int, ...]:
        start = index * self.block_tokens
        return tuple(tokens[start : start + self.block_tokens])


def _copy(kv: LayerKV, start: int, end: int) -> LayerKV:
    """Positions [start, end) of ``kv``, copied (a stored block outlives what it came from)."""
    return [(k[:, :, start:end].clone(), v[:, :, start:end].clone()) for k, v in kv]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
