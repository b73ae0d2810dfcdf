"""The bytes of weights one decoding step reads: what bounds its time on a CPU.

A one-row step is memory-bound: it streams every weight it multiplies by once, so the
machine's read bandwidth over these bytes is a floor under its time (the decode study
prints both). What a step reads is not what the model holds:

- an embedding table is looked up, one row per token, not streamed (a table tied to the
  head is streamed once, as the head);
- a quantized layer keeps tensors its kernel does not read (``quantized.py``: int4's
  ``nibbles``, kept for dequantizing; int8-dynamic's own ``q``, kept for the fingerprint,
  while oneDNN reads its packed copy, an attribute and not a buffer), and a GGUF block
  layer (``blocks.py``) its ``info`` header, which stays in Python;
- the packed copies of float weights (``linears.py``, ``packed.py``) replace the weight
  in a product, so a weight is counted once whichever way it is taken.

The layers are told apart by their ``kind`` (``QuantizedLinear.kind``, ``BlockLinear.kind``),
not their classes, so this module depends on nothing but torch.
"""

from __future__ import annotations

from typing import Any

import torch

# What one row's product of each weight kind reads (attribute names; a missing one, such as
# an absent bias, reads nothing). int8 and int4 up to ``rows`` rows take their kernel.
KERNEL_READS = {
    "int8": ("q", "scale", "bias"),  # _weight_int8pack_mm
    "int4": ("packed", "scales_and_zeros", "bias"),  # _weight_int4pack_mm_for_cpu
    "int8-dynamic": ("onednn_weight", "scale", "zero_points", "bias"),  # onednn qlinear
    "gguf": (
        "q",
        "scale",
        "mins",
        "units",
        "high",
        "bias",
    ),  # block_gemm.c; "info" is read in Python
}
# A QuantizedLinear whose kernel never beat a dense product here (``rows`` 0) dequantizes
# for every row count: int4 then reads its ``nibbles`` (int8 the levels its kernel reads);
# the float weight it writes and reads again is not counted, so such a step reads more.
DEQUANTIZED_READS = {"int4": ("nibbles", "scales_and_zeros", "bias")}


def step_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s weights one decoding step of one row reads: every parameter
    and buffer in full (numel x element size, each tensor once however many modules share
    it), but one row of each embedding table, and of each quantized layer only what its
    kernel reads (``KERNEL_READS``). The head counts in full, tied to the embeddings or not."""
    streamed: dict[int, int] = {}  # tensor id -> bytes, read in full
    looked_up: dict[int, int] = {}  # embedding table id -> one row's bytes
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            row = module.weight[0]
            looked_up[id(module.weight)] = row.numel() * row.element_size()
            continue
        for tensor in _read_by(module):
            streamed[id(tensor)] = tensor.numel() * tensor.element_size()
    rows = sum(size for key, size in looked_up.items() if key not in streamed)
    return sum(streamed.values()) + rows


def _read_by(module: torch.nn.Module) -> list[torch.Tensor]:
    """The tensors of ``module``'s own (not its children's) that a step reads."""
    names = _kernel_reads(module)
    if names is None:
        own = (*module.parameters(recurse=False), *module.buffers(recurse=False))
        return list(own)
    found = (getattr(module, name, None) for name in names)
    return [t for t in found if isinstance(t, torch.Tensor)]


def _kernel_reads(module: torch.nn.Module) -> tuple[str, ...] | None:
    """For a quantized layer, the names of what one row's product reads; None otherwise."""
    kind: Any = getattr(module, "kind", None)
    if not isinstance(kind, str):
        return None
    if kind.endswith("-gguf"):  # BlockLinear: "int4-gguf", "int8-gguf"
        return KERNEL_READS["gguf"]
    if kind not in KERNEL_READS:
        return None
    if getattr(module, "rows", 1) == 0 and kind in DEQUANTIZED_READS:
        return DEQUANTIZED_READS[kind]
    return KERNEL_READS[kind]
