"""The reuse policy: the one place that decides what a request reuses, what it recomputes
and what is encoded for later, and says why.

From a lookup (what the exact prefix cache, the session cache and the passage cache hold for
a prompt, found before the model is taken), ``plan`` picks the route and writes its reason;
``recompute`` picks the positions the first forward computes over reused KV (the repair
strategy's choice, the fresh tokens, none of a passage read where it was encoded);
``deferred`` says which passages to encode after the answer. Where a passage's stored
variant may come from (its own prefix, else the nearest known one) is ``nearest``; how
much each fidelity level repairs is the ``RepairSettings`` the configuration gives.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.core.model.kv import LayerKV
from kvboost_rag.core.prompt.placing import Placed
from kvboost_rag.core.reuse.passages import Prefix
from kvboost_rag.core.reuse.plan import Plan, PlannedPassage, Route, planned_passages
from kvboost_rag.core.reuse.repair import RepairPlan, RepairSettings, get_strategy

# A prefill over a cached prefix can cost more per token than a plain one: its queries
# attend to the cached keys as well, and its forward is smaller. Measured on SmolLM2-135M
# (bf16, 2 cores, attention split by core/model/attention.py): 100 cached + 800 new tokens
# took 1.19x a plain 900-token prefill's time per token (fp32: 1.04x), 200 + 700 1.09x
# (1.11x). A cached prefix shorter than ~1/6 of the prompt is therefore ignored on such a
# model and the prompt prefilled plainly, which is exact all the same.
MASKED_PREFILL_COST = 1.2
# In a wider decoder the linear layers outweigh attending over the cached keys, and a
# cached prefix of any length pays: 100 / 200 / 415 cached of an 830-token prompt took
# 0.92 / 0.89 / 0.89x the plain prefill's time per token on Qwen2.5-Coder-1.5B and 0.88 /
# 0.85 / 0.67x on 0.5B (hidden size 896), against 1.30 / 1.23 / 1.34x on SmolLM2-135M
# (576) in the same runs (bf16, 2-core Xeon, ``scripts/step_constants.py --parts prefix``,
# records docs/bench/constants-*). From this hidden size on, no cached prefix is ignored.
WIDE_DECODER = 896


def prefix_cost(model: Any) -> float:
    """A token fed over a cached prefix, over one in a plain prefill, on ``model``."""
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    return 1.0 if isinstance(hidden, int) and hidden >= WIDE_DECODER else MASKED_PREFILL_COST


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


@dataclass(frozen=True)
class ReusePolicy:
    repair: RepairSettings | None  # None: no passage reuse (fidelity "exact")
    nearest: bool = True  # a passage may reuse the variant of another prefix
    # a token fed over a cached prefix, over one in a plain prefill (``prefix_cost``)
    prefix_cost: float = MASKED_PREFILL_COST

    def plan(
        self,
        tokens: list[int],
        placed: Sequence[Placed],
        matched: int,
        prefix: Prefix | None,
        sources: Sequence[Prefix | None] | None,
        approx_from: int | None = None,
    ) -> Plan:
        """``tokens``: the prompt; ``placed``: its passages, in order. ``matched``: prompt
        tokens the prefix caches hold from position 0, exact up to ``approx_from`` (None:
        all exact). ``prefix``: what this prompt's passages are encoded after; ``sources``:
        per passage, the prefix whose stored variant serves it, or None (``sources`` None:
        no passage reuse)."""
        length = len(tokens) - 1
        exact = min(matched, length)
        approx = approx_from if approx_from is not None and approx_from < exact else None
        passages = () if sources is None else planned_passages(placed, exact, length, sources)
        missing = sum(len(p.tokens) for p in passages if not p.cached)
        total = sum(len(p.tokens) for p in passages)
        short = total < SHORT_PASSAGE * len(passages)
        if passages and missing <= COLD_SHARE * total and not short:
            hits = sum(p.cached for p in passages)
            why = f"{hits} of {len(passages)} passages cached: reused and repaired"
            return Plan(tokens, length, exact, passages, "reuse", prefix, approx, why=why)
        if not passages:
            why = "no passage after the exact prefix"
        elif short:
            why = f"passages average {total // len(passages)} tokens, under {SHORT_PASSAGE}"
        else:
            why = f"{missing} of {total} passage tokens not cached: encoded after the answer"
        if (length - exact) * self.prefix_cost >= length:
            if exact:
                why += f"; a cached prefix of {exact} tokens is too short to continue"
            exact, approx = 0, None
        route: Route = "prefix" if exact else "prefill"
        return Plan(tokens, length, exact, passages, route, prefix, approx, short, why)

    def deferred(self, plan: Plan, recurring: bool) -> list[tuple[int, ...]]:
        """Passages to encode after the answer: those a plainly prefilled prompt has no
        variant of under its own prefix, the paragraphs of a prompt without markers that
        are new to the cache (``plan.new``) and, for a layout that recurs
        (``recurring``), its own variants of those it borrowed from another prefix."""
        later = list(plan.new)
        if plan.route != "reuse" and not plan.short:
            later += [p.tokens for p in plan.passages if p.source != plan.prefix]
        borrowed = plan.foreign_passages if recurring else []
        return list(dict.fromkeys(later + borrowed))

    def recompute(
        self, plan: Plan, assembled: LayerKV, sentence_ends: Container[int], model: Any
    ) -> tuple[list[int], int]:
        """The positions to compute before the first token (ascending): what the repair
        strategy picks, the fresh ones and the last prompt token; and how many reused
        tokens are kept as they are."""
        assert self.repair is not None, "a reuse plan needs a repair setting"
        spans = [(p.start, p.end) for p in plan.passages]
        # A passage read right after the very prefix it was encoded after is what a full
        # prefill computes there: nothing to repair (the strategy's budget goes elsewhere).
        repairable = [(p.start, p.end) for p in plan.passages if not _as_encoded(p, plan)]
        repair_plan = RepairPlan(
            plan.tokens,
            plan.length,
            plan.exact,
            repairable,
            assembled,
            tail=max(end for _, end in spans),
            reused_tokens=sum(end - start for start, end in spans),
            passages=spans,
            sentence_ends=sentence_ends,
        )
        chosen = set(get_strategy(self.repair.strategy)(repair_plan, self.repair, model))
        cached = {i for start, end in spans for i in range(start, end)}
        fresh = set(range(plan.exact, plan.length)) - cached
        return [*sorted(chosen | fresh), plan.length], len(cached - chosen)


def _as_encoded(passage: PlannedPassage, plan: Plan) -> bool:
    """Whether ``passage`` sits where its stored variant was encoded: right after that
    variant's prefix, which is this prompt's own prefix, its first tokens unmerged."""
    source = passage.source
    return (
        source is not None
        and passage.intact
        and plan.prefix is not None
        and source.key == plan.prefix.key
        and passage.offset == len(source.tokens)
    )
