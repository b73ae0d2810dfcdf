"""Every private torch op the engine calls, in one place, behind a tested range.

The CPU's fast paths run on kernels torch has no public API for: oneDNN's linear on a weight
reordered once (what inductor's freezing pass lowers ``nn.Linear`` to; ``packed.py``,
``linears.py``), the weight-only int8 and int4 matmuls (what gpt-fast and torchao's CPU
layouts call) and oneDNN's quantized linear (what torch's x86 quantization lowers to;
``quantized.py``), the CPU flash-attention kernel, which returns the log-sum-exp splitting
attention needs (``attention.py``), and oneDNN's answer to whether this CPU computes bf16
natively. They are called here only, each through one small function; ``TESTED`` is the
torch range the test suite runs them on (``tests/model/test_torch_compat.py`` checks it).

Unlike transformers (pinned to ``hf_compat.TESTED``), torch is not bounded in
``pyproject.toml``: an upper bound would make pip replace a user's torch, a multi-GB
download, for ops that only speed things up. Instead the ops are looked up by name before
a path that needs them is chosen. Where this torch lacks one, ``usable`` warns once, naming
the op, this torch, the tested range and the public path taken instead (``F.linear`` for
a packed weight, float32 where bf16 support cannot be asked); attention without the flash
kernel runs SDPA unsplit, as it did before this module; and a choice that has no public
path (``weights="int8" | "int4" | "int8-dynamic"``) is refused with the same facts
(``quantized.check_weights``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from packaging.version import Version

from kvboost_rag.core.caller_warnings import warn

# torch releases the private ops below were tested with: [low, high). torch itself stays
# unbounded in pyproject.toml (see above); tests/model/test_torch_compat.py checks this.
TESTED = (Version("2.13"), Version("2.14"))

# The ops each path needs, as ``namespace.name`` under ``torch.ops``.
PACKED_LINEAR = ("mkldnn._reorder_linear_weight", "mkldnn._linear_pointwise")
BF16_CHECK = ("mkldnn._is_mkldnn_bf16_supported",)
INT8_WEIGHTS = ("aten._weight_int8pack_mm",)
INT4_WEIGHTS = ("aten._convert_weight_to_int4pack_for_cpu", "aten._weight_int4pack_mm_for_cpu")
INT8_DYNAMIC = ("onednn.qlinear_prepack", "onednn.qlinear_pointwise")
FLASH_ATTENTION = ("aten._scaled_dot_product_flash_attention_for_cpu",)
OPS = (*PACKED_LINEAR, *BF16_CHECK, *INT8_WEIGHTS, *INT4_WEIGHTS, *INT8_DYNAMIC, *FLASH_ATTENTION)

# torch >= 2.5: SDPA's ``enable_gqa``, and its CPU flash kernel takes fewer key-value heads
# than query heads (each serving a group of them, ``repeat_kv``'s order) without a copy.
GROUPED_HEADS = Version(torch.__version__).release >= (2, 5)


def version_supported(version: str = torch.__version__) -> bool:
    low, high = TESTED
    return low <= Version(Version(version).base_version) < high


def tested_range() -> str:
    low, high = TESTED
    return f"torch>={low},<{high}"


def missing(*ops: str) -> list[str]:
    """Those of ``ops`` (``"namespace.name"`` under ``torch.ops``) this torch lacks."""
    return [op for op in ops if not _has(op)]


def usable(ops: tuple[str, ...], instead: str) -> bool:
    """Whether this torch has every op of ``ops``; where not, warns once that ``instead``
    (the public path the caller takes) runs."""
    lacking = missing(*ops)
    if lacking:
        _warn_once(f"{lacking_text(lacking)}: {instead} instead")
    return not lacking


def lacking_text(ops: list[str]) -> str:
    names = ", ".join(f"torch.ops.{op}" for op in ops)
    return f"torch {torch.__version__} has no {names} (tested on {tested_range()})"


@functools.cache
def _has(op: str) -> bool:
    namespace, name = op.split(".")
    return hasattr(getattr(torch.ops, namespace), name)


@functools.cache
def _warn_once(message: str) -> None:
    warn(message)


def mkldnn_bf16_supported() -> bool:
    """Whether oneDNN computes bf16 natively on this CPU (False where torch cannot say)."""
    if not usable(BF16_CHECK, "float32 where bf16 would be chosen"):
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def reorder_linear_weight(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` (out x in) reordered into oneDNN's blocked layout for products of about
    ``rows`` input rows (``mkldnn._reorder_linear_weight``)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> Any:
    """``F.linear(x, weight, bias)`` on ``weight`` reordered by ``reorder_linear_weight``
    (``mkldnn._linear_pointwise``, no fused activation)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def weight_int8pack_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (rows x in) times the int8 weight ``q`` (out x in) with one ``scale`` per output
    row, in ``x``'s dtype (``aten._weight_int8pack_mm``)."""
    return torch.ops.aten._weight_int8pack_mm(x, q, scale)


def convert_weight_to_int4pack(q: torch.Tensor) -> torch.Tensor:
    """The int32 nibbles ``q`` (out x in, values 0-15) in the layout
    ``weight_int4pack_mm`` reads (``aten._convert_weight_to_int4pack_for_cpu``, one inner
    k-tile)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)


def weight_int4pack_mm(
    x: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor
) -> torch.Tensor:
    """``x`` times the int4 weight ``packed`` (``convert_weight_to_int4pack``), each
    ``group`` inputs of a row with its scale and zero, (q - 8) * scale + zero
    (``aten._weight_int4pack_mm_for_cpu``)."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros)


def qlinear_prepack(q: torch.Tensor) -> Any:
    """The int8 weight ``q`` (out x in) in oneDNN's opaque packed form for
    ``qlinear_pointwise`` (``onednn.qlinear_prepack``, no input shape hint)."""
    return torch.ops.onednn.qlinear_prepack(q, None)


def qlinear_pointwise(
    x: torch.Tensor,
    x_zero_point: int,
    packed: Any,
    weight_scales: torch.Tensor,
    weight_zero_points: torch.Tensor,
) -> torch.Tensor:
    """The uint8 input ``x`` (scale 1, ``x_zero_point``) times the packed int8 weight
    (``qlinear_prepack``) with per-row ``weight_scales`` and ``weight_zero_points``, as float32
    sums, no bias or activation (``onednn.qlinear_pointwise``)."""
    return torch.ops.onednn.qlinear_pointwise(
        x, 1.0, x_zero_point, packed, weight_scales, weight_zero_points,
        None, 1.0, 0, torch.float32, "none", [], "",
    )  # fmt: skip


def cpu_flash_attention() -> Callable[..., Any] | None:
    """torch's CPU flash-attention kernel, which returns the log-sum-exp beside the output
    (``F.scaled_dot_product_attention`` does not); None where this torch lacks it."""
    return getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
