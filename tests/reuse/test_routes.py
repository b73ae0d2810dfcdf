"""Which route a prompt of passages takes (the reuse policy, ``core/reuse/policy.py``):
mostly cold, or made of short passages, it is prefilled plainly (exact) instead of reused;
every answer says which route and why."""

import pytest
import torch
from test_passage_reuse import DOCS, QUESTION, engine_with

from kvboost_rag.core.prompt.chunker import passage


def test_mostly_cold_prompt_is_prefilled_plainly_and_warms_its_passages(tokenizer) -> None:
    # fast: this tokenizer's 4-character runs recur in every passage, so the shared repair
    # of balanced recomputes them all
    engine = engine_with("llama", tokenizer, fidelity="fast")
    prompt = "".join(passage(d) for d in DOCS) + QUESTION
    cold = engine.generate(prompt, max_new_tokens=4)
    assert (cold.passages_hit, cold.passages_missed, cold.reused_tokens) == (0, 3, 0)
    assert cold.timings.repair_ms == 0 and cold.timings.store_ms > 0
    assert cold.reuse_reason.startswith("prefill: ") and "not cached" in cold.reuse_reason
    ids = torch.tensor([engine.tokenize(prompt)])
    expected = engine.model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert cold.token_ids == expected.tolist()  # exact: a plain prefill
    reordered = "".join(passage(d) for d in DOCS[::-1]) + QUESTION
    warm = engine.generate(reordered, max_new_tokens=4)
    assert (warm.passages_hit, warm.passages_missed) == (3, 0) and warm.reused_tokens > 0
    assert warm.reuse_reason == "reuse: 3 of 3 passages cached: reused and repaired"
    again = engine.generate(prompt, max_new_tokens=4)  # the cold prompt was exact: a prefix now
    assert again.passages_hit == 0 and again.reused_tokens == len(ids[0]) - 1


@pytest.mark.short_passages
@pytest.mark.parametrize("fidelity", ["balanced", "fast"])
def test_a_prompt_of_short_passages_is_prefilled_plainly(tokenizer, fidelity: str) -> None:
    from kvboost_rag.core.reuse.policy import SHORT_PASSAGE

    engine = engine_with("llama", tokenizer, fidelity=fidelity)
    assert all(len(engine.tokenize(d)) < SHORT_PASSAGE for d in DOCS)
    engine.warm_passages(DOCS)  # cached, but too short to reuse
    prompt = "".join(passage(d) for d in DOCS[::-1]) + QUESTION
    result = engine.generate(prompt, max_new_tokens=4)
    assert (result.reused_tokens, result.timings.repair_ms) == (0, 0)  # found, not reused
    assert f"under {SHORT_PASSAGE}" in result.reuse_reason
    ids = torch.tensor([engine.tokenize(prompt)])
    expected = engine.model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :]
    assert result.token_ids == expected.tolist()  # exact: a plain prefill
    # and long ones are reused as before
    long = [f"{d} {d}" for d in DOCS]
    assert all(len(engine.tokenize(d)) >= SHORT_PASSAGE for d in long)
    engine.warm_passages(long)
    reused = engine.generate("".join(passage(d) for d in long[::-1]) + QUESTION, max_new_tokens=2)
    found = reused.passages_hit + reused.passages_unused  # unused: recomputed whole
    assert found == 3 and reused.reuse_reason.startswith("reuse: 3 of 3")
