"""What one request will reuse, decided before any tensor moves.

``make_plan`` is pure: from the prompt's tokens and passage spans, how much of it the exact
prefix cache holds and which passages the passage cache holds (what the lookup found,
before the model is taken), it decides the route —
prefill everything, continue a cached exact prefix, or assemble cached passages and
repair them — and where exact KV ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvboost_rag.core.prompt.placing import Placed
from kvboost_rag.core.reuse.passages import Prefix

# A prefill over a cached prefix costs more per token than a plain one: its queries attend
# to the cached keys as well, and its forward is smaller. Measured on SmolLM2-135M (bf16,
# 2 cores, attention split by core/model/attention.py): 100 cached + 800 new tokens took
# 1.19x a plain 900-token prefill's time per token (fp32: 1.04x), 200 + 700 1.09x (1.11x).
# A cached prefix shorter than ~1/6 of the prompt is therefore ignored and the prompt
# prefilled plainly, which is exact all the same.
MASKED_PREFILL_COST = 1.2

# When more than this share of a prompt's passage tokens is not cached, encoding them alone
# and repairing costs more than a plain prefill (measured 1.42x on a cold 8-passage prompt
# with balanced repair), so the prompt is prefilled plainly and its passages are encoded
# after the answer, for the next prompt that holds them.
COLD_SHARE = 0.5

# Passages this short are read wrongly when reused, whatever is repaired: on
# Qwen2.5-Coder-0.5B with 3-4 one-sentence passages (~20 tokens each), reuse kept 5-6 of 8
# of full prefill's right answers with no repair, the deviation repair, the shared repair and
# even the 15% of tokens whose KV truly moved most; at ~200 tokens a passage the shared
# repair kept every one. Their reuse saves little (such a prompt is a few hundred tokens),
# so a prompt whose passages average fewer tokens than this is prefilled plainly, exact,
# and they are not encoded for later. A bracket (20 bad, 200 good), not a tuned point.
SHORT_PASSAGE = 64

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
    def deferred(self) -> list[tuple[int, ...]]:
        """Passages to encode after the answer: those a plainly prefilled prompt has no
        variant of under its own prefix."""
        if self.route == "reuse" or self.short:
            return []
        return [p.tokens for p in self.passages if p.source != self.prefix]

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


def make_plan(
    tokens: list[int],
    placed: Sequence[Placed],
    matched: int,
    prefix: Prefix | None,
    sources: Sequence[Prefix | None] | None,
    approx_from: int | None = None,
) -> Plan:
    """``tokens``: the prompt; ``placed``: its passages, in order. ``matched``: prompt
    tokens the prefix caches hold from position 0, exact up to ``approx_from`` (None: all
    exact). ``prefix``: what this prompt's passages are encoded after; ``sources``: per
    passage, the prefix whose stored variant serves it, or None (``sources`` None: no
    passage reuse)."""
    length = len(tokens) - 1
    exact = min(matched, length)
    approx = approx_from if approx_from is not None and approx_from < exact else None
    passages = () if sources is None else _passages(placed, exact, length, sources)
    missing = sum(len(p.tokens) for p in passages if not p.cached)
    total = sum(len(p.tokens) for p in passages)
    short = total < SHORT_PASSAGE * len(passages)
    if passages and missing <= COLD_SHARE * total and not short:
        return Plan(tokens, length, exact, passages, "reuse", prefix, approx)
    if (length - exact) * MASKED_PREFILL_COST >= length:
        exact, approx = 0, None  # too little cached to pay for continuing it
    route: Route = "prefix" if exact else "prefill"
    return Plan(tokens, length, exact, passages, route, prefix, approx, short)


def after_exact(placed: Sequence[Placed], length: int, matched: int) -> list[int]:
    """Indices of the passages (of a prompt of ``length`` tokens) that lie (partly) after
    its first ``matched`` tokens: the ones whose stored variants the lookup reads."""
    end, last = min(matched, length - 1), length - 1
    return [i for i, p in enumerate(placed) if min(p.end, last) > end]


def _passages(
    placed: Sequence[Placed], exact: int, length: int, sources: Sequence[Prefix | None]
) -> tuple[PlannedPassage, ...]:
    out = []
    for i, (p, source) in enumerate(zip(placed, sources)):
        if min(p.end, length) > exact:
            span = max(p.start, exact), min(p.end, length)
            out.append(PlannedPassage(*span, p.offset, p.tokens, source, i, p.first == 0))
    return tuple(out)
