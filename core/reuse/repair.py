"""Selective recompute: repair reused KV by one forward pass over a few chosen tokens.

The chosen tokens are computed in the request's KV row in place (``generation/runner.py``):
each writes its fresh KV at its own position and attends to the row causally by position,
so the token at position p sees the cached KV of every non-chosen position < p and the
fresh KV of chosen positions <= p. With every token chosen this is a full prefill.

Strategies choose which reused tokens to recompute; tokens that were never cached (fixed
text, the question) are always computed.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost_rag.core.choices import REPAIR_STRATEGIES, RepairSettings
from kvboost_rag.core.model.arch import model_support
from kvboost_rag.core.model.attention import KEYWORD, Forward, steered
from kvboost_rag.core.model.hf_compat import eager_attention
from kvboost_rag.core.model.kv import LayerKV, head, new_kv_of_layer, to_cache
from kvboost_rag.core.reuse.shared import shared_sentences


@dataclass(frozen=True)
class RepairPlan:
    """Inputs a strategy may look at."""

    tokens: list[int]  # the whole prompt
    length: int  # positions [0, length) get KV; the rest is fed to generate
    exact: int  # positions [0, exact) hold exact KV and are never recomputed
    spans: list[tuple[int, int]]  # reused passage spans that may need repair, [start, end)
    assembled: LayerKV  # KV for [0, length), placeholders at fresh positions
    # Where the question starts (the end of the last reused passage).
    tail: int = 0
    # Reused passage tokens in all, the ones already exact included: what a ratio is of.
    reused_tokens: int = 0
    # Every reused passage's span, those already exact included (where shared text is
    # looked for); empty: ``spans``.
    passages: list[tuple[int, int]] = field(default_factory=list)
    # The tokens that end a sentence (``shared.SentenceEnds``).
    sentence_ends: Container[int] = frozenset()

    def __post_init__(self) -> None:
        if not self.passages:
            object.__setattr__(self, "passages", list(self.spans))
        if not self.tail:
            object.__setattr__(self, "tail", max((end for _, end in self.spans), default=0))
        if not self.reused_tokens:
            object.__setattr__(self, "reused_tokens", sum(e - s for s, e in self.spans))


Strategy = Callable[[RepairPlan, RepairSettings, Any], list[int]]

# Layers the question probe runs by default (balanced's depth while it repaired with
# "query"): on SmolLM2 at 30%, the first 8 kept 81% / 106% of full prefill's fact / essay
# answers at 1.76x / 1.57x its TTFT, all 30 layers 90% / 106% at 1.46x / 1.30x
# (docs/bench/front-probe-bfloat16.txt).
QUERY_LAYERS = 8


def choose_none(plan: RepairPlan, settings: RepairSettings, model: Any) -> list[int]:
    return []


def choose_edges(plan: RepairPlan, settings: RepairSettings, model: Any) -> list[int]:
    """The first tokens of each passage: encoded at the start of their own sequence they
    act as attention sinks, which they are not once placed mid-prompt (EPIC)."""
    return [
        p for start, end in plan.spans for p in range(start, min(end, start + settings.edge_tokens))
    ]


def choose_shared(plan: RepairPlan, settings: RepairSettings, model: Any) -> list[int]:
    """Recompute where the passages read each other: every sentence of a reused passage
    holding text another passage of the prompt shares (``shared.py``), and each passage's
    first ``edge_tokens``. Where that is more than ``recompute_ratio`` of the reused tokens,
    every reused token (the passages are too alike to be reused apart: a full prefill's
    KV). No model runs to choose."""
    repairable = {p for start, end in plan.spans for p in range(start, end)}
    chosen = set(choose_edges(plan, settings, model))
    for start, end in shared_sentences(plan.tokens, plan.passages, plan.sentence_ends):
        chosen.update(p for p in range(start, end) if p in repairable)
    if len(chosen) > settings.recompute_ratio * plan.reused_tokens:
        return sorted(repairable)
    return sorted(chosen)


def choose_deviation(plan: RepairPlan, settings: RepairSettings, model: Any) -> list[int]:
    """Recompute the reused tokens whose values at layer ``probe_layers - 1`` deviate most
    from the cached ones (CacheBlend). The fresh values take the layers before it over
    every token with full attention, and that layer's value projection.

    Values only: a key's norm outweighs its value's, so a sum of both ranks tokens by how
    their keys moved. With the answer's passage first (24 fact questions,
    docs/bench/fidelity.md) values kept 10 and 15 answers at 15% and 25% recomputed where
    keys and values kept 5 and 12, at the same cost."""
    reused = [p for start, end in plan.spans for p in range(start, end)]
    count = min(len(reused), int(round(settings.recompute_ratio * plan.reused_tokens)))
    if not count:
        return []
    layers = min(settings.probe_layers or 2, len(model_support(model).layers))
    fresh = probe_kv(model, plan, layers)[1]
    index = torch.tensor(reused, device=fresh.device)
    cached = plan.assembled[layers - 1][1].index_select(-2, index).float()
    deviation = (cached - fresh.index_select(-2, index - plan.exact).float()).norm(dim=-1)
    top = deviation.sum(dim=(0, 1)).topk(count).indices
    return [reused[i] for i in top.tolist()]


def choose_query(plan: RepairPlan, settings: RepairSettings, model: Any) -> list[int]:
    """Recompute the reused tokens the question attends to most (ProphetKV): those are the
    ones the answer is read from. The question is run over the first ``probe_layers``."""
    reused = [p for start, end in plan.spans for p in range(start, end)]
    count = min(len(reused), int(round(settings.recompute_ratio * plan.reused_tokens)))
    if not count:
        return []
    depth = len(model_support(model).layers)
    score = question_attention(model, plan, min(settings.probe_layers or QUERY_LAYERS, depth))
    reused_scores = score[torch.tensor(reused, device=score.device)]
    values, top = reused_scores.topk(count)
    if settings.recompute_mass is not None:
        total = float(reused_scores.sum())
        reached = (values.cumsum(0) < settings.recompute_mass * total).sum()
        top = top[: int(reached) + 1]
    return [reused[i] for i in top.tolist()]


def choose_passages(plan: RepairPlan, settings: RepairSettings, model: Any) -> list[int]:
    """Whole passages, those whose tokens the question attends to most on average, up to
    ``recompute_ratio`` of the reused tokens (at least one passage): the passage holding
    the answer then sees its neighbours as in a full prefill."""
    budget = settings.recompute_ratio * plan.reused_tokens
    if not budget or not plan.spans:
        return []
    depth = len(model_support(model).layers)
    score = question_attention(model, plan, min(settings.probe_layers or depth, depth))
    ranked = sorted(plan.spans, key=lambda span: -float(score[span[0] : span[1]].mean()))
    chosen: list[int] = []
    for start, end in ranked:
        if chosen and len(chosen) + end - start > budget:
            break
        chosen.extend(range(start, end))
    return chosen


STRATEGIES: dict[str, Strategy] = {
    "none": choose_none,
    "edges": choose_edges,
    "deviation": choose_deviation,
    "shared": choose_shared,
    "query": choose_query,
    "passage": choose_passages,
}
assert tuple(STRATEGIES) == REPAIR_STRATEGIES  # the names config checks ``repair`` against


def get_strategy(name: str) -> Strategy:
    try:
        return STRATEGIES[name]
    except KeyError:
        raise KeyError(
            f"unknown repair strategy {name!r}; choose one of {sorted(STRATEGIES)}"
        ) from None


class _ProbeDone(Exception):
    pass


@contextmanager
def _first_layers(model: Any, layers: int) -> Iterator[None]:
    """Run only the first ``layers`` decoder layers of the next forward pass."""
    blocks = model_support(model).layers
    if layers >= len(blocks):
        yield
        return

    def stop(*_: object) -> None:
        raise _ProbeDone

    handle = blocks[layers - 1].register_forward_hook(stop)
    try:
        yield
    except _ProbeDone:
        pass
    finally:
        handle.remove()


def probe_kv(model: Any, plan: RepairPlan, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh (keys, values) of layer ``layers - 1`` for positions [exact, length), computed
    with full attention over the exact prefix. Only the layers before it run; the forward
    stops where that layer writes its keys and values, before its attention."""
    cache = to_cache(head(plan.assembled, plan.exact), model.config)
    ids = torch.tensor([plan.tokens[plan.exact : plan.length]], device=model.device)
    # contiguous after the exact prefix: attention splits there instead of taking a mask
    forward = {KEYWORD: Forward(plan.exact, model_support(model).windows)} if steered(model) else {}
    with new_kv_of_layer(cache, layers - 1) as caught:
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1, **forward)
    assert caught, f"the forward never wrote layer {layers - 1}'s keys"
    return caught[0]


def question_attention(model: Any, plan: RepairPlan, layers: int) -> torch.Tensor:
    """Attention the question's tokens (everything after the last passage) pay to each
    earlier position over the unrepaired cache, summed over the first ``layers`` layers,
    heads and question tokens. On the engine's attention the scores are taken beside the
    forward's own SDPA (a few query rows); other models run eagerly for their weights."""
    tail = plan.tail
    cache = to_cache(head(plan.assembled, tail), model.config)
    ids = torch.tensor([plan.tokens[tail : plan.length + 1]], device=model.device)
    positions = torch.arange(tail, plan.length + 1, device=model.device)[None]
    score = torch.zeros(tail, device=model.device)
    support = model_support(model)

    def forward(**steer: Forward) -> None:
        model(input_ids=ids, position_ids=positions, cache=cache, logits_to_keep=1, **steer)

    if steered(model):
        with _first_layers(model, layers):
            forward(**{KEYWORD: Forward(tail, support.windows, probe=(score, tail))})
        return score

    def collect(module: Any, args: Any, output: Any) -> None:
        score.add_(output[1][0, :, :, :tail].float().sum(dim=(0, 1)))

    hooks = [attn.register_forward_hook(collect) for attn in support.attention[:layers]]
    try:
        with eager_attention(model), _first_layers(model, layers):
            forward()
    finally:
        for hook in hooks:
            hook.remove()
    return score
