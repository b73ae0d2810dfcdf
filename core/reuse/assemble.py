"""Passage reuse: the passage cache, the rotations that move its KV, and the repair that
mends it. One object, absent at fidelity "exact" and for models that cannot move keys."""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Protocol

from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.model.rope import rerotate, rotations
from kvboost_rag.core.reuse.passages import PassageCache, PassageLookup
from kvboost_rag.core.reuse.plan import Plan, PlannedPassage
from kvboost_rag.core.reuse.repair import RepairPlan, RepairSettings, get_strategy


def _as_encoded(passage: PlannedPassage, plan: Plan) -> bool:
    """Whether ``passage`` sits where its stored variant was encoded: right after that
    variant's prefix, which is this prompt's own prefix."""
    source = passage.source
    return (
        source is not None
        and passage.intact
        and plan.prefix is not None
        and source.key == plan.prefix.key
        and passage.offset == len(source.tokens)
    )


class RowKV(Protocol):
    """The KV row a request's context is built in (positions are prompt positions)."""

    def write(self, start: int, kv: LayerKV) -> None:
        """Copy ``kv`` (per layer ``[1, heads, n, dim]``) to positions [start, start + n)."""

    def zero(self, start: int, end: int) -> None:
        """Zero positions [start, end) (fresh positions, until computed)."""

    def views(self, start: int, end: int) -> LayerKV:
        """Positions [start, end) as views."""

    def copy(self, start: int, end: int) -> LayerKV:
        """Positions [start, end) as a copy that outlives the row."""

    @property
    def length(self) -> int:
        """Positions of the row holding KV."""


class PassageReuse:
    def __init__(
        self,
        model: Any,
        cache: PassageCache,
        support: ModelSupport,
        repair: RepairSettings,
        sentence_ends: Container[int] = frozenset(),
    ) -> None:
        self.model = model
        self.cache = cache
        self.support = support
        self.settings = repair
        self.sentence_ends = sentence_ends  # what ends a sentence, for the "shared" repair

    def assemble(self, plan: Plan, found: PassageLookup, row: RowKV) -> None:
        """Fill positions [plan.exact, plan.length) of ``row``: each passage re-rotated
        from its stored position to its place, zeros where tokens are computed fresh."""
        row.zero(plan.exact, plan.length)
        template = found.kv[0][0][0]
        for passage, kv, source in zip(plan.passages, found.kv, found.sources):
            skip = passage.start - passage.offset  # the head the exact prefix already covers
            shift = passage.offset - len(source.tokens)
            rots = (
                rotations(shift, self.support.rotaries, template)
                if shift
                else [None] * len(kv)  # right after its own prefix: stored as it is needed
            )
            span = slice(skip, skip + passage.end - passage.start)
            moved = [(rerotate(k[:, :, span], rot), v[:, :, span]) for (k, v), rot in zip(kv, rots)]
            row.write(passage.start, moved)

    def repair(self, plan: Plan, row: RowKV) -> tuple[list[int], int]:
        """The positions to compute before the first token (ascending): what the strategy
        picks, the fresh ones and the last prompt token; and how many reused tokens are
        kept as they are."""
        spans = [(p.start, p.end) for p in plan.passages]
        # A passage read right after the very prefix it was encoded after is what a full
        # prefill computes there: nothing to repair (the strategy's budget goes elsewhere).
        repairable = [(p.start, p.end) for p in plan.passages if not _as_encoded(p, plan)]
        repair_plan = RepairPlan(
            plan.tokens,
            plan.length,
            plan.exact,
            repairable,
            row.views(0, plan.length),
            tail=max(end for _, end in spans),
            reused_tokens=sum(end - start for start, end in spans),
            passages=spans,
            sentence_ends=self.sentence_ends,
        )
        strategy = get_strategy(self.settings.strategy)
        chosen = set(strategy(repair_plan, self.settings, self.model))
        cached = {i for start, end in spans for i in range(start, end)}
        fresh = set(range(plan.exact, plan.length)) - cached
        return [*sorted(chosen | fresh), plan.length], len(cached - chosen)
