"""Linear layers on a GGUF file's own quantized blocks: ``from_pretrained(weights="gguf")``
on a CPU the kernel runs on (not yet the default: ``docs/guides/models.md`` says why).

A 4-bit tensor stays 4-bit, a Q6_K one 6-bit and an 8-bit one 8-bit, each level as the file
holds it (``gguf_blocks.py``), packed once for ``kernels/block_gemm.c``, which multiplies any
number of rows by them without dequantizing (``block_kernel.py``). Every row count takes the same
kernel, so a decoding step, a warmed request's tail and a prefill read the same weights and a
row's output does not depend on the rows beside it. A model's layers are put on a GGUF's
blocks, and the blocks cached, by ``gguf_layers.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvboost_rag.core.model import block_kernel
from kvboost_rag.core.model.gguf_blocks import Levels
from kvboost_rag.core.model.packed import median_seconds
from kvboost_rag.core.model.quantized import ROW_COUNTS

KERNEL_DTYPES = (torch.bfloat16, torch.float32)  # the activations the kernel reads and writes
PARTS = ("q", "scale", "mins", "units", "high")  # the packed tensors, [out / 16, ...] each


class BlockLinear(torch.nn.Module):
    """A ``nn.Linear``'s product on a GGUF tensor's blocks (the float weight is not kept)."""

    q: torch.Tensor  # the kernel's layout (block_gemm.c)
    scale: torch.Tensor
    mins: torch.Tensor
    units: torch.Tensor  # Q4_K's and Q6_K's units (empty for the other formats)
    high: torch.Tensor  # Q6_K's top 2 bits of each level (empty for the others)
    info: torch.Tensor  # out, in, zero, bits, group

    def __init__(
        self, packed: dict[str, torch.Tensor], bias: torch.Tensor | None, cache_root: Path
    ):
        super().__init__()
        info = packed["info"].tolist()
        self.out_features, self.in_features, self.zero, self.bits, self.group = info
        self.register_buffer("q", packed["q"])
        self.register_buffer("scale", packed["scale"])
        self.register_buffer("mins", packed.get("mins", torch.empty(0, dtype=torch.float16)))
        self.register_buffer("units", packed.get("units", torch.empty(0, dtype=torch.float16)))
        self.register_buffer("high", packed.get("high", torch.empty(0, dtype=torch.uint8)))
        self.register_buffer("info", packed["info"])
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), False)
        self.costs: dict[int, float] = {}  # seconds per row count, once measured (``measure``)
        self.cache_root = cache_root  # where the built kernel is
        # built now, not in a request
        self._kernel = block_kernel.Kernels(block_kernel.library(cache_root))
        self._at = block_kernel.Addresses()
        # the layers that read this one's input, multiplied together (``sibling_blocks.py``),
        # and this layer's index among them
        self.siblings: Any = None
        self.sibling = 0
        # the joint tensors of a cache's siblings, this layer's views of them (``use_blocks``)
        self.joint: dict[str, torch.Tensor] | None = None

    @property
    def kind(self) -> str:
        return f"int{self.bits}-gguf"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decoding step calls ~130 of these: each torch call left out here is ~1 us of a
        # call that reads a small layer in ~6 (``docs/bench/decode.md``).
        if self.siblings is not None:
            return self.siblings.output(self.sibling, x)  # type: ignore[no-any-return]
        if x.dtype not in KERNEL_DTYPES:
            x = x.float()
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty((*x.shape[:-1], self.out_features), dtype=x.dtype)
        rows, bf16 = x.numel() // self.in_features, x.dtype is torch.bfloat16
        at, threads = self._at.of(self._buffers, self.bias), torch.get_num_threads()
        if self.bits == 6:
            failed = self._kernel.k6(
                x.data_ptr(), bf16, rows, self.in_features, at.q, at.high, at.scale, at.units,
                at.bias, out.data_ptr(), self.out_features, threads,
            )  # fmt: skip
        elif at.units:
            failed = self._kernel.k4(
                x.data_ptr(), bf16, rows, self.in_features, at.q, at.scale, at.mins, at.units,
                at.bias, out.data_ptr(), self.out_features, threads,
            )  # fmt: skip
        else:
            failed = self._kernel.legacy(
                x.data_ptr(), bf16, rows, self.in_features, self.group, at.q, at.scale,
                at.mins, self.zero, self.bits, at.bias, out.data_ptr(), self.out_features,
                threads,
            )  # fmt: skip
        if failed:
            raise MemoryError(f"no memory for a {tuple(x.shape)} input's quantized copy")
        return out

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the blocks stand for ([out, in], ``dtype``)."""
        return unpack(self.q, self.scale, self.mins, self.info, self.units, self.high).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weights={self.kind}, group={self.group}"
        )


def supports(rows: int, inputs: int, lv: Levels) -> bool:
    per = 256 if lv.units is not None else max(8, lv.group)
    return rows % 16 == 0 and inputs % per == 0


def pack(lv: Levels) -> dict[str, torch.Tensor]:
    """The kernel's layout of ``lv`` (``block_gemm.c`` names it)."""
    rows, inputs = lv.q.shape
    q = torch.from_numpy(np.ascontiguousarray(lv.q))
    out = {}
    if lv.bits == 6:  # the top 2 bits of 4 quads' levels in a byte: bits 2k, 2k + 1 quad k's
        top = (q >> 4).view(rows // 16, 16, inputs // 16, 4, 4)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        high = (top << shifts).sum(3, dtype=torch.uint8)  # disjoint bits: the sum is an or
        out["high"] = high.permute(0, 2, 1, 3).contiguous()
        units = torch.from_numpy(np.ascontiguousarray(lv.units)).view(rows // 16, 16, -1)
        out["units"] = units.permute(0, 2, 1).contiguous()
        q = q & 0x0F
    if lv.bits == 8:
        q = q.view(rows // 16, 16, inputs // 4, 4).permute(0, 2, 1, 3)
    else:
        q = q.view(rows // 16, 16, inputs // 8, 2, 4)
        q = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 1, 3)
    out |= {
        "q": q.contiguous(),
        "scale": _by_block(lv.scale),
        "info": torch.tensor([rows, inputs, lv.zero, lv.bits, lv.group], dtype=torch.int64),
    }
    if lv.units is not None and lv.bits == 4:  # Q4_K: minimums in pairs, units per 256
        assert lv.mins is not None and lv.bits == 4 and lv.group == 32
        mins = torch.from_numpy(np.ascontiguousarray(lv.mins)).view(rows // 16, 16, -1, 2)
        out["mins"] = mins.permute(0, 2, 1, 3).contiguous()
        units = torch.from_numpy(np.ascontiguousarray(lv.units)).view(rows // 16, 16, -1, 2)
        out["units"] = units.permute(0, 2, 3, 1).contiguous()
    elif lv.mins is not None:
        out["mins"] = _by_block(lv.mins)
    return out


def packed_format(packed: dict[str, torch.Tensor]) -> tuple[Any, ...]:
    """What packed tensors of one format share, and siblings must share to be joined:
    inputs, bits, group, zero, and whether there are minimums and units."""
    _, inputs, zero, bits, group = packed["info"].tolist()
    has = [p in packed and packed[p].numel() > 0 for p in ("mins", "units")]
    return (inputs, bits, group, zero, *has)


def _by_block(per_row: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(per_row))
    return t.view(t.shape[0] // 16, 16, -1).permute(0, 2, 1).contiguous()


def unpack(
    q: torch.Tensor,
    scale: torch.Tensor,
    mins: torch.Tensor,
    info: torch.Tensor,
    units: torch.Tensor | None = None,
    high: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 [out, in]: ``pack``'s inverse, dequantized."""
    rows, inputs, zero, bits, group = info.tolist()
    if bits == 6:  # Q6_K: d * sc, and each level's top 2 bits from ``high``
        assert units is not None and high is not None
        unit = units.permute(0, 2, 1).reshape(rows, -1, 1).float()
        sc = scale.permute(0, 2, 1).reshape(rows, -1, 16).float()
        scale = (unit * sc).reshape(rows // 16, 16, -1).permute(0, 2, 1)
        top = high.permute(0, 2, 1, 3)[..., None, :]  # [rows/16, 16, inputs/16, 1, 4]
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        top = ((top >> shifts) & 3).reshape(rows, inputs)
    if units is not None and units.numel() and bits == 4:  # Q4_K: d * sc and -dmin * m
        unit = units.permute(0, 3, 1, 2).reshape(rows, -1, 1, 2).float()
        sc = scale.permute(0, 2, 1).reshape(rows, -1, 8).float()
        m = mins.permute(0, 2, 1, 3).reshape(rows, -1, 8).float()
        scale = (unit[..., 0] * sc).reshape(rows // 16, 16, -1).permute(0, 2, 1)
        mins = (-unit[..., 1] * m).reshape(rows // 16, 16, -1).permute(0, 2, 1)
    if bits == 8:
        levels_ = q.permute(0, 2, 1, 3).reshape(rows, inputs)
    else:
        nib = q.permute(0, 2, 1, 3)  # [rows/16, 16, inputs/8, 4]
        levels_ = torch.stack([nib & 0x0F, nib >> 4], 3).reshape(rows, inputs)
        if bits == 6:
            levels_ = levels_ | (top << 4)
    per_row = lambda t: t.permute(0, 2, 1).reshape(rows, -1).float().repeat_interleave(group, 1)  # noqa: E731
    w = per_row(scale) * (levels_.float() - zero)
    return w + per_row(mins) if mins.numel() else w


def measure(layer: BlockLinear, repeats: int = 3) -> dict[int, float]:
    """Seconds of ``layer``'s product per row count of ``ROW_COUNTS`` here: the kernel reads
    the weights once for up to 8 rows, yet its arithmetic grows with every row, so a draft's
    rows are not free (what ``quantized.row_cost`` gives drafting)."""
    out = {}
    with torch.inference_mode():
        for count in ROW_COUNTS:
            x = torch.randn(count, layer.in_features, dtype=torch.bfloat16)
            out[count] = median_seconds(lambda x=x: layer(x), repeats)
    return out
