"""Passage reuse: the passage cache, the rotations that move its KV, and the repair that
mends it. One object, absent at fidelity "exact" and for models that cannot move keys."""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.kv import LayerKV, concat_kv
from kvboost_rag.core.model.rope import rerotate, rotations
from kvboost_rag.core.reuse.passages import PassageCache, PassageLookup
from kvboost_rag.core.reuse.plan import Plan
from kvboost_rag.core.reuse.repair import RepairPlan, RepairSettings, get_strategy, recompute


class PassageReuse:
    def __init__(
        self, model: Any, cache: PassageCache, support: ModelSupport, repair: RepairSettings
    ) -> None:
        self.model = model
        self.cache = cache
        self.support = support
        self.settings = repair

    def assemble(self, plan: Plan, prefix: list[LayerKV], found: PassageLookup) -> LayerKV:
        """KV for positions [0, plan.length): the exact prefix, each passage re-rotated from
        its stored position to its place, zeros where tokens are computed fresh."""
        kvs = found.kv
        template = kvs[0][0][0]
        shape = (1, template.shape[1], plan.length, template.shape[3])
        out = [(template.new_zeros(shape), template.new_zeros(shape)) for _ in kvs[0]]
        if plan.exact:
            for (k, v), (pk, pv) in zip(out, concat_kv(prefix)):
                k[:, :, : plan.exact], v[:, :, : plan.exact] = (
                    pk[:, :, : plan.exact],
                    pv[:, :, : plan.exact],
                )
        for passage, kv, source in zip(plan.passages, kvs, found.sources):
            skip = passage.start - passage.offset  # the head the exact prefix already covers
            shift = passage.offset - len(source.tokens)
            rots = (
                rotations(shift, self.support.rotaries, template)
                if shift
                else [None] * len(kv)  # right after its own prefix: stored as it is needed
            )
            span = slice(skip, skip + passage.end - passage.start)
            for (k, v), (pk, pv), rot in zip(out, kv, rots):
                k[:, :, passage.start : passage.end] = rerotate(pk[:, :, span], rot)
                v[:, :, passage.start : passage.end] = pv[:, :, span]
        return out

    def repair(self, plan: Plan, assembled: LayerKV) -> tuple[DynamicCache, torch.Tensor, int]:
        """One forward over the tokens the strategy picks, the fresh ones and the last
        prompt token: the cache for every prompt position, the next-token logits, and how
        many reused tokens were kept as they were."""
        spans = [(p.start, p.end) for p in plan.passages]
        repair_plan = RepairPlan(plan.tokens, plan.length, plan.exact, spans, assembled)
        strategy = get_strategy(self.settings.strategy)
        chosen = set(strategy(repair_plan, self.settings, self.model))
        cached = {i for start, end in spans for i in range(start, end)}
        fresh = set(range(plan.exact, plan.length)) - cached
        cache, logits = recompute(self.model, repair_plan, sorted(chosen | fresh))
        return cache, logits, len(cached - chosen)
