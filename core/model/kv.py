"""KV tensors as the engine moves them: per-layer (keys, values) pairs.

Shapes follow transformers' caches: ``[batch, kv_heads, seq, head_dim]``. A ``LayerKV``
list is what the stores hold; a ``DynamicCache`` is what the model consumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def kv_nbytes(kv: LayerKV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


def slice_cache(cache: DynamicCache, start: int, end: int) -> LayerKV:
    """Copy positions [start, end) out of a cache (a copy, so the cache can be freed)."""
    return [
        (layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone())  # type: ignore[union-attr,index]
        for layer in cache.layers
    ]


def concat_kv(parts: Sequence[LayerKV]) -> LayerKV:
    """Concatenate per-layer KV along the sequence axis."""
    assert parts, "nothing to concatenate"
    if len(parts) == 1:
        return [(k, v) for k, v in parts[0]]
    return [
        (torch.cat([p[i][0] for p in parts], dim=-2), torch.cat([p[i][1] for p in parts], dim=-2))
        for i in range(len(parts[0]))
    ]


def blocks_cache(
    blocks: Sequence[LayerKV], config: PretrainedConfig, length: int | None = None
) -> DynamicCache:
    """A cache holding ``blocks`` in order (the first ``length`` positions of them)."""
    if not blocks:
        return to_cache([], config)
    kv = concat_kv(blocks)
    if length is not None:
        kv = [(k[:, :, :length], v[:, :, :length]) for k, v in kv]
    return to_cache(kv, config)


def to_cache(kv: LayerKV, config: PretrainedConfig) -> DynamicCache:
    """A fresh ``DynamicCache`` holding ``kv`` (the model may append to it freely).

    Every layer keeps every position, sliding-window layers too: the engine slices
    positions out of its caches, scatters repaired KV into them and splices passages in,
    all by absolute position. Built from ``config``, transformers would make
    ``DynamicSlidingWindowLayer``s that silently keep only the last window of tokens, so
    position p of the tensor is no longer token p (Gemma 2/3 and Mistral then reused
    another token's KV). The model's own sliding-window mask still does the windowing.
    """
    layers = config.get_text_config(decoder=True).num_hidden_layers
    assert not kv or len(kv) == layers, f"{len(kv)} KV layers for a {layers}-layer model"
    return DynamicCache(ddp_cache_data=kv or None)


# -- the one place that reads and writes transformers cache tensors -------------------------


def layer_kv(cache: DynamicCache) -> LayerKV:
    """Each layer's (keys, values) of ``cache``, as views (no copy)."""
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[misc]


def batch_rows(cache: DynamicCache, starts: Sequence[int], lengths: Sequence[int]) -> list[LayerKV]:
    """Copies of each batch row's positions ``[start, start + length)``: one sequence's
    KV out of a padded batch."""
    return [
        [
            (k[row : row + 1, :, s : s + n].clone(), v[row : row + 1, :, s : s + n].clone())
            for k, v in layer_kv(cache)
        ]
        for row, (s, n) in enumerate(zip(starts, lengths))
    ]


def place_fresh(cache: DynamicCache, positions: torch.Tensor, length: int) -> None:
    """After a forward that appended fresh KV for ``positions`` behind ``length`` cached
    ones, move the fresh KV into those positions: the cache then holds ``length + 1``."""
    for layer in cache.layers:
        for name in ("keys", "values"):
            full = getattr(layer, name)
            fresh = full[:, :, length:].clone()
            placed = full[:, :, : length + 1]
            placed[:, :, positions] = fresh
            setattr(layer, name, placed)


def head(kv: LayerKV, length: int) -> LayerKV:
    """The first ``length`` positions of ``kv`` (views)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]


def stack_rows(rows: Sequence[LayerKV], room: int = 64) -> tuple[DynamicCache, list[int]]:
    """One left-padded batch cache of single-sequence KVs (each ``[1, heads, n_i, dim]``
    per layer), and each row's padding: row ``i`` holds its ``n_i`` positions at the end,
    so every row's next position lands in one shared column. Its layers have ``room``
    positions to grow into (see ``GrowingLayer``)."""
    lengths = [row[0][0].shape[-2] for row in rows]
    width = max(lengths)
    pads = [width - n for n in lengths]
    cache = DynamicCache()
    for layer in range(len(rows[0])):
        buffers = []
        for part in (0, 1):
            first = rows[0][layer][part]
            out = first.new_zeros((len(rows), first.shape[1], width + room, first.shape[3]))
            for i, row in enumerate(rows):
                out[i, :, pads[i] : width] = row[layer][part][0]
            buffers.append(out)
        cache.layers.append(GrowingLayer(buffers[0], buffers[1], width))
    return cache, pads


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` over buffers with room to grow: a decoding step writes its one
    position in place, where ``DynamicLayer`` copies the whole cache (``torch.cat``), which
    for a batch of long contexts costs as much as the step's matmuls."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        super().__init__()
        self.device = keys.device
        self._buffers = (keys, values)
        self._length = 0
        self._set(length)
        self.is_initialized = True

    def _set(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._length = length
        keys, values = (buf[:, :, :length] for buf in self._buffers)
        self.keys, self.values = keys, values
        return keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._length, self._length + key_states.shape[-2]
        if end > self._buffers[0].shape[-2]:  # full: twice the room, one copy
            keys, values = (
                torch.cat([buf[:, :, :start], torch.zeros_like(buf[:, :, : max(end, start)])], -2)
                for buf in self._buffers
            )
            self._buffers = (keys, values)
        self._buffers[0][:, :, start:end] = key_states
        self._buffers[1][:, :, start:end] = value_states
        return self._set(end)


def row_views(cache: DynamicCache, row: int, pad: int) -> LayerKV:
    """One batch row's positions (behind its ``pad``) as ``[1, ...]`` views (no copy)."""
    return [(k[row : row + 1, :, pad:], v[row : row + 1, :, pad:]) for k, v in layer_kv(cache)]
