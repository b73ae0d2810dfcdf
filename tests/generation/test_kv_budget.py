"""The executor's KV budget: requests that would take the rows' KV past it wait for rows to
end, so many long prompts at once run in turns instead of running the process out of
memory, and answer as they do one at a time."""

from __future__ import annotations

import random

import pytest
from conftest import make_model, make_tokenizer
from test_batching import together

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.generation.slots import SlotCache, position_bytes

ANSWER = 6  # tokens per answer


def long_prompts(n: int, tokens: int) -> list[str]:
    """``n`` distinct prompts of about ``tokens`` tokens each (the tests' tokenizer spells
    words letter by letter), no text shared."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [
        " ".join("".join(rng.choices(letters, k=5)) for _ in range(tokens // 6)) + f" {i}?"
        for i in range(n)
    ]


def long_engine(**config: object) -> KVBoost:
    model = make_model("llama")
    model.config.max_position_embeddings = 8192
    return KVBoost(model, make_tokenizer(), KVBoostConfig(draft_tokens=0, **config))


def test_16_long_prompts_under_a_budget_for_4_answer_as_alone_within_it() -> None:
    prompts = long_prompts(16, 4000)
    serial = long_engine(max_batch_size=1)
    alone = [serial.generate(p, max_new_tokens=ANSWER).token_ids for p in prompts]
    lengths = [len(serial.tokenizer(p).input_ids) for p in prompts]
    assert min(lengths) > 3500
    probe = SlotCache(3, position_bytes(serial.model))  # what a row of the longest needs
    budget = probe.bytes_for(4, max(lengths) + ANSWER + 1) + probe.bytes_for(1, 100)
    engine = long_engine(max_batch_size=16, kv_budget_bytes=budget)
    calls = [lambda p=p: engine.generate(p, max_new_tokens=ANSWER).token_ids for p in prompts]
    assert together(calls, timeout=600) == alone
    stats = engine.stats().batch
    assert stats is not None and 0 < stats.kv_peak_bytes <= budget
    assert 2 <= stats.peak <= 4  # the budget, not max_batch_size, bounded the batch


def test_a_request_alone_runs_whatever_the_budget() -> None:
    engine = long_engine(kv_budget_bytes=1)
    prompt = long_prompts(1, 600)[0]
    assert len(engine.generate(prompt, max_new_tokens=ANSWER).token_ids) == ANSWER


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1GB"])
def test_a_bad_budget_is_refused_with_what_to_pass(bad: object) -> None:
    with pytest.raises(ValueError, match="kv_budget_bytes must be an int"):
        KVBoostConfig(kv_budget_bytes=bad)  # type: ignore[arg-type]
