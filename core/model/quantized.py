"""Weight-only int8 / int4 linear layers on a CPU: ``from_pretrained(weights="int8" | "int4")``.

A decoding step at 1.5B is memory-bound: it reads every weight once per token, ~3 GB in
bf16. Stored in int8 (one scale per output row) or int4 (a scale and a zero per group of
``GROUP`` inputs, the layout llama.cpp's Q4 and GPTQ/AWQ use) a step reads half or a quarter
of that. The products run on PyTorch's own CPU kernels for weight-only quantized matmuls,
``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu`` (what gpt-fast and
torchao's CPU layouts call): the activations stay in the model's dtype.

Those kernels read the weight once per row of input, so they win for the few rows of a
decoding step and lose for a prefill's hundreds. A layer takes its kernel up to
``rows`` input rows (``measure``: the largest row count at which the kernel beat
dequantizing to the activation dtype and one dense product, on this machine and this
model's largest layer), and above that dequantizes its weight for the one product.

torchao was the first candidate (the issue asks for a maintained library): on this CPU
(2-core Xeon, bf16, a 8960 x 1536 layer) its ``Int8WeightOnlyConfig`` tensor dequantizes in
every product: 23 ms at 1 row against 8.7 ms for ``_weight_int8pack_mm`` and 10.4 ms for
the bf16 product (a loaded machine; ratios from one run), and torchao 0.18 has no CPU int4
layout. So the layers below hold what the aten kernels take and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from kvboost_rag.core.model.packed import median_seconds

WEIGHTS = ("int8", "int4")
GROUPS = (128, 64, 32)  # int4 group sizes, largest first: the first that divides a layer's inputs
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # where the kernel may still beat a dense product
DTYPES = (torch.bfloat16, torch.float32)


def check_weights(weights: object, device: torch.device) -> str | None:
    """``weights`` as ``from_pretrained`` takes it: None (the checkpoint's own) or a name,
    on a CPU (``device``). ``ValueError`` otherwise."""
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(
            f"weights must be one of {', '.join(map(repr, WEIGHTS))} or None (the "
            f"checkpoint's own), got {weights!r}"
        )
    if weights is not None and device.type != "cpu":
        raise ValueError(
            f"weights={weights!r} runs on a CPU; on a GPU install the 'awq' extra and load "
            "an AWQ checkpoint"
        )
    return weights  # type: ignore[return-value]


class QuantizedLinear(torch.nn.Module):
    """A ``nn.Linear``'s product on an int8 or int4 copy of its weight (the float weight is
    not kept). ``rows``: up to how many input rows the quantized kernel runs."""

    # buffers: int8's weight and row scales; int4's nibbles (two per byte, in order), the
    # kernel's packed copy, and per group and row a scale and a zero
    q: torch.Tensor
    scale: torch.Tensor
    nibbles: torch.Tensor
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, kind: str, rows: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kind, self.rows = kind, rows
        self.costs: dict[int, float] = {}  # seconds per row count, once measured (``quantize``)
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), False)
        if kind == "int8":
            scale = weight.float().abs().amax(1).clamp(min=1e-8) / 127
            q = torch.round(weight.float() / scale[:, None]).clamp(-128, 127)
            self.register_buffer("q", q.to(torch.int8))
            self.register_buffer("scale", scale.to(weight.dtype))
            return
        self.group = next(g for g in GROUPS if self.in_features % g == 0)
        groups = weight.float().reshape(self.out_features, -1, self.group)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = (high - low).clamp(min=1e-8) / 15
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
        # The kernel's form: w = (q - 8) * scale + zero, so zero is the value of q = 8.
        zero = low + 8 * scale
        q = q.reshape(self.out_features, self.in_features)
        self.register_buffer("nibbles", q[:, ::2] | (q[:, 1::2] << 4))  # for dequantizing
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        self.register_buffer("packed", packed)
        pairs = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # groups x out x 2
        self.register_buffer("scales_and_zeros", pairs.to(weight.dtype))

    @staticmethod
    def supports(linear: torch.nn.Module, kind: str) -> bool:
        """Whether ``linear`` is a plain float layer the kernels take."""
        if type(linear) is not torch.nn.Linear or linear.weight.dtype not in DTYPES:
            return False
        if linear.weight.device.type != "cpu":
            return False
        if kind == "int4":
            grouped = any(linear.in_features % g == 0 for g in GROUPS)
            return grouped and linear.out_features % 16 == 0
        return True

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the quantized copy stands for, in ``dtype``."""
        if self.kind == "int8":
            # int8 times ``dtype`` promotes to ``dtype``: the same values as converting q first,
            # in less than half the time (8960x1536: 4.5 against 10.5 ms, one busy machine)
            return torch.mul(self.q, self.scale.to(dtype)[:, None])
        low = (self.nibbles & 0xF).to(dtype)
        high = (self.nibbles >> 4).to(dtype)
        q = torch.stack([low, high], -1).reshape(self.out_features, -1, self.group)
        scale, zero = self.scales_and_zeros.to(dtype).transpose(0, 1).unbind(-1)
        return ((q - 8) * scale[..., None] + zero[..., None]).reshape(self.out_features, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > self.rows or x.dtype != self.dtype:
            out = F.linear(flat, self.dequantized(x.dtype), self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        out = self.kernel(flat.contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        if self.kind == "int8":
            return torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, self.group, self.scales_and_zeros
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={self.kind}, kernel up to {self.rows} rows"
        )


def quantize(model: Any, kind: str) -> list[QuantizedLinear]:
    """Replace ``model``'s plain linear layers (decoder and lm_head; not the embeddings)
    with ``QuantizedLinear``s of ``kind``, each taking its kernel up to the row count
    ``measure`` finds; the new layers. A tied lm_head gets a quantized copy of its own
    (the embedding table stays as it was: a lookup reads one row)."""
    if model.config.get_text_config().tie_word_embeddings:
        model.config.get_text_config().tie_word_embeddings = False
    head = model.get_output_embeddings()
    layers: list[QuantizedLinear] = []
    decoder: list[QuantizedLinear] = []  # all but the head
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if QuantizedLinear.supports(child, kind):
                layer = QuantizedLinear(child, kind)
                setattr(parent, name, layer)
                layers.append(layer)
                if child is not head:
                    decoder.append(layer)
    if layers:
        # Timed on the decoder's largest layer (an MLP's): the head's products are of the
        # last row alone in a forward of the engine's or generate's
        sample = max(decoder or layers, key=lambda layer: layer.in_features * layer.out_features)
        rows, costs = measure(sample)
        for layer in layers:
            layer.rows, layer.costs = rows, costs
    return layers


def measure(layer: QuantizedLinear, repeats: int = 3) -> tuple[int, dict[int, float]]:
    """The largest of ``ROW_COUNTS`` up to which ``layer``'s kernel was faster than
    dequantizing and a dense product here (0: never), and each count's seconds the way it
    is then taken (what ``draft_cost`` reads)."""
    best, winning, costs = 0, True, {}
    with torch.inference_mode():
        for count in ROW_COUNTS:
            x = torch.randn(count, layer.in_features, dtype=layer.dtype)
            kernel = median_seconds(lambda x=x: layer.kernel(x), repeats)
            dense = median_seconds(lambda x=x: F.linear(x, layer.dequantized(x.dtype)), repeats)
            winning = winning and kernel < dense
            best = count if winning else best
            costs[count] = kernel if winning else dense
    return best, costs


def row_cost(model: Any) -> Callable[[int], float] | None:
    """For a model with quantized layers, how many times one row's time a forward of
    ``rows`` rows takes (their products', as measured at load; the drafts a lone decoding
    row verifies, ``generation/drafting.py``); None for a model without: a dense weight's
    few extra rows cost a step little on a CPU, a quantized kernel's grow with them."""
    costs = next((m.costs for m in model.modules() if type(m) is QuantizedLinear and m.costs), None)
    if costs is None:
        return None

    def cost(rows: int) -> float:
        bucket = next((n for n in ROW_COUNTS if n >= rows), ROW_COUNTS[-1])
        return costs[bucket] / costs[1]

    return cost
