"""Position-independent passage reuse: re-rotation, repair and the engine path."""

import pytest
import torch
from reuse_setup import DOCS, QUESTION, engine_with, full_logits

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.model.rope import rerotate, rotary_embedding, rotation
from kvboost_rag.core.prompt.chunker import passage


def test_rerotated_keys_equal_a_fresh_encode_at_the_new_offset(arch: str, tokenizer) -> None:
    engine = engine_with(arch, tokenizer)
    cache = engine.inspect.passage_cache
    tokens = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    ((_, stored),) = cache.encoder.encode(cache.anchor, [tokens])
    delta, a = 37, len(cache.anchor)
    ids = torch.tensor([[*cache.anchor, *tokens]])
    with torch.no_grad():
        out = engine.model(ids, position_ids=torch.arange(delta, delta + ids.shape[1])[None])
    rot = rotation(delta, rotary_embedding(engine.model), stored[0][0])
    for layer, (keys, values) in enumerate(stored):
        fresh = out.cache.layers[layer]
        torch.testing.assert_close(rerotate(keys, rot), fresh.keys[:, :, a:], atol=2e-5, rtol=0)
        torch.testing.assert_close(values, fresh.values[:, :, a:], atol=2e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["deviation", "query", "passage"])
def test_recomputing_every_token_equals_full_prefill(arch: str, tokenizer, strategy: str) -> None:
    engine = engine_with(arch, tokenizer, repair=strategy, recompute_ratio=1.0)
    engine.warm_passages(DOCS)
    prompt = "Context:\n" + passage(DOCS[2]) + "\n" + passage(DOCS[0]) + "\n" + QUESTION
    logits = engine.first_token_logits(prompt)
    torch.testing.assert_close(
        logits, full_logits(engine, engine.tokenize(prompt)), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20, "top_p": 0.9}])
def test_full_recompute_decodes_like_generate(tokenizer, sampling: dict) -> None:
    """The repair pass picks the first token itself; it must pick what generate would."""
    engine = engine_with("llama", tokenizer, repair="deviation", recompute_ratio=1.0)
    prompt = passage(DOCS[0]) + passage(DOCS[1]) + QUESTION
    assert engine.warm_passages(prompt).new == 2
    result = engine.generate(prompt, max_new_tokens=8, seed=3, **sampling)
    # every position recomputed: both stored passages found, neither used
    assert (result.passages_hit, result.passages_unused) == (0, 2)
    assert result.timings.repair_ms > 0
    torch.manual_seed(3)
    ids = torch.tensor([engine.tokenize(prompt)])
    out = engine.model.generate(ids, max_new_tokens=8, do_sample=bool(sampling), **sampling)
    expected = out[0, ids.shape[1] :].tolist()
    assert result.token_ids == expected[: len(result.token_ids)]


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 20}])
def test_first_token_follows_the_model_generation_config(tokenizer, sampling: dict) -> None:
    """The first token after repair goes through the processors generate builds from the
    model's generation config (here a strong repetition penalty and min_p), as the rest do."""
    engine = engine_with("llama", tokenizer, repair="deviation", recompute_ratio=1.0)
    engine.model.generation_config.repetition_penalty = 50.0
    engine.model.generation_config.min_p = 0.2
    prompt = passage(DOCS[0]) + passage(DOCS[1]) + QUESTION
    engine.warm_passages(prompt)
    result = engine.generate(prompt, max_new_tokens=6, seed=5, **sampling)
    assert result.passages_unused == 2 and result.timings.repair_ms > 0
    torch.manual_seed(5)
    ids = torch.tensor([engine.tokenize(prompt)])
    out = engine.model.generate(ids, max_new_tokens=6, do_sample=bool(sampling), **sampling)
    assert result.token_ids == out[0, ids.shape[1] :].tolist()[: len(result.token_ids)]
    penalized = engine.model.generate(ids, max_new_tokens=1, repetition_penalty=1.0)
    assert sampling or penalized[0, -1] != out[0, ids.shape[1]]  # the penalty mattered


def test_passage_right_after_bos_needs_no_repair(arch: str, tokenizer) -> None:
    engine = engine_with(arch, tokenizer, repair="none")
    prompt = "<s>" + passage(DOCS[1]) + QUESTION
    tokens = engine.tokenize(prompt)
    assert tokens[0] == tokenizer.bos_token_id == engine.inspect.passage_cache.anchor[0]
    torch.testing.assert_close(
        engine.first_token_logits(prompt), full_logits(engine, tokens), atol=1e-5, rtol=0
    )


def test_reordered_passages_are_all_hits(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="fast", repair="edges", edge_tokens=4)
    first = engine.generate(QUESTION, passages=DOCS, max_new_tokens=4)
    assert (first.passages_hit, first.passages_missed) == (0, 3)
    second = engine.generate(QUESTION, passages=DOCS[::-1], max_new_tokens=4)
    assert (second.passages_hit, second.passages_missed) == (3, 0)
    passage_tokens = sum(len(tokenizer(d)["input_ids"]) for d in DOCS)
    edges = 3 * 4
    assert second.reused_tokens == passage_tokens - edges
    assert second.recomputed_tokens == second.prompt_tokens - second.reused_tokens
    assert second.timings.repair_ms > 0 and second.timings.encode_ms == 0


def test_answers_stay_close_to_full_prefill(tokenizer) -> None:
    """On a tiny random model balanced repair keeps the first-token distribution close."""
    engine = engine_with("llama", tokenizer, fidelity="balanced", recompute_ratio=0.5)
    engine.warm_passages(DOCS)
    prompt = "".join(passage(d) + "\n" for d in DOCS[::-1]) + QUESTION
    ours = torch.log_softmax(engine.first_token_logits(prompt), -1)
    ref = torch.log_softmax(full_logits(engine, engine.tokenize(prompt)), -1)
    none = engine_with("llama", tokenizer, repair="none")
    none.warm_passages(prompt)
    worse = torch.log_softmax(none.first_token_logits(prompt), -1)
    kl = lambda p, q: float((p.exp() * (p - q)).sum())  # noqa: E731
    assert kl(ref, ours) < kl(ref, worse)


def test_exact_fidelity_never_reuses_passages(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="exact")
    engine.generate(QUESTION, passages=DOCS, max_new_tokens=2)
    result = engine.generate(QUESTION, passages=DOCS[::-1], max_new_tokens=2)
    assert result.passages_hit == result.passages_missed == 0
    # Warming it is not an error (the README's warm line is optional): a warning saying
    # exact reuses no passages, and an empty result, the documents still checked.
    engine.flush()  # the answers' prefix blocks are stored after them
    held = engine.stats().cache.entries
    with pytest.warns(UserWarning, match='nothing warmed: .*fidelity="exact"'):
        warmed = engine.warm_passages(DOCS)
    assert (warmed.documents, warmed.units, warmed.tokens, warmed.new) == (len(DOCS), 0, 0, 0)
    assert warmed.pieces == (1,) * len(DOCS) and engine.stats().cache.entries == held
    with pytest.warns(UserWarning, match="skipping texts\[1\]"):
        assert engine.warm_passages([DOCS[0], " "]).skipped == 1
    with pytest.raises(ValueError, match="batch_size"):
        engine.warm_passages(DOCS, batch_size=0)


def test_prefix_cache_stops_at_the_first_reused_passage(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="fast")
    system = "You answer questions about places. " * 2
    prompt = system + passage(DOCS[0]) + QUESTION
    engine.warm_passages(prompt)
    first = engine.generate(prompt, max_new_tokens=2)
    again = engine.generate(prompt, max_new_tokens=2)
    # Had the approximate KV after the passage entered the exact prefix cache, the repeat
    # would be served from it whole; instead only the system prompt is an exact prefix.
    assert first.passages_hit == again.passages_hit == 1
    system_tokens = len(engine.tokenize(system))
    assert again.reused_tokens - first.reused_tokens == system_tokens


def test_model_without_rope_falls_back_to_exact_reuse(tokenizer) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2))
    with pytest.warns(UserWarning, match="no rotary position embedding"):
        engine = KVBoost(model.eval(), tokenizer, KVBoostConfig(fidelity="balanced"))
    result = engine.generate(QUESTION, passages=DOCS, max_new_tokens=2)
    assert result.passages_missed == 0
