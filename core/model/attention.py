"""The attention the engine's forwards run, through transformers' ``AttentionInterface``.

A forward that continues a cached prefix (new tokens at positions ``past..past+q`` over
keys ``0..past+q``) needs a lower-right causal mask, and transformers' SDPA path then
materializes it: the CPU kernel computes every masked block (twice the work of the causal
square) and GQA keys are repeated. Measured on SmolLM2-135M (bf16, 2 cores): 200 cached +
700 new tokens prefilled at 1.28x a plain prefill's time per token, so a short cached
prefix was not worth reusing. Split in two, the same attention needs no mask: the new
tokens over the cached prefix (every key visible) and over themselves (the causal square,
SDPA's fast path), merged by their log-sum-exp, exactly the softmax over both.

A decoding step of one request is one query, and there the CPU flash kernel is the slow
choice: it blocks over queries and batch rows, so a single query leaves it little to
parallelize. SmolLM2's 30 layers spent 17 ms per step in it over 900 keys, against 4 ms for
the same attention as two matrix products per key-value head in float32 (``kvboost-rag
bench step``, 2-core AMD EPYC, bf16). Rows decoding together feed one query each, or a few
when they verify drafts, under the step's mask, and transformers' SDPA path then copies
every key-value head for its query heads (``repeat_kv``): 8 rows of one query over 900 keys
took 45 ms there in fp32 against 29 ms without the copy, and 8 rows of 3 queries over 1024
keys 131 ms through the kernel's grouped heads against 76 ms as matrix products. So the
engine's own forwards (``Forward.rows``) take that form for up to ``FEW_QUERIES`` queries
a row (``few_query_attention``): scores, softmax and weighted sum in float32, the query
heads of a group and their queries one matrix against their key-value head, read once, on
our own kernel where it runs (``attention_kernel.py``: the cache read in its own dtype, not
copied to float32 every step).
Which form is faster depends on the CPU: in bf16 SDPA's grouped heads beat it on a Xeon
with AMX (0.12 against 0.22 ms a layer for one query over 900 keys at Qwen2.5-Coder-1.5B's
shape), and lost tenfold on an AMD EPYC without AMX (1.19 against 0.14 ms; 8 rows 10.2
against 0.9), where they were 40% of a decoding step. So the engine measures both forms at
its model's shape once per machine (``attention_choice.py``) and ``Forward.few`` carries the
verdict.

Registered as ``kvboost_sdpa`` (``install``) on the engine's own copy of the model
(``view.py``; the user's model keeps its attention). What a forward may take is said by a
``Forward`` the engine passes to the model's call as its ``kvboost`` keyword, which
transformers hands to every attention layer with the rest of the call's keywords. For a
forward without one, and for layers it cannot split (a sliding window shorter than the
keys, a device without the CPU kernel), it is transformers' own ``sdpa_attention_forward``
on the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from kvboost_rag.core.model import attention_kernel
from kvboost_rag.core.model.hf_compat import attention_implementation
from kvboost_rag.core.model.torch_compat import GROUPED_HEADS, cpu_flash_attention

NAME = "kvboost_sdpa"
FEW_QUERIES = 4  # queries per row that ``few_query_attention`` takes under a mask
KEYWORD = "kvboost"  # the model call's keyword that carries a ``Forward``


@dataclass(frozen=True)
class Forward:
    """What one of the engine's forwards may compute, passed as ``model(..., kvboost=...)``.

    ``past``: the fed tokens are one sequence continuing ``past`` cached ones, contiguous
    (its attention may split there, ``split_attention``), with ``windows[i]`` the sliding
    window of layer ``i`` (None: full attention); None: no such claim. ``rows``: a forward
    over the engine's slot rows (``Runner``): its decoding steps' layers may take
    ``few_query_attention`` (where ``few``: measured faster on this machine,
    ``attention_choice.py``) and grouped heads under a mask. ``probe``: (a score vector,
    how many leading key positions it covers): every layer adds the attention its queries
    pay to each of those keys (softmax weights summed over heads and queries) into it,
    beside its usual output (what a repair probe needs). ``compiled``: the engine's compiled
    one-row step (``compiled.py``): traced, attention is ``few_query_attention`` in the
    model's dtype (matrix products inductor schedules around, as transformers' eager
    attention computes) instead of SDPA's kernel."""

    past: int | None = None
    windows: tuple[int | None, ...] = ()
    rows: bool = False
    few: bool = False
    probe: tuple[torch.Tensor, int] | None = None
    compiled: bool = False


COMPILED = Forward(compiled=True)  # the one the compiled step passes (one object: one guard)


def install(model: Any) -> bool:
    """Run ``model``'s attention through ``kvboost_sdpa`` when it runs SDPA; whether it does."""
    if attention_implementation(model) not in ("sdpa", NAME):
        return False
    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    if attention_implementation(model) != NAME:
        model.set_attn_implementation(NAME)
    if model.device.type == "cpu":
        attention_kernel.prepare()  # built now (once a machine), not in a first request
    return True


def runs_sdpa(model: Any) -> bool:
    """Whether the model's attention takes SDPA's (boolean) masks."""
    return attention_implementation(model) in ("sdpa", NAME)


def steered(model: Any) -> bool:
    """Whether the model runs this attention: its forwards take a ``Forward``."""
    return attention_implementation(model) == NAME


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    forward: Forward | None = kwargs.pop(KEYWORD, None)
    compiling = torch.compiler.is_compiling()
    if compiling and forward is not None and forward.compiled:  # the engine's compiled step:
        # products in the model's dtype (SmolLM2-135M's compiled step: 24 ms this way against
        # 34 with SDPA, bf16, 900 keys)
        out = few_query_attention(
            module, query, key, value, attention_mask, scaling, compute=query.dtype
        )
        return out, None
    if compiling or forward is None:  # a user's torch.compile, or not the engine's forward:
        # transformers' SDPA, unbroken
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    if forward.probe is not None:
        into, keys = forward.probe
        _add_scores(into, keys, module, query, key, attention_mask, scaling)
    if forward.rows and forward.few and _few_queries(query, attention_mask, dropout, kwargs):
        return few_query_attention(module, query, key, value, attention_mask, scaling), None
    if forward.rows and _grouped_under_mask(
        module, query, attention_mask, dropout, kwargs, forward.few
    ):
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None
    past = forward.past
    if past is None or not _splittable(module, query, key, past, forward.windows):
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
    return split_attention(module, query, key, value, past, scaling), None


def _add_scores(
    into: torch.Tensor,
    keys: int,
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> None:
    """Softmax weights of every query over every key (under the forward's mask, or causal
    for queries that are the last positions), summed into ``into`` for the first keys."""
    groups = getattr(module, "num_key_value_groups", 1)
    key = repeat_kv(key, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    weights = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
        weights = weights.masked_fill(~allowed[..., : weights.shape[-1]], float("-inf"))
    else:
        q, k = query.shape[2], key.shape[2]
        future = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)
        weights[..., k - q :] = weights[..., k - q :].masked_fill(future, float("-inf"))
    into.add_(torch.softmax(weights, dim=-1)[0, :, :, :keys].sum(dim=(0, 1)))


def _splittable(
    module: Any, query: torch.Tensor, key: torch.Tensor, past: int, windows: tuple[int | None, ...]
) -> bool:
    layer = getattr(module, "layer_idx", None)
    if layer is None or layer >= len(windows):
        return False  # not a layer the engine knows: its window is unknown
    window = windows[layer]
    return (
        query.device.type == "cpu"
        and past > 0
        and query.shape[0] == 1
        and query.shape[2] > 1
        and key.shape[2] == past + query.shape[2]
        and (window is None or window >= key.shape[2])
        and getattr(module, "is_causal", True)
        and cpu_flash_attention() is not None
    )


def split_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    past: int,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention of ``query`` (the last positions of ``key``) as two unmasked
    SDPA calls merged by log-sum-exp; returns ``[batch, q, heads, dim]``."""
    if not GROUPED_HEADS:
        groups = getattr(module, "num_key_value_groups", 1)
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    flash = cpu_flash_attention()
    assert flash is not None
    old, old_lse = flash(query, key[:, :, :past], value[:, :, :past], scale=scaling)[:2]
    new, new_lse = flash(
        query, key[:, :, past:], value[:, :, past:], is_causal=True, scale=scaling
    )[:2]
    top = torch.maximum(old_lse, new_lse)
    old_w, new_w = (old_lse - top).exp(), (new_lse - top).exp()
    total = old_w + new_w
    out = old.float() * (old_w / total)[..., None] + new.float() * (new_w / total)[..., None]
    return out.to(query.dtype).transpose(1, 2).contiguous()


def _grouped_under_mask(
    module: Any,
    query: torch.Tensor,
    mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
    few: bool,
) -> bool:
    # Several queries under a mask (a batched step with drafts, a repair pass): transformers
    # repeats each key-value head for its query heads (``repeat_kv``), copying the keys
    # and values of every layer, because CUDA's kernels take grouped heads only without a
    # mask. The CPU kernel takes them with one, with the same output: 8 rows of 2 queries
    # over 1261 keys measured 6.5 ms with the copy and 1.9 ms without.
    return (
        GROUPED_HEADS
        and getattr(module, "num_key_value_groups", 1) > 1
        and mask is not None
        and (query.shape[2] > FEW_QUERIES or not few)
        and query.device.type == "cpu"
        and not dropout
        and not any(kwargs.get(k) is not None for k in ("s_aux", "position_bias", "softcap"))
    )


def _few_queries(
    query: torch.Tensor, mask: torch.Tensor | None, dropout: float, kwargs: dict[str, Any]
) -> bool:
    # A decoding step: one query per row, or a few (drafts) under the step's mask. Without
    # a mask, several queries are a causal continuation (``split_attention``'s). Attention
    # sinks (``s_aux``) and dropout stay with transformers'.
    return (
        (query.shape[2] == 1 or (mask is not None and query.shape[2] <= FEW_QUERIES))
        and query.device.type == "cpu"
        and not dropout
        and not kwargs.get("s_aux")
    )


def few_query_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
    compute: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention of a few queries per row (``[batch, heads, q, dim]``) over ``key``/``value``
    (``[batch, kv_heads, keys, dim]``) under ``mask`` (``[batch, 1, q, >=keys]``, boolean:
    True attends; or additive), the products in ``compute`` and the softmax in float32;
    returns ``[batch, q, heads, dim]`` in the query's dtype. The query heads of a group and
    their queries are one matrix against their key-value head, so each layer's keys and
    values are read once."""
    batch, heads, q, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    if mask is not None:
        mask = mask[:, :, -q:, :keys]  # [batch, 1, q, keys]
    if compute == torch.float32:  # our kernel, where it takes these tensors
        out = attention_kernel.compute(query, key, value, mask, scale)
        if out is not None:
            return out
    # query head h reads key-value head h // groups (``repeat_kv``'s order)
    grouped = query.reshape(batch, kv_heads, groups * q, dim).to(compute)
    scores = torch.matmul(grouped, key.to(compute).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.view(batch, kv_heads, groups, q, keys)
        mask = mask[:, :, None]  # [batch, 1, 1, q, keys]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.to(compute)
        scores = scores.view(batch, kv_heads, groups * q, keys)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(compute)
    out = torch.matmul(weights, value.to(compute))
    return out.view(batch, heads, q, dim).transpose(1, 2).to(query.dtype)
