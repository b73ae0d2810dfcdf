"""What the passage-reuse tests share: three short documents and a question over them, an
engine on a tiny model, a KV row over plain tensors and a prompt assembled unrepaired."""

import torch
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig

DOCS = [
    "Paris is the capital of France and sits on the Seine.",
    "The Nile flows north through Egypt into the Mediterranean.",
    "Mount Fuji is the highest mountain in Japan.",
]
QUESTION = "Question: which river flows north? Answer:"


class TensorRow:
    """A KV row over plain tensors (what the executor's rows are to a context build)."""

    def __init__(self, like: list, length: int) -> None:
        k = like[0][0][0]
        shape = (1, k.shape[1], length, k.shape[-1])
        self.kv = [(k.new_zeros(shape), k.new_zeros(shape)) for _ in like[0]]
        self.length = 0

    def write(self, start: int, kv: list) -> None:
        n = kv[0][0].shape[-2]
        for (k, v), (nk, nv) in zip(self.kv, kv):
            k[:, :, start : start + n], v[:, :, start : start + n] = nk, nv
        self.length = max(self.length, start + n)

    def zero(self, start: int, end: int) -> None:
        for k, v in self.kv:
            k[:, :, start:end] = v[:, :, start:end] = 0

    def views(self, start: int, end: int) -> list:
        return [(k[:, :, start:end], v[:, :, start:end]) for k, v in self.kv]


def engine_with(arch: str, tokenizer, **config) -> KVBoost:
    return KVBoost(make_model(arch), tokenizer, KVBoostConfig(block_tokens=8, **config))


def full_logits(engine: KVBoost, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(torch.tensor([tokens])).logits[0, -1]


def assembled(engine: KVBoost):
    """QUESTION over DOCS, every passage cached after the prompt's prefix and assembled
    unrepaired: the prompt and the ``RepairPlan`` a strategy sees."""
    from kvboost_rag.core.reuse.policy import ReusePolicy
    from kvboost_rag.core.reuse.repair import RepairPlan

    prompt = engine.inspect.prompt(QUESTION, DOCS)
    n = len(prompt.tokens) - 1
    cache = engine.inspect.passage_cache
    prefix = cache.prefix(prompt.tokens[: prompt.passages[0].offset])
    found = cache.fetch(prefix, [p.tokens for p in prompt.passages])
    row = TensorRow(found.kv, n)
    policy = ReusePolicy(engine._caches.reuse.policy.repair)
    placed = policy.plan(prompt.tokens, prompt.passages, 0, prefix, [prefix] * len(DOCS))
    engine._caches.reuse.assemble(placed, found, row)
    spans = [(p.start, p.end) for p in prompt.passages]
    plan = RepairPlan(prompt.tokens, n, 0, spans, row.views(0, n))
    return prompt, plan
