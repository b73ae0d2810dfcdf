"""Building the model's cache for one prompt: exact prefix, reused passages, repair."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import DynamicCache

from kvboost_rag.core.chunker import TokenizedPrompt
from kvboost_rag.core.kv import LayerKV, blocks_cache, concat_kv
from kvboost_rag.core.passages import PassageCache
from kvboost_rag.core.prefix import PrefixCache
from kvboost_rag.core.repair import RepairPlan, RepairSettings, get_strategy, recompute
from kvboost_rag.core.result import Timings, elapsed_ms
from kvboost_rag.core.rope import Rotary, rerotate, rotations

# A prefill over a cached prefix cannot use the causal fast path of scaled_dot_product_
# attention: transformers passes an explicit mask, measured 1.45x slower per token on CPU
# (SmolLM2, 25 cached + 1975 new tokens: 3.8 s vs 2.7 s). A short cached prefix is
# therefore ignored and the prompt prefilled plainly, which is exact all the same.
MASKED_PREFILL_COST = 1.45

# When more than this share of a prompt's passage tokens is not cached, encoding them alone
# and repairing costs more than a plain prefill (measured 1.42x on a cold 8-passage prompt
# with balanced repair), so the prompt is prefilled plainly and its passages are encoded
# after the answer, for the next prompt that holds them.
COLD_SHARE = 0.5


@dataclass(frozen=True)
class Context:
    cache: DynamicCache  # KV for the prompt: all of it when ``logits`` is set, else all
    # positions but the last (which generate then feeds)
    reused: int  # prompt tokens whose KV came from a cache and was kept
    exact_upto: int | None  # positions [0, exact_upto) hold exact KV; None: all of it
    passages_hit: int
    passages_missed: int
    logits: torch.Tensor | None = None  # next-token logits after the prompt, when computed
    # Passages to encode and store after the answer (a mostly cold prompt is prefilled
    # plainly instead: exact, and no slower than a full prefill).
    deferred: list[list[int]] = field(default_factory=list)


class ContextBuilder:
    """Owns the two caches' read path. ``passages`` is None in "exact" fidelity."""

    def __init__(
        self,
        model: Any,
        prefix: PrefixCache,
        passages: PassageCache | None,
        rotaries: tuple[Rotary | None, ...],
        repair: RepairSettings | None,
    ) -> None:
        self.model = model
        self.prefix = prefix
        self.passages = passages
        self.rotaries = rotaries  # per layer (kvboost_rag.core.arch)
        self.repair = repair

    def build(self, prompt: TokenizedPrompt, timings: Timings) -> Context:
        tokens, n = prompt.tokens, len(prompt.tokens) - 1  # generate feeds the last token
        t = time.perf_counter()
        match = self.prefix.match(tokens)
        exact = min(match.length, n)
        spans = [(max(s, exact), min(e, n)) for s, e in prompt.passages if min(e, n) > exact]
        if self.passages is None or not spans:
            timings.lookup_ms += elapsed_ms(t)
            return self._exact(match.blocks, exact, n)
        full = _full_spans(prompt, spans)
        passages = [tokens[s:e] for s, e in full]
        known = self.passages.cached(passages)
        missing = [p for p, kv in zip(passages, known) if kv is None]
        if sum(map(len, missing)) > COLD_SHARE * sum(map(len, passages)):
            timings.lookup_ms += elapsed_ms(t)
            context = self._exact(match.blocks, exact, n)
            return replace(
                context,
                passages_missed=len(missing),
                deferred=missing,
                passages_hit=len(passages) - len(missing),
            )
        found = self.passages.fetch(passages, known)
        timings.encode_ms += found.encode_ms
        timings.lookup_ms += elapsed_ms(t) - found.encode_ms
        t = time.perf_counter()
        assembled = self._assemble(match.blocks, exact, n, spans, full, found.kv)
        timings.assemble_ms += elapsed_ms(t)
        t = time.perf_counter()
        plan = RepairPlan(tokens, n, exact, spans, assembled)
        assert self.repair is not None
        chosen = set(get_strategy(self.repair.strategy)(plan, self.repair, self.model))
        cached = {p for s, e in spans for p in range(s, e)}
        fresh = set(range(exact, n)) - cached
        cache, logits = recompute(self.model, plan, sorted(chosen | fresh))
        timings.repair_ms += elapsed_ms(t)
        reused = exact + len(cached - chosen)
        return Context(cache, reused, spans[0][0], found.hits, found.misses, logits)

    def _exact(self, blocks: list[LayerKV], length: int, total: int) -> Context:
        if (total - length) * MASKED_PREFILL_COST >= total:
            # Too little cached to pay for the masked attention a cached prefix forces.
            blocks, length = [], 0
        return Context(blocks_cache(blocks, self.model.config, length), length, None, 0, 0)

    def _assemble(
        self,
        blocks: list[LayerKV],
        exact: int,
        n: int,
        spans: list[tuple[int, int]],
        full: list[tuple[int, int]],
        passage_kv: list[LayerKV],
    ) -> LayerKV:
        """KV for [0, n): exact prefix, re-rotated passages, zeros where tokens are fresh."""
        template = passage_kv[0][0][0]
        shape = (1, template.shape[1], n, template.shape[3])
        layers = len(passage_kv[0])
        out = [(template.new_zeros(shape), template.new_zeros(shape)) for _ in range(layers)]
        if blocks:
            for (k, v), (pk, pv) in zip(out, concat_kv(blocks)):
                k[:, :, :exact], v[:, :, :exact] = pk[:, :, :exact], pv[:, :, :exact]
        assert self.passages is not None
        for (start, end), (full_start, _), kv in zip(spans, full, passage_kv):
            skip = start - full_start  # part of the passage already inside the exact prefix
            rots = rotations(full_start - self.passages.offset, self.rotaries, template)
            for (k, v), (pk, pv), rot in zip(out, kv, rots):
                k[:, :, start:end] = rerotate(pk[:, :, skip : skip + end - start], rot)
                v[:, :, start:end] = pv[:, :, skip : skip + end - start]
        return out


def _full_spans(prompt: TokenizedPrompt, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole passage span each (possibly clipped) reused span belongs to."""
    return [next((s, e) for s, e in prompt.passages if s <= start < e) for start, _ in spans]
