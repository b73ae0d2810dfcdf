"""Encoding passages after a prefix: each passage sees the prefix and itself, never another
passage, so its KV can be placed next to any neighbours later.

Passages of similar length share a right-padded batch; the prefix's KV is computed once
(and kept for the last few prefixes) and is every row's past, so a row's real tokens sit
at positions ``len(prefix)..`` exactly as after that prefix in a prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kvboost_rag.core.model.kv import LayerKV, batch_rows, layer_kv, to_cache

# Prefix KVs kept for encoding: RAG apps use one or a few prompt layouts.
PREFIX_KV_KEPT = 4


class PassageEncoder:
    def __init__(self, model: Any, batch_tokens: int) -> None:
        self.model = model
        self.batch_tokens = batch_tokens  # padded tokens per encoding batch (bounds memory)
        self._prefix_kv: OrderedDict[tuple[int, ...], LayerKV] = OrderedDict()

    def encode(
        self,
        prefix: Sequence[int],
        passages: Sequence[Sequence[int]],
        batch_size: int | None = None,
    ) -> Iterator[tuple[int, LayerKV]]:
        """``(index, kv)`` of each passage encoded after ``prefix``, batch by batch as they
        are encoded; the KV covers the passage only, at positions ``len(prefix)..``."""
        for batch in self.batches(passages, batch_size):
            yield from zip(batch, self.encode_batch(prefix, [passages[i] for i in batch]))

    def batches(
        self, passages: Sequence[Sequence[int]], batch_size: int | None = None
    ) -> list[list[int]]:
        """How ``encode`` groups passages: indices of each padded batch."""
        order = sorted(range(len(passages)), key=lambda i: len(passages[i]))
        return _batches(order, passages, self.batch_tokens, batch_size)

    def padded(
        self, prefix_len: int, passages: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids (the passages, right-padded) and the attention mask over prefix and
        passage. Real tokens never attend to the pads that follow them."""
        ids = torch.zeros((len(passages), max(len(p) for p in passages)), dtype=torch.long)
        mask = torch.zeros((len(passages), prefix_len + ids.shape[1]), dtype=torch.long)
        mask[:, :prefix_len] = 1
        for row, tokens in enumerate(passages):
            ids[row, : len(tokens)] = torch.tensor(tokens)
            mask[row, : prefix_len + len(tokens)] = 1
        return ids.to(self.model.device), mask.to(self.model.device)

    def prefix_kv(self, prefix: Sequence[int]) -> LayerKV:
        """The KV of ``prefix`` alone (computed once for the last few prefixes)."""
        key = tuple(prefix)
        if key in self._prefix_kv:
            self._prefix_kv.move_to_end(key)
            return self._prefix_kv[key]
        cache = to_cache([], self.model.config)
        if key:
            ids = torch.tensor([key], device=self.model.device)
            self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        kv = layer_kv(cache)
        self._prefix_kv[key] = kv
        while len(self._prefix_kv) > PREFIX_KV_KEPT:
            self._prefix_kv.popitem(last=False)
        return kv

    def encode_batch(
        self, prefix: Sequence[int], passages: Sequence[Sequence[int]]
    ) -> list[LayerKV]:
        """Each passage's KV after ``prefix``, in one padded forward."""
        ids, mask = self.padded(len(prefix), passages)
        rows = len(passages)
        past = (
            [
                (k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1))
                for k, v in self.prefix_kv(prefix)
            ]
            if prefix
            else []
        )
        cache = to_cache(past, self.model.config)  # full-length layers, sliding ones too
        self.model(
            input_ids=ids, attention_mask=mask, cache=cache, use_cache=True, logits_to_keep=1
        )
        return batch_rows(cache, [len(prefix)] * rows, [len(p) for p in passages])


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
