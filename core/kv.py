"""KV tensors as the engine moves them: per-layer (keys, values) pairs.

Shapes follow transformers' caches: ``[batch, kv_heads, seq, head_dim]``. A ``LayerKV``
list is what the stores hold; a ``DynamicCache`` is what the model consumes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache, PretrainedConfig

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
    """A fresh ``DynamicCache`` holding ``kv`` (the model may append to it freely)."""
    return DynamicCache(ddp_cache_data=kv or None, config=config)
