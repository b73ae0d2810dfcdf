"""Which attention a decoding step's rows take on this machine: measured, not assumed.

A step feeds each row one query (or a few, verifying drafts) over its cached keys, and two
forms compute that attention (``attention.py``): ``few_query_attention`` (float32 matrix
products, one per key-value head) and SDPA's CPU kernel with grouped heads. Their order
flips between CPUs: in bf16 at Qwen2.5-Coder-1.5B's shape SDPA took 0.12 ms a layer for one
query over 900 keys against 0.22 for the products on a Xeon with AMX, and 1.19 against 0.14
on an AMD EPYC without it (8 rows: 10.2 against 0.9), where SDPA was 40% of a 1.5B decoding
step. So the engine times both once at its model's shape and dtype and keeps the verdict
with the machine's other measurements (``measurements.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvboost_rag.core.model.attention import few_query_attention
from kvboost_rag.core.model.measurements import FORGETFUL, Measurements
from kvboost_rag.core.model.packed import median_seconds
from kvboost_rag.core.model.torch_compat import GROUPED_HEADS

KEYS = 512  # cached keys the forms are timed over
ROWS = (1, 8)  # one request's step; eight decoding together (under the step's mask)
REPEATS = 9  # timed calls of each form; their medians decide
UNTIMED = (torch.float32,)  # where nothing is timed: the dtypes that take the products


def few_queries(
    model: Any, attention: tuple[Any, ...], measurements: Measurements = FORGETFUL
) -> bool:
    """Whether the rows' steps of ``model`` take ``few_query_attention``: timed at its
    attention's shape (``attention``: its layers' modules) on its device, or recalled from
    ``measurements``. Off a CPU, or where the shape is unknown: float32 only."""
    shape = _shape(model, attention)
    if shape is None or model.device.type != "cpu":
        return model.dtype in UNTIMED
    key = {"dtype": str(model.dtype), "shape": list(shape), "measure": [KEYS, ROWS, REPEATS]}
    kept = measurements.recall("attention", key)
    if isinstance(kept, bool):
        return kept
    verdict = faster(shape, model.dtype)
    measurements.keep("attention", key, verdict)
    return verdict


def faster(shape: tuple[int, int, int], dtype: torch.dtype) -> bool:
    """Whether the products beat SDPA for 1 and 8 rows of one query over ``KEYS`` keys at
    ``shape`` (query heads, key-value heads, head size), both counts in one call, median of
    ``REPEATS`` calls each."""
    heads, kv_heads, dim = shape
    module = _Module(heads // kv_heads)
    generator = torch.Generator().manual_seed(0)
    cases = []
    for rows in ROWS:
        query = torch.randn(rows, heads, 1, dim, generator=generator).to(dtype)
        key, value = (torch.randn(rows, kv_heads, KEYS, dim, generator=generator).to(dtype)
                      for _ in range(2))  # fmt: skip
        mask = None if rows == 1 else torch.ones(rows, 1, 1, KEYS, dtype=torch.bool)
        cases.append((query, key, value, mask))

    def products() -> None:
        for query, key, value, mask in cases:
            few_query_attention(module, query, key, value, mask, None)

    def sdpa() -> None:  # what ``attention.attention`` runs when the products are off
        for query, key, value, mask in cases:
            if mask is None or not GROUPED_HEADS:
                sdpa_attention_forward(module, query, key, value, mask, scaling=None)
            else:
                F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)

    with torch.inference_mode():
        return median_seconds(products, REPEATS) < median_seconds(sdpa, REPEATS)


class _Module(torch.nn.Module):
    """What the attention functions read from a layer's module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _shape(model: Any, attention: tuple[Any, ...]) -> tuple[int, int, int] | None:
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None)
    if dim is None and heads:
        dim = getattr(config, "hidden_size", 0) // heads
    if not attention or not heads or not kv_heads or not dim or heads % kv_heads:
        return None
    return int(heads), int(kv_heads), int(dim)
