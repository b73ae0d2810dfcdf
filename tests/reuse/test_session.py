"""The session cache: the next step of an exchange continues from the KV the last one used
(reused passages included), and nothing else is served from it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.prompt.chunker import passage

DOCS = [
    "Paris is the capital of France and sits on the Seine.",
    "The Nile flows north through Egypt into the Mediterranean.",
    "Mount Fuji is the highest mountain in Japan.",
]
SYSTEM = "You answer questions about places. "
PROMPT = SYSTEM + "".join(passage(d) for d in DOCS) + "Question: which river flows north? Answer:"


def engines(fidelity: str) -> tuple[KVBoost, KVBoost]:
    """Two engines on one model, their passages warmed alike."""
    model = make_model("llama")
    pair = []
    for _ in range(2):
        from conftest import make_tokenizer

        engine = KVBoost(model, make_tokenizer(), KVBoostConfig(block_tokens=8, fidelity=fidelity))
        engine.warm_passages(PROMPT)
        pair.append(engine)
    return pair[0], pair[1]


@pytest.mark.parametrize("fidelity", ["fast", "balanced"])
def test_a_continuation_decodes_as_the_first_request_would_have_gone_on(fidelity: str) -> None:
    engine, other = engines(fidelity)
    first = engine.generate(PROMPT, max_new_tokens=6)
    assert first.passages_hit + first.passages_unused == len(DOCS)  # found
    logits = engine.first_token_logits(PROMPT + first.text)
    longer = other.generate(PROMPT, max_new_tokens=7)
    assert longer.token_ids[:6] == first.token_ids
    assert int(logits.argmax()) == longer.token_ids[6]
    # Served from the session: the passages were not looked up or repaired again.
    follow = engine.generate(PROMPT + first.text + " More:", max_new_tokens=1)
    assert follow.passages_hit == 0
    assert follow.reused_tokens >= len(engine.tokenize(PROMPT)) + 6 - 8


def test_a_new_question_over_the_same_passages_is_not_a_continuation() -> None:
    engine, _ = engines("balanced")
    engine.generate(PROMPT, max_new_tokens=4)
    other = engine.generate(PROMPT.replace("which river", "what capital"), max_new_tokens=1)
    found = other.passages_hit + other.passages_unused
    assert found == len(DOCS)  # its own lookup and repair, not the session's


def test_session_kv_never_enters_the_exact_prefix_cache() -> None:
    engine, _ = engines("fast")
    first = engine.generate(PROMPT, max_new_tokens=6)
    follow = PROMPT + first.text + " More:"
    engine.generate(follow, max_new_tokens=1)
    system = len(engine.tokenize(SYSTEM))
    assert engine._caches.exact.match(engine.tokenize(follow)).length <= system + 1


def test_exact_fidelity_keeps_no_session() -> None:
    engine = KVBoost(
        make_model("llama"), engines("fast")[0].tokenizer, KVBoostConfig(fidelity="exact")
    )
    assert engine._caches.session is None
    first = engine.generate(PROMPT, max_new_tokens=3)
    again = engine.generate(PROMPT + first.text, max_new_tokens=1)
    # The exact prefix cache alone serves the continuation, exactly.
    assert again.reused_tokens >= first.prompt_tokens
    with torch.no_grad():
        ids = torch.tensor([engine.tokenize(PROMPT + first.text)])
        full = engine.model(ids).logits[0, -1]
    torch.testing.assert_close(
        engine.first_token_logits(PROMPT + first.text), full, atol=1e-5, rtol=0
    )
