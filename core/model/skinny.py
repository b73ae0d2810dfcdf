"""Linear layers over a few rows, in the engine's forwards on a CPU: ``W @ x.T``.

A step that verifies drafted tokens, or steps several rows at once, multiplies every decoder
weight by 2-32 rows. torch's ``F.linear`` (``x @ W.T``) hands that to a GEMM that, on a
CPU, takes up to twice as long for 2-8 rows as for one, although each weight is read from
memory once either way. The same product taken the other way round, ``(W @ x.T).T``, reads
the weight as it is stored and costs about what one row does. Measured on a 2-core AMD EPYC
(AVX2, fp32), SmolLM2-135M's 210 decoder weights, one pass each (ms):

| rows | 1 | 2 | 4 | 8 | 16 | 32 | 64 | 256 | 900 |
|---|---|---|---|---|---|---|---|---|---|
| ``F.linear`` | 36 | 54 | 61 | 49 | 59 | 82 | 134 | 378 | 1174 |
| ``W @ x.T`` | 36 | 27 | 24 | 36 | 44 | 69 | 117 | 366 | 1229 |

In the model, one row verifying 2 / 4 / 8 tokens over 900 cached ones: 142 / 147 / 155 ms
a step before, 94 / 104 / 139 ms after; one token 96 ms either way.

Which row counts take it is measured per model when the engine warms up (``measure``): on
the model's own weights (enough of them to stream from memory, as a step does), each count
that is faster transposed, after a check that both give the same product. The model's
``nn.Linear`` decoder layers become ``SkinnyLinear`` (``install``), a subclass that takes
the transposed product only inside the engine's forwards (``rows``), so every other caller
of the model runs ``nn.Linear.forward`` as before.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

CANDIDATES = (2, 4, 8, 12, 16, 24, 32)  # row counts measured
STREAMED_BYTES = 64 << 20  # weights timed per pass: more than a CPU's last-level cache
REPEATS = 3

# the row counts the forward running now may take transposed (empty: none)
_ROWS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar(
    "kvboost_skinny_rows", default=frozenset()
)


class SkinnyLinear(torch.nn.Linear):
    """``nn.Linear`` that, for the row counts ``rows`` allows, computes ``(W @ x.T).T``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # a user's torch.compile traces nn.Linear, unbroken
            return super().forward(x)
        allowed = _ROWS.get()
        if not allowed or x.dim() < 2:
            return super().forward(x)
        count = x.numel() // x.shape[-1]
        if count not in allowed:
            return super().forward(x)
        return transposed(x, self.weight, self.bias)


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x.T``."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.mm(weight, flat.T).T.contiguous()
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


@contextmanager
def rows(allowed: frozenset[int]) -> Iterator[None]:
    """Inside, ``SkinnyLinear`` layers take the transposed product for ``allowed`` counts."""
    token = _ROWS.set(allowed)
    try:
        yield
    finally:
        _ROWS.reset(token)


def install(model: Any) -> list[SkinnyLinear]:
    """Make the plain ``nn.Linear`` layers of ``model``'s decoder ``SkinnyLinear`` (the same
    modules and weights; their forward is unchanged outside ``rows``); the layers."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    if decoder is None or torch.device(model.device).type != "cpu":
        return []
    layers = []
    for module in decoder.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = SkinnyLinear
        if type(module) is SkinnyLinear:
            layers.append(module)
    return layers


def measure(model: Any) -> frozenset[int]:
    """The row counts at which ``model``'s decoder layers are faster transposed here (none
    on a GPU, for a model without plain linear layers, or where the products differ)."""
    layers = install(model)
    if not layers or model.dtype not in (torch.float32, torch.bfloat16):
        return frozenset()
    timed, size = [], 0
    for layer in layers:
        timed.append(layer)
        size += layer.weight.numel() * layer.weight.element_size()
        if size >= STREAMED_BYTES:
            break
    with torch.inference_mode():
        if not _same(timed[0]):
            return frozenset()
        _faster(timed, 1)  # first-use costs
        faster = {n for n in CANDIDATES if _faster(timed, n)}
    # a count between two measured ones goes with the one above it
    return frozenset(n for n in range(2, CANDIDATES[-1] + 1) if _bucket(n) in faster)


def _bucket(count: int) -> int:
    return min(n for n in CANDIDATES if n >= count)


def _same(layer: torch.nn.Linear) -> bool:
    x = torch.randn(4, layer.in_features, generator=_SEED).to(layer.weight.dtype)
    want = F.linear(x, layer.weight, layer.bias).float()
    got = transposed(x, layer.weight, layer.bias).float()
    tolerance = 1e-5 if layer.weight.dtype == torch.float32 else 2e-2
    return bool((got - want).abs().max() <= tolerance * max(want.abs().max().item(), 1.0))


def _faster(layers: Sequence[torch.nn.Linear], count: int) -> bool:
    inputs = {
        n: torch.randn(count, n, generator=_SEED).to(layers[0].weight.dtype)
        for n in {layer.in_features for layer in layers}
    }

    def plain() -> None:
        for layer in layers:
            F.linear(inputs[layer.in_features], layer.weight, layer.bias)

    def skinny() -> None:
        for layer in layers:
            transposed(inputs[layer.in_features], layer.weight, layer.bias)

    times: dict[Any, list[float]] = {plain: [], skinny: []}
    for _ in range(REPEATS):  # interleaved, so a slow moment of the machine hits both
        for fn in (plain, skinny):
            start = time.perf_counter()
            fn()
            times[fn].append(time.perf_counter() - start)
    return sorted(times[skinny])[REPEATS // 2] < sorted(times[plain])[REPEATS // 2]


_SEED = torch.Generator().manual_seed(0)
