"""A decoding step's attention on our own CPU kernel (``kernels/few_query_attention.c``).

``attention.few_query_attention`` in torch copies each layer's whole cached keys and values
to float32 before its two products, every step: at Qwen2.5-Coder-1.5B (bf16, 28 layers, two
key-value heads of 128) that is 57 M values written and read again a step at 4k keys, and a
dozen operators a layer. The kernel reads the cache in its own dtype, widens it in
registers and computes the same float32 scores, softmax and sums in one call a layer,
split over the threads by chunks of keys. No maintained CPU kernel does this: SDPA's CPU
flash kernel blocks over queries and rows, so one query leaves it one thread's work
(``attention.py``). It takes bf16 or float32 queries and caches, a boolean mask or none,
and head sizes that are a multiple of 16; ``compute`` returns None for anything else, and
the torch form runs. ``tests/model/test_attention_kernel.py`` checks it against that form.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch

from kvboost_rag.core.model import block_kernel
from kvboost_rag.core.model.loading import default_cache_root

DTYPES = (torch.bfloat16, torch.float32)


@cache
def _library() -> Any:
    """The built kernel, or None where it cannot run (built once, on first use)."""
    return block_kernel.optional(default_cache_root(), block_kernel.ATTENTION)


def prepare() -> bool:
    """Build the kernel now (an engine's start, not its first request); whether it runs."""
    return _library() is not None


def compute(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor | None:
    """``few_query_attention``'s float32 result for ``query`` [batch, heads, q, dim] over
    ``key``/``value`` [batch, kv_heads, keys, dim] under a boolean ``mask`` [batch, 1, q,
    keys] (True attends) or none: [batch, q, heads, dim] in the query's dtype. None where the
    kernel does not take these tensors."""
    if not _takes(query, key, value, mask):
        return None
    lib = _library()
    if lib is None:
        return None
    batch, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    out = torch.empty(batch, q, heads, dim, dtype=query.dtype)
    failed = lib.few_query_attention(
        query.data_ptr(), query.dtype == torch.bfloat16, key.data_ptr(), value.data_ptr(),
        key.dtype == torch.bfloat16, None if mask is None else mask.data_ptr(),
        batch, heads, kv_heads, q, keys, dim, *query.stride()[:3], *key.stride()[:2],
        *value.stride()[:2], *((0, 0) if mask is None else (mask.stride(0), mask.stride(2))),
        scale, out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError(f"no memory for the attention of {tuple(query.shape)} queries")
    return out


def _takes(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None
) -> bool:
    dim = query.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype in DTYPES
        and key.dtype in DTYPES
        and value.dtype == key.dtype
        and dim % 16 == 0
        and query.shape[1] % key.shape[1] == 0
        and query.stride(-1) == 1
        and all(t.stride(-1) == 1 and t.stride(-2) == dim for t in (key, value))
        and (mask is None or (mask.dtype == torch.bool and mask.stride(-1) == 1))
        and not torch.compiler.is_compiling()
    )
