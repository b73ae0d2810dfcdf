"""Quantized linear layers on a CPU: ``from_pretrained(weights="int8" | "int4" | "int8-dynamic")``.

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

``_weight_int8pack_mm`` converts every weight in its inner loop: over 24 distinct
8960 x 1536 layers (more than the caches hold) it read int8 at 9.7 GB/s where ``F.linear``
read bf16 at 14.4 GB/s (one row, 2-core Xeon), and its time grows with every row a draft
adds. ``"int8-dynamic"`` keeps the same int8 weights and quantizes each input row to int8
as well (symmetric, one scale per row, computed on the fly: what torchao calls dynamic int8
activations and vLLM W8A8), so the product is integer arithmetic in oneDNN's kernel
(``onednn.qlinear_pointwise``, the op PyTorch's own x86 quantization lowers to), whose
time stays about flat up to 16 rows and which a prefill takes too. At 1.5B its one-row
decoding step took 174 ms against int8's 191 and bf16's 225 (``docs/bench/decode.md``).
Integer sums are exact and each row has its own scale, so a row's output does not depend
on which rows share its forward. It changes the numerics beyond the weights (8-bit
inputs), so it is its own choice with its own accuracy on the front
(``docs/guides/models.md``), and it holds the int8 weight twice (its own, which the
fingerprint and ``dequantized`` read, and oneDNN's packed copy: two bytes a weight, like
bf16).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal, get_args

import torch
import torch.nn.functional as F

from kvboost_rag.core.model import torch_compat
from kvboost_rag.core.model.packed import median_seconds

log = logging.getLogger(__name__)

Weights = Literal["int8", "int4", "int8-dynamic", "gguf", "dense"]
WEIGHTS: tuple[str, ...] = get_args(Weights)
# Quantized here from float weights (min/max rounding); "gguf" keeps a GGUF file's own blocks
# (``blocks.py``) and "dense" its dequantized float weights.
REQUANTIZED = ("int8", "int4", "int8-dynamic")
GROUPS = (128, 64, 32)  # int4 group sizes, largest first: the first that divides a layer's inputs
ROW_COUNTS = (1, 2, 4, 8, 16, 32)  # where the kernel may still beat a dense product
DTYPES = (torch.bfloat16, torch.float32)
# The private torch ops each kind's products run on (no public op computes them).
KERNEL_OPS = {
    "int8": torch_compat.INT8_WEIGHTS,
    "int4": torch_compat.INT4_WEIGHTS,
    "int8-dynamic": torch_compat.INT8_DYNAMIC,
}


def check_weights(weights: object, device: torch.device) -> str | None:
    """``weights`` as ``from_pretrained`` takes it: None (the file decides) or a name,
    on a CPU (``device``). ``ValueError`` otherwise."""
    if weights is not None and weights not in WEIGHTS:
        raise ValueError(
            f"weights must be one of {', '.join(map(repr, WEIGHTS))} or None (the default: "
            f"the file decides), got {weights!r}"
        )
    if weights not in (None, "dense") and device.type != "cpu":
        raise ValueError(
            f"weights={weights!r} runs on a CPU; on a GPU install the 'awq' extra and load "
            "an AWQ checkpoint"
        )
    if weights == "int8-dynamic" and not torch.backends.mkldnn.is_available():
        raise ValueError(
            "weights='int8-dynamic' needs PyTorch built with oneDNN (x86 CPUs); "
            "weights='int8' runs everywhere"
        )
    lacking = torch_compat.missing(*KERNEL_OPS.get(str(weights), ()))
    if lacking:
        raise ValueError(
            f"weights={weights!r} runs on private torch kernels, and "
            f"{torch_compat.lacking_text(lacking)}: install a torch in that range, or load "
            "with weights='dense' or without weights="
        )
    return weights  # type: ignore[return-value]


# The GGUF block formats a file may hold for its blocks to be the default (``weights=None``):
# those whose answers on the blocks were measured against the dequantized weights'. Q4_K and
# Q6_K (Qwen2.5-Coder-1.5B's file: 96 of 96 fidelity questions right on both), Q5_0 and Q8_0
# (beside them in the 0.5B's: 64 of 72 right on both, each cell alike), all four in Gemma 3
# 270M's (``docs/guides/models.md``). A file holding another (SmolLM2's Q4_1, whose int8
# inputs changed an answer) stays dense unless ``weights="gguf"`` asks.
DEFAULT_BLOCKS = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0"})
FLOAT_FORMATS = frozenset({"F32", "F16", "BF16"})


def weights_for(
    weights: str | None,
    gguf_formats: Callable[[], Mapping[str, int]] | None,
    device: torch.device,
    dtype: torch.dtype,
    model_kwargs: Mapping[str, Any],
) -> str | None:
    """What a model's linear layers are stored as: ``weights`` as checked by
    ``check_weights`` ("dense": the checkpoint's float weights, as None), or for None, what the
    file decides: a GGUF (``gguf_formats()``: its parameters per format; None for a float
    checkpoint) whose block formats are all ``DEFAULT_BLOCKS`` runs on its blocks ("gguf")
    on a CPU that runs their kernel, in bf16 or fp32, unless ``model_kwargs`` place or
    quantize the model (``device_map``, ``quantization_config``). ``ValueError`` for "gguf"
    where it cannot be."""
    from kvboost_rag.core.model import block_kernel

    if weights is None:
        chosen = None
        placed = model_kwargs.keys() & {"device_map", "quantization_config"}
        if gguf_formats is not None and device.type == "cpu" and dtype in DTYPES and not placed:
            blocks = set(gguf_formats()) - FLOAT_FORMATS
            chosen = "gguf" if blocks and blocks <= DEFAULT_BLOCKS else None
            if chosen and (reason := block_kernel.missing()):
                log.info("the GGUF's weights are dequantized: its blocks' kernel %s", reason)
                chosen = None
        return chosen
    if weights == "gguf":
        if gguf_formats is None:
            raise ValueError(
                "weights='gguf' keeps a GGUF file's own blocks: load a GGUF file or an embedded "
                "alias, or pick 'int8' / 'int4' to quantize a float checkpoint"
            )
        reason = block_kernel.missing()
        if reason:
            raise ValueError(f"weights='gguf' needs the block kernel, which cannot run: {reason}")
    return None if weights == "dense" else weights


class QuantizedLinear(torch.nn.Module):
    """A ``nn.Linear``'s product on an int8 or int4 copy of its weight (the float weight is
    not kept). ``rows``: up to how many input rows the quantized kernel runs."""

    # buffers: int8's weight and row scales; int4's nibbles (two per byte, in order), the
    # kernel's packed copy, and per group and row a scale and a zero; int8-dynamic's int8
    # buffers and the bits its inputs are quantized to (so its fingerprint is not int8's)
    q: torch.Tensor
    scale: torch.Tensor
    input_bits: torch.Tensor
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
        if kind in ("int8", "int8-dynamic"):
            scale = weight.float().abs().amax(1).clamp(min=1e-8) / 127
            q = torch.round(weight.float() / scale[:, None]).clamp(-128, 127).to(torch.int8)
            self.register_buffer("q", q)
            if kind == "int8":
                self.register_buffer("scale", scale.to(weight.dtype))
                return
            self.register_buffer("scale", scale)  # float32: the kernel scales its int32 sums
            if self.bias is not None:  # added to the float32 sums
                self.bias = torch.nn.Parameter(self.bias.float(), False)
            self.register_buffer("input_bits", torch.tensor(8, dtype=torch.int8))
            # oneDNN's packed layout (an opaque tensor, no state of its own: not a buffer)
            self.onednn_weight = torch_compat.qlinear_prepack(q)
            self.zero_points = torch.zeros(self.out_features, dtype=torch.int32)
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
        packed = torch_compat.convert_weight_to_int4pack(q.to(torch.int32))
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

    @property
    def dynamic(self) -> bool:
        """Whether the inputs are quantized too (``int8-dynamic``): then every row count
        takes the kernel, whose numerics a dense product would not reproduce."""
        return self.kind == "int8-dynamic"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the quantized copy stands for, in ``dtype``."""
        if self.kind != "int4":
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
        if self.dynamic:
            return self.kernel(flat).view(*x.shape[:-1], self.out_features)
        if flat.shape[0] > self.rows or x.dtype != self.dtype:
            out = F.linear(flat, self.dequantized(x.dtype), self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        out = self.kernel(flat.contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def kernel(self, flat: torch.Tensor) -> torch.Tensor:
        if self.dynamic:
            return self.dynamic_product(flat)
        if self.kind == "int8":
            return torch_compat.weight_int8pack_mm(flat, self.q, self.scale)
        return torch_compat.weight_int4pack_mm(flat, self.packed, self.group, self.scales_and_zeros)

    def dynamic_product(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` quantized to int8 per row, times the int8 weight in integers; each row's
        sums scaled by its input's and each output's weight scale, in ``flat``'s dtype."""
        x = flat.float()
        step = x.abs().amax(1, keepdim=True).clamp(min=1e-30) / 127
        # Symmetric int8 values (|x / step| <= 127), given to oneDNN as uint8 with zero point
        # 128: the same sums, and its uint8 kernels have no slow shapes (int8 inputs took
        # 7.4 ms for a 1536 x 256 layer at one row against 0.04 ms, 2-core Xeon)
        q = torch.round(x / step).add_(128).to(torch.uint8)
        sums = torch_compat.qlinear_pointwise(
            q, 128, self.onednn_weight, self.scale, self.zero_points
        )
        out = sums.mul_(step) if self.bias is None else torch.addcmul(self.bias, sums, step)
        return out.to(flat.dtype)

    def extra_repr(self) -> str:
        rows = "every row count" if self.dynamic else f"up to {self.rows} rows"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={self.kind}, kernel {rows}"
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
            if layer.dynamic:  # the kernel at every count: nothing to weigh it against
                best, costs[count] = count, kernel
                continue
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
    costs = next(
        (
            m.costs
            for m in model.modules()
            if isinstance(getattr(m, "costs", None), dict) and m.costs
        ),
        None,
    )
    if costs is None:
        return None

    def cost(rows: int) -> float:
        bucket = next((n for n in ROW_COUNTS if n >= rows), ROW_COUNTS[-1])
        return costs[bucket] / costs[1]

    return cost
