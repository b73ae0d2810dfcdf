"""Sibling block layers that read one input, multiplied in one kernel call.

A decoder layer's query, key and value projections read the same hidden states, and so do
its MLP's gate and up projections. Called one by one, a decoding step pays the kernel's
fixed cost (a call from Python, an OpenMP team, the input's quantized copy) 7 times a layer,
and the key and value projections of a model with few key-value heads are too small to
stream near the memory bandwidth: at Qwen2.5-Coder-1.5B a 256 x 1536 4-bit layer took
34 us a call, nearly all of it that fixed cost (``docs/bench/decode.md``). ``join`` packs
the siblings of one format into one tensor each, and the first sibling called computes
every sibling's product at once; the others take their part while their input is the very
tensor it was computed from. Each output block is the same arithmetic on the same quantized
input rows as alone, so a sibling's output is bit for bit what its own call gives.

The siblings hold views of the joint tensors (no weight is held twice), and each can still
compute alone: a caller that gives them different inputs, or calls one twice, gets each
product computed for its own input.
"""

from __future__ import annotations

from typing import Any

import torch

from kvboost_rag.core.model.blocks import PARTS, BlockLinear, packed_format
from kvboost_rag.core.model.linears import SIBLINGS


class Siblings:
    """The joint product of layers that read one input; ``output`` gives one's part."""

    def __init__(self, layers: list[BlockLinear]) -> None:
        sizes = [layer.out_features for layer in layers]
        joint = layers[0].joint  # read from a cache that held them joined: no copy
        if (
            joint is not None
            and all(x.joint is joint for x in layers)
            and (joint["sizes"].tolist() == sizes)
        ):
            packed = {p: joint[p] for p in PARTS if p in joint}
        else:
            packed = {p: torch.cat([getattr(layer, p) for layer in layers]) for p in PARTS}
        first = layers[0]
        info = [sum(sizes), first.in_features, first.zero, first.bits, first.group]
        packed["info"] = torch.tensor(info, dtype=torch.int64)
        biases = [layer.bias for layer in layers]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([torch.zeros(n) if b is None else b for b, n in zip(biases, sizes)])
        self.whole = BlockLinear(packed, bias, first.cache_root)
        self.sizes = sizes
        self._stash: tuple[torch.Tensor, tuple[torch.Tensor, ...], set[int]] | None = None
        start = 0
        for i, layer in enumerate(layers):
            blocks = slice(start // 16, (start + sizes[i]) // 16)
            for part in PARTS:  # the layer's own tensors become views of the joint ones
                setattr(layer, part, getattr(self.whole, part)[blocks])
            start += sizes[i]
            layer.siblings, layer.sibling, layer.joint = self, i, None

    def output(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling ``i``'s product of ``x``: its part of the joint product computed for
        ``x`` by the first sibling that read it, or all of them computed now."""
        stash = self._stash  # read once: another thread may replace it
        if stash is not None and stash[0] is x and i not in stash[2]:
            stash[2].add(i)
            if len(stash[2]) == len(self.sizes) and self._stash is stash:
                self._stash = None  # every part taken: a prefill's outputs are not kept
            return stash[1][i]
        parts = self.whole.forward(x).split(self.sizes, dim=-1)
        self._stash = (x, parts, {i})
        return parts[i]

    def __deepcopy__(self, memo: dict[int, Any]) -> Siblings:
        # a model's copy (the engine's view) shares the weights, not what was computed
        copy = Siblings.__new__(Siblings)
        copy.whole, copy.sizes, copy._stash = self.whole, self.sizes, None
        return copy


def join(model: Any) -> int:
    """Join each module's named siblings (``SIBLINGS``) that are block layers of one format;
    how many groups were joined."""
    joined = 0
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, n, None) for n in names]
            by_format: dict[tuple[Any, ...], list[BlockLinear]] = {}
            for layer in layers:
                if isinstance(layer, BlockLinear) and layer.siblings is None:
                    by_format.setdefault(_format(layer), []).append(layer)
            for group in by_format.values():
                if len(group) > 1:
                    Siblings(group)
                    joined += 1
    return joined


def _format(layer: BlockLinear) -> tuple[Any, ...]:
    return packed_format({p: getattr(layer, p) for p in PARTS} | {"info": layer.info})
