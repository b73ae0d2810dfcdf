"""KV tensors as the engine moves them: per-layer (keys, values) pairs.

Shapes follow transformers' caches: ``[batch, kv_heads, seq, head_dim]``. A ``LayerKV``
list is what the stores hold; a ``DynamicCache`` is what the model consumes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]


def kv_nbytes(kv: LayerKV) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in kv)


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


class _LayerReached(Exception):
    pass


@contextmanager
def new_kv_of_layer(
    cache: DynamicCache, layer: int
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Within, a forward over ``cache`` stops where decoder layer ``layer`` writes its new
    (keys, values) to the cache; the yielded list receives them, as the model computed them
    (norms and RoPE applied). The layers before it run whole; that layer's attention and
    everything after it do not run, and the cache is left without that layer's new
    tokens."""
    caught: list[tuple[torch.Tensor, torch.Tensor]] = []
    update = cache.update

    def stop(
        keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> Any:
        if layer_idx == layer:
            caught.append((keys, values))
            raise _LayerReached
        return update(keys, values, layer_idx, *args, **kwargs)

    cache.update = stop  # type: ignore[method-assign,assignment]
    try:
        yield caught
    except _LayerReached:
        pass
    finally:
        del cache.update  # the class's own method again


def layer_kv(cache: DynamicCache) -> LayerKV:
    """Each layer's (keys, values) of ``cache``, as views (no copy)."""
    return [(layer.keys, layer.values) for layer in cache.layers]  # type: ignore[union-attr,misc]


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


def head(kv: LayerKV, length: int) -> LayerKV:
    """The first ``length`` positions of ``kv`` (views)."""
    return [(k[:, :, :length], v[:, :, :length]) for k, v in kv]
