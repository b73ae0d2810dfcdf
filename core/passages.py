"""Passage cache: each passage's KV computed once, alone, and reused at any position.

Keys are content keys (no parent): model fingerprint + anchor + the passage's tokens. KV is
encoded after a short fixed anchor (BOS where the tokenizer has one) that is not stored, so
the passage's first token is not computed as an attention sink; its canonical position is
therefore ``len(anchor)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from kvboost_rag.core.keys import digest, token_bytes
from kvboost_rag.core.kv import LayerKV, batch_rows, to_cache
from kvboost_rag.core.tiers import TieredStore


class PassageLookup(NamedTuple):
    kv: list[LayerKV]  # per passage, at canonical positions
    hits: int
    misses: int
    encode_ms: float  # time spent encoding the misses


class PassageCache:
    def __init__(
        self,
        store: TieredStore,
        model: Any,
        fingerprint: bytes,
        anchor: list[int],
        batch_tokens: int,
    ) -> None:
        self.store = store
        self.model = model
        self.anchor = anchor
        self.batch_tokens = batch_tokens  # padded tokens per encoding batch (bounds memory)
        self._root = digest(b"passage-root", fingerprint, token_bytes(anchor))

    @property
    def offset(self) -> int:
        """Position of a passage's first token in its stored KV."""
        return len(self.anchor)

    def key(self, tokens: Sequence[int]) -> bytes:
        return digest(b"passage", self._root, token_bytes(tokens))

    def __contains__(self, tokens: Sequence[int]) -> bool:
        """Whether the passage is stored (reads no KV; it may still be evicted before use)."""
        return self.key(tokens) in self.store

    def cached(self, passages: Sequence[Sequence[int]]) -> list[LayerKV | None]:
        """Stored KV of each passage, None where it is not cached."""
        out: list[LayerKV | None] = []
        for tokens in passages:
            entry = self.store.get(self.key(tokens), tuple(tokens))
            out.append(None if entry is None else entry.kv)
        return out

    def fetch(
        self,
        passages: Sequence[Sequence[int]],
        known: Sequence[LayerKV | None] | None = None,
        batch_size: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> PassageLookup:
        """KV of every passage: cached ones from the store (or ``known``, a prior
        ``cached()`` answer), the rest encoded in batches and stored. Duplicates in one
        request are encoded once."""
        known = self.cached(passages) if known is None else known
        all_keys = [self.key(tokens) for tokens in passages]
        found: dict[bytes, LayerKV] = {}
        missing: dict[bytes, tuple[int, ...]] = {}
        for tokens, key, kv in zip(passages, all_keys, known):
            if kv is not None:
                found[key] = kv
            elif key not in found:
                missing[key] = tuple(tokens)
        start = time.perf_counter()
        keys = list(missing)
        # Store each batch as it is encoded: its disk writes overlap the next batch.
        for i, kv in self.encode_batches(list(missing.values()), batch_size):
            found[keys[i]] = kv
            self.store.put(keys[i], missing[keys[i]], kv, persist=True)
            if progress is not None:
                progress(1)
        encode_ms = (time.perf_counter() - start) * 1e3 if missing else 0.0
        hits = sum(kv is not None for kv in known)
        kvs = [found[key] for key in all_keys]
        return PassageLookup(kvs, hits, len(passages) - hits, encode_ms)

    def encode(
        self, passages: Sequence[Sequence[int]], batch_size: int | None = None
    ) -> list[LayerKV]:
        """Encode passages alone after the anchor; similar lengths share a padded batch of
        at most ``batch_tokens`` padded tokens and ``batch_size`` rows."""
        out = dict(self.encode_batches(passages, batch_size))
        return [out[i] for i in range(len(passages))]

    def encode_batches(
        self, passages: Sequence[Sequence[int]], batch_size: int | None = None
    ) -> Iterator[tuple[int, LayerKV]]:
        """``(index, kv)`` of each passage, batch by batch as they are encoded."""
        for batch in self.batches(passages, batch_size):
            yield from zip(batch, self._encode_batch([passages[i] for i in batch]))

    def batches(
        self, passages: Sequence[Sequence[int]], batch_size: int | None = None
    ) -> list[list[int]]:
        """How ``encode`` groups passages: indices of each padded batch."""
        order = sorted(range(len(passages)), key=lambda i: len(passages[i]))
        return _batches(order, passages, self.batch_tokens, batch_size)

    def padded(self, passages: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and attention mask of one batch: anchor + passage, right-padded.
        Real tokens never attend to the pads that follow them, and their positions are
        0..n-1 as in a single-passage encode."""
        a = len(self.anchor)
        ids = torch.zeros((len(passages), a + max(len(p) for p in passages)), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, tokens in enumerate(passages):
            ids[row, : a + len(tokens)] = torch.tensor([*self.anchor, *tokens])
            mask[row, : a + len(tokens)] = 1
        return ids.to(self.model.device), mask.to(self.model.device)

    def _encode_batch(self, passages: Sequence[Sequence[int]]) -> list[LayerKV]:
        ids, mask = self.padded(passages)
        cache = to_cache([], self.model.config)  # full-length layers, sliding ones too
        self.model(
            input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1
        )
        a = len(self.anchor)
        return batch_rows(cache, [a] * len(passages), [len(p) for p in passages])


def _batches(
    order: list[int], passages: Sequence[Sequence[int]], budget: int, rows: int | None
) -> list[list[int]]:
    """Consecutive runs of ``order`` whose padded size (rows x longest) fits ``budget``
    and, when given, whose row count fits ``rows``."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(passages[i])  # order is ascending, so the newest is the longest
        full = rows is not None and len(current) >= rows
        if current and (full or (len(current) + 1) * longest > budget):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
