"""What one request will reuse: the plan a ``ReusePolicy`` (``policy.py``) makes from a
lookup, before any tensor moves.

A plan names its route (prefill everything, continue a cached exact prefix, or assemble
cached passages and repair them), where exact KV ends, the passages after the exact prefix
with the stored variant each reuses, and why the policy chose that route.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvboost_rag.core.prompt.placing import Placed
from kvboost_rag.core.reuse.passages import Prefix

Route = Literal["prefill", "prefix", "reuse"]


@dataclass(frozen=True)
class PlannedPassage:
    """A passage of the prompt that lies (at least partly) after the exact prefix."""

    start: int  # first position whose KV comes from the passage cache
    end: int  # end of those positions (the prompt's last token is never among them)
    offset: int  # where its first own token sits (or would: start > offset when the exact
    # prefix covers its head, or where its first tokens merged with the text before it)
    tokens: tuple[int, ...]  # the whole passage: its identity in the passage cache
    source: Prefix | None  # the prefix of the stored variant to reuse; None: not cached
    index: int  # which of the prompt's passages it is
    intact: bool = True  # the prompt holds its first tokens as they are (none merged)

    @property
    def cached(self) -> bool:
        return self.source is not None


@dataclass(frozen=True)
class Plan:
    tokens: list[int]  # the whole prompt
    length: int  # positions [0, length) get KV before decoding; the last token is fed then
    exact: int  # positions [0, exact) come from the exact prefix cache
    passages: tuple[PlannedPassage, ...]  # passages after the exact prefix, in order
    route: Route  # prefill: no cache; prefix: exact prefix + prefill; reuse: passages too
    prefix: Prefix | None = None  # what this prompt's passages are encoded after
    # Where KV from the session cache starts (an earlier request's repaired passages and
    # what followed them: approximate); None when the exact prefix is all exact.
    approx_from: int | None = None
    short: bool = False  # passages too short to reuse (SHORT_PASSAGE): never encoded alone
    why: str = ""  # the policy's reason for the route, in words
    new: tuple[tuple[int, ...], ...] = ()  # text to encode as passages after the answer

    @property
    def foreign(self) -> int:
        """Passages reused from a variant encoded after another prefix than this prompt's."""
        return len(self.foreign_passages)

    @property
    def hits(self) -> int:
        return sum(p.cached for p in self.passages)

    @property
    def misses(self) -> int:
        return len(self.passages) - self.hits

    @property
    def foreign_passages(self) -> list[tuple[int, ...]]:
        """Passages reused from another prefix's variant."""
        if self.route != "reuse":
            return []
        return [p.tokens for p in self.passages if p.source not in (None, self.prefix)]

    @property
    def exact_upto(self) -> int | None:
        """Positions [0, exact_upto) end up holding exact (full-attention) KV; None: all."""
        cuts = [self.passages[0].start] if self.route == "reuse" else []
        cuts += [] if self.approx_from is None else [self.approx_from]
        return min(cuts, default=None)


def after_exact(placed: Sequence[Placed], length: int, matched: int) -> list[int]:
    """Indices of the passages (of a prompt of ``length`` tokens) that lie (partly) after
    its first ``matched`` tokens: the ones whose stored variants the lookup reads."""
    end, last = min(matched, length - 1), length - 1
    return [i for i, p in enumerate(placed) if min(p.end, last) > end]


def planned_passages(
    placed: Sequence[Placed], exact: int, length: int, sources: Sequence[Prefix | None]
) -> tuple[PlannedPassage, ...]:
    out = []
    for i, (p, source) in enumerate(zip(placed, sources)):
        if min(p.end, length) > exact:
            span = max(p.start, exact), min(p.end, length)
            out.append(PlannedPassage(*span, p.offset, p.tokens, source, i, p.first == 0))
    return tuple(out)
