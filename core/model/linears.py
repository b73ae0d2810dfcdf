"""The decoder's linear layers in the engine's forwards on a CPU: the fastest of three ways.

Every decoder weight is multiplied by as many rows as a forward feeds: 1 in a decoding
step, 2-9 when it verifies a draft or steps several requests at once, hundreds in a
prefill. torch's ``F.linear`` (``x @ W.T``) is not the fastest way on every CPU and count:

- *transposed*, ``(W @ x.T).T``, reads the weight as it is stored: for 2-8 rows on a 2-core
  AMD EPYC with AVX2 (fp32), SmolLM2-135M's 210 decoder weights, one pass each, took
  27 / 24 / 36 ms at 2 / 4 / 8 rows against 54 / 61 / 49 ms through ``F.linear``;
- *packed*, a oneDNN matmul on the weight reordered once into its blocked layout (what
  ``packed.py`` does for the head, and inductor's freezing pass for every linear weight).
  On a 2-core AMD EPYC with AVX-512 (fp32), the same 210 weights (ms, one pass each):

  | rows | 1 | 2 | 3 | 5 | 9 | 16 | 64 | 256 | 900 |
  |---|---|---|---|---|---|---|---|---|---|
  | ``F.linear`` | 47 | 68 | 79 | 60 | 73 | 85 | 151 | 506 | 1580 |
  | transposed | 49 | 29 | 41 | 44 | 74 | 58 | 132 | 458 | 2311 |
  | packed | 35 | 27 | 23 | 22 | 27 | 35 | 100 | 316 | 1146 |

  It costs a second copy of the decoder's weights in memory, so it is only a candidate for
  decoders whose linear weights fit ``PACKED_BYTES`` (a quarter of the machine's memory).
  Taken packed, the projections a layer applies to one input one after another (its
  attention's query, key and value, its MLP's gate and up: ``SIBLINGS``) are one product
  over their stacked weights (``Fused``), as vLLM's merged layers are: fewer, larger
  products, and each costs a fixed start-up on top of its arithmetic. One decoder layer's
  five of them at 8 rows took 393 us one by one and 292 us fused on the thread that loaded
  the model, 694 and 356 us on another thread, where OpenMP wakes its workers for every
  product (2-core AMD EPYC with AVX-512, fp32).

Which way each row count takes is measured per model when the engine warms up
(``measure``): on the model's own weights (enough of them to stream from memory, as a step
does, for the counts a step feeds), after a check that every way gives ``F.linear``'s
product; the fastest way, and the fastest without packing. A model takes the fastest once
one of its engines allows packing (``KVBoostConfig.packed_linears``), else the fastest
without (and keeps no packed copy). The decoder's ``nn.Linear`` layers of the engine's own
copy of the model (``view.py``; the user's model keeps its own) become ``EngineLinear``
over the same weights (``install``), which takes the way its row count's entry in its
table says (``adopt`` sets the tables): no state outside the layer decides it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from kvboost_rag.core.model.packed import PackedWeight, packed_linear, packs_dtype

PLAIN, TRANSPOSED, PACKED = "plain", "transposed", "packed"
CANDIDATES = (1, 2, 4, 8, 12, 16, 24, 32, 64, 256, 1024)  # row counts measured
STREAMED = 32  # counts up to this are timed over weights streamed from memory
STREAMED_BYTES = 64 << 20  # weights timed per pass then: more than a CPU's last-level cache
# Passes per way and count. At Qwen2.5-Coder-1.5B (bf16) 3 measures and one with 3x the
# passes over 4x the bytes chose the same ways at 1-16 rows, differing only at 24-64 where
# the ways' order changes run to run (``scripts/step_constants.py --parts linears``). Kept.
REPEATS = 3
# Decoders whose linear weights are smaller than this are not measured (every count runs
# F.linear): the timing would decide by noise, and two engines on equal tiny models would
# round their logits differently.
MEASURED_BYTES = 4 << 20


def _quarter_of_memory() -> int:
    """A quarter of this machine's physical memory (2 GiB where it cannot be read)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 2 << 30


# Packing is a candidate up to this much of linear weights: the packed copy is a second one
# in memory, kept to a quarter of the machine's. It was 2 GiB, set on SmolLM2; at
# Qwen2.5-Coder-1.5B (2.6 GB of bf16 linear weights) packed products measured 182 against
# 215 ms at 1 row and 127 against 193 ms at 8 rows for the decoder's 196 layers
# (``python -m benchmarks.decode.step --parts linears``, 2-core Xeon, one run), so the limit moved.
PACKED_BYTES = _quarter_of_memory()

# Sibling projections, named (o_proj has the same input size but reads another tensor):
# one input each in Llama-family layers; dense packing and GGUF blocks join the same.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Ways(NamedTuple):
    """Per measured row count, the way the decoder's linear layers take where it is not
    ``F.linear``: the fastest (``fastest``), and the fastest that needs no packed copy of
    the weights (``unpacked``, for the requests of an engine with ``packed_linears=False``)."""

    fastest: dict[int, str]
    unpacked: dict[int, str]


NONE = Ways({}, {})  # every count runs F.linear


class EngineLinear(torch.nn.Linear):
    """``nn.Linear`` over another layer's weights that computes its product the way its
    ``table`` gives for the input's row count (``adopt``; ``F.linear`` until then)."""

    _packed: PackedWeight | None = None  # the packed copy, once a forward takes it
    fused: Fused | None = None  # its siblings' group, when it has siblings (``install``)
    table: tuple[str, ...] = ()  # per row count up to ``CANDIDATES[-1]``, its way

    @classmethod
    def sharing(cls, linear: torch.nn.Linear) -> EngineLinear:
        """A layer over ``linear``'s weight and bias (the same tensors, no copy)."""
        weight = linear.weight
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
            dtype=weight.dtype,
        )
        layer.weight, layer.bias = weight, linear.bias
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not self.table:  # traced: nn.Linear, unbroken
            return super().forward(x)
        rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 1
        return self.product(x, self.table[min(rows, len(self.table) - 1)])

    def product(self, x: torch.Tensor, way: str) -> torch.Tensor:
        """The layer's product computed ``way``."""
        if way == TRANSPOSED and x.dim() >= 2:
            return transposed(x, self.weight, self.bias)
        if way == PACKED:
            if self.fused is not None:
                return self.fused.product(self, x)
            return packed_linear(x, self.packed_weight(), self.bias)
        return F.linear(x, self.weight, self.bias)

    def packed_weight(self) -> torch.Tensor:
        """The weight reordered for oneDNN (kept, and reordered anew if it changed)."""
        if self._packed is None:
            self._packed = PackedWeight()
        return self._packed.of(self.weight)


class Fused:
    """Sibling layers taken packed as one product over their stacked weights: the first
    member called on an input computes every member's columns, and each other member
    called on that same input takes its own (kept here until taken)."""

    def __init__(self, members: Sequence[EngineLinear]) -> None:
        self.members = list(members)
        self.sizes = [m.out_features for m in members]
        self._packed = PackedWeight()
        # the input of the last product and the columns its members have not taken yet
        self._taken: tuple[torch.Tensor, list[Any]] | None = None

    def packed_weight(self) -> torch.Tensor:
        return self._packed.of(*(m.weight for m in self.members))

    def drop(self) -> None:
        self._packed = PackedWeight()
        self._taken = None

    def product(self, member: EngineLinear, x: torch.Tensor) -> torch.Tensor:
        index = self.members.index(member)
        taken = self._taken
        if taken is not None and taken[0] is x and taken[1][index] is not None:
            out: torch.Tensor = taken[1][index]
            taken[1][index] = None
            if not any(o is not None for o in taken[1]):
                self._taken = None  # every member took its columns: hold no tensor
            return out
        biases = [m.bias for m in self.members]
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        outs: list[Any] = list(packed_linear(x, self.packed_weight(), bias).split(self.sizes, -1))
        out = outs[index]
        outs[index] = None
        self._taken = (x, outs)
        return out


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x.T``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, flat.T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def way_for(ways: dict[int, str], count: int) -> str:
    """The way ``count`` rows take: that of the measured count at or above it (the largest
    one's above it); ``PLAIN`` where ``ways`` has none."""
    bucket = next((n for n in CANDIDATES if n >= count), CANDIDATES[-1])
    return ways.get(bucket, PLAIN)


def install(model: Any) -> list[EngineLinear]:
    """Replace the plain ``nn.Linear`` layers of ``model``'s decoder by ``EngineLinear``
    layers over the same weights, grouping siblings (``Fused``); the layers. For the
    engine's own copy of a model (``view.py``), never the user's; on a CPU only."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or torch.device(model.device).type != "cpu":
        return []
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, EngineLinear.sharing(child))
    layers = [module for module in decoder.modules() if type(module) is EngineLinear]
    for module in decoder.modules():
        for names in SIBLINGS:
            members = [getattr(module, name, None) for name in names]
            if _fusable(members):
                group = Fused(members)  # type: ignore[arg-type]
                for member in members:
                    member.fused = group  # type: ignore[union-attr]
    return layers


def engine_layers(model: Any) -> list[EngineLinear]:
    """The ``EngineLinear`` layers ``install`` made in ``model`` (none where it did not)."""
    return [module for module in model.modules() if type(module) is EngineLinear]


def _fusable(members: Sequence[Any]) -> bool:
    """Whether layers can be one product: engine layers of one input width and dtype, with
    a bias all or none, in no group yet."""
    if not all(type(m) is EngineLinear and m.fused is None for m in members):
        return False
    first = members[0]
    return all(
        m.in_features == first.in_features
        and m.weight.dtype == first.weight.dtype
        and (m.bias is None) == (first.bias is None)
        for m in members
    )


def measure(model: Any, packed: bool = True) -> Ways:
    """For each of ``CANDIDATES``, the ways ``model``'s decoder layers are fastest here, where
    not ``F.linear`` (none on a GPU, for a model without plain linear layers, for a small
    decoder, or where a way's product differs). ``packed``: whether packing is a candidate
    at all (``KVBoostConfig.packed_linears``). Then ``adopt``s them."""
    layers = install(model)
    if not layers or model.dtype not in (torch.float32, torch.bfloat16):
        return NONE
    total = sum(layer.weight.numel() * layer.weight.element_size() for layer in layers)
    if total < MEASURED_BYTES:
        return NONE
    ways = [PLAIN, TRANSPOSED]
    if packed and packs_dtype(model.dtype) and total <= PACKED_BYTES:
        ways.append(PACKED)
    with torch.inference_mode():
        ways = [way for way in ways if _same(layers[0], way)]
        streamed = _streamed(layers)
        one_layer = _one_of_each_shape(layers)
        _ranked(streamed, 1, ways)  # first-use costs
        ranked = {n: _ranked(streamed if n <= STREAMED else one_layer, n, ways) for n in CANDIDATES}
    unpacked = [way for way in ways if way != PACKED]
    return adopt(model, Ways(_taken(ranked, ways), _taken(ranked, unpacked)), packed)


def adopt(model: Any, ways: Ways, packed: bool = True) -> Ways:
    """Take ``ways`` for ``model``'s layers (measured here, or before for the same shapes):
    their fastest where ``packed`` (packing every layer when a count's fastest way is
    packed, so no request pays for it), else the fastest without packing (no packed copy
    kept)."""
    layers = install(model)
    chosen = ways.fastest if packed else ways.unpacked
    table = tuple(way_for(chosen, rows) for rows in range(CANDIDATES[-1] + 1))
    packs = PACKED in chosen.values()
    with torch.inference_mode():
        for layer in layers:  # a group's members take its product, never their own copy
            layer.table = table if chosen else ()
            if packs and layer.fused is None:
                layer.packed_weight()
            else:
                layer._packed = None  # the timed copies are not kept
        for group in {id(layer.fused): layer.fused for layer in layers if layer.fused}.values():
            if packs:
                group.packed_weight()
            else:
                group.drop()
    return ways


def _taken(ranked: dict[int, list[str]], allowed: Sequence[str]) -> dict[int, str]:
    """Per count, the first of its ranked ways that is ``allowed``, where not ``PLAIN``."""
    firsts = {n: next(way for way in ways if way in allowed) for n, ways in ranked.items()}
    return {n: way for n, way in firsts.items() if way != PLAIN}


def _streamed(layers: Sequence[EngineLinear]) -> list[EngineLinear]:
    timed, size = [], 0
    for layer in layers:
        timed.append(layer)
        size += layer.weight.numel() * layer.weight.element_size()
        if size >= STREAMED_BYTES:
            break
    return _whole_groups(timed, layers)


def _one_of_each_shape(layers: Sequence[EngineLinear]) -> list[EngineLinear]:
    seen: dict[tuple[int, int], EngineLinear] = {}
    for layer in layers:
        seen.setdefault((layer.out_features, layer.in_features), layer)
    return _whole_groups(list(seen.values()), layers)


def _whole_groups(chosen: list[EngineLinear], layers: Sequence[EngineLinear]) -> list[EngineLinear]:
    """``chosen`` with every member of their ``Fused`` groups, in ``layers``' order: each
    way is timed on the same products (packed, a group's first member computes them all)."""
    groups = {id(layer.fused) for layer in chosen if layer.fused is not None}
    keep = {id(layer) for layer in chosen}
    return [
        layer
        for layer in layers
        if id(layer) in keep or (layer.fused is not None and id(layer.fused) in groups)
    ]


def _same(layer: EngineLinear, way: str) -> bool:
    x = torch.randn(4, layer.in_features, generator=_SEED).to(layer.weight.dtype)
    want = F.linear(x, layer.weight, layer.bias).float()
    try:
        got = layer.product(x, way).float()
    except (RuntimeError, AttributeError, TypeError):  # an op missing, a layout refused
        return False
    tolerance = 1e-5 if layer.weight.dtype == torch.float32 else 2e-2
    return bool((got - want).abs().max() <= tolerance * max(want.abs().max().item(), 1.0))


def _ranked(layers: Sequence[EngineLinear], count: int, ways: Sequence[str]) -> list[str]:
    """``ways``, the fastest at ``count`` rows first (median of ``REPEATS`` passes)."""
    inputs = {
        n: torch.randn(count, n, generator=_SEED).to(layers[0].weight.dtype)
        for n in {layer.in_features for layer in layers}
    }
    times: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(REPEATS):  # interleaved, so a slow moment of the machine hits them all
        for way in ways:
            start = time.perf_counter()
            for layer in layers:
                layer.product(inputs[layer.in_features], way)
            times[way].append(time.perf_counter() - start)
    return sorted(ways, key=lambda way: sorted(times[way])[REPEATS // 2])


_SEED = torch.Generator().manual_seed(0)
