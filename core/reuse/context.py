"""Building the model's cache for one planned prompt: exact prefix, reused passages, repair."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from kvboost_rag.core.generation.result import Timings
from kvboost_rag.core.model.kv import LayerKV, blocks_cache
from kvboost_rag.core.reuse.assemble import PassageReuse
from kvboost_rag.core.reuse.plan import Plan


@dataclass(frozen=True)
class Context:
    cache: DynamicCache  # KV for every prompt position when ``logits`` is set, else for
    # positions [0, plan.length) (generate feeds the last token)
    logits: torch.Tensor | None  # next-token logits after the prompt, when computed
    reused: int  # prompt tokens whose KV came from a cache and was kept
    # Passages whose KV was read from the passage cache; None on routes that read none. Can
    # be fewer than the plan's: a variant can vanish (or prove damaged) between the two.
    passages_hit: int | None = None


def build_context(
    model: Any,
    plan: Plan,
    prefix: list[LayerKV],
    reuse: PassageReuse | None,
    timings: Timings,
) -> Context:
    """``prefix``: the exact prefix cache's blocks covering at least ``plan.exact`` tokens.
    Passages are loaded (or encoded, when missing) only on the "reuse" route."""
    if plan.route != "reuse":  # a prefill ignores the prefix cache's blocks (exact == 0)
        blocks = prefix if plan.exact else []
        return Context(blocks_cache(blocks, model.config, plan.exact), None, plan.exact)
    assert reuse is not None, "a reuse plan needs passage reuse"
    assert plan.prefix is not None, "a reuse plan knows its passages' prefix"
    passages = [p.tokens for p in plan.passages]
    sources = [p.source for p in plan.passages]
    with timings.stage("lookup"):
        known = reuse.cache.cached(sources, passages)
    with timings.stage("encode" if None in known else "lookup"):
        found = reuse.cache.fetch(plan.prefix, passages, sources, known)
    with timings.stage("assemble"):
        assembled = reuse.assemble(plan, prefix, found)
    with timings.stage("repair"):
        cache, logits, kept = reuse.repair(plan, assembled)
    return Context(cache, logits, plan.exact + kept, found.hits)
