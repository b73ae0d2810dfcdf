"""Passage reuse: the passage cache, the rotations that move its KV, and the repair that
mends it. One object, absent at fidelity "exact" and for models that cannot move keys."""

from __future__ import annotations

from collections.abc import Container
from typing import Any, Protocol

from kvboost_rag.core.model.arch import ModelSupport
from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.model.rope import rerotate, rotations
from kvboost_rag.core.reuse.passages import PassageCache, PassageLookup
from kvboost_rag.core.reuse.plan import Plan
from kvboost_rag.core.reuse.policy import ReusePolicy


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
        policy: ReusePolicy,
        sentence_ends: Container[int] = frozenset(),
    ) -> None:
        self.model = model
        self.cache = cache
        self.support = support
        self.policy = policy
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
        """The positions to compute before the first token and how many reused tokens are
        kept (the policy's choice over the assembled row)."""
        return self.policy.recompute(
            plan, row.views(0, plan.length), self.sentence_ends, self.model
        )
