"""Passages encoded after the prompt's own prefix, keyed (prefix, passage), and the
fallback for a prompt whose prefix has no variant of a passage."""

import pytest
import torch
from conftest import ARCHITECTURES, make_model

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.prompt.chunker import passage

DOCS = [
    "Paris is the capital of France and sits on the Seine.",
    "The Nile flows north through Egypt into the Mediterranean.",
    "Mount Fuji is the highest mountain in Japan.",
]
HEAD = "You answer from the documents.\nDocuments:\n"
OTHER_HEAD = "Reply in one word, using these notes.\nNotes:\n"
QUESTION = "\nQuestion: which river flows north? Answer:"


def engine_with(arch: str, tokenizer, **config) -> KVBoost:
    config = {"block_tokens": 8, "fidelity": "fast", **config}
    return KVBoost(make_model(arch), tokenizer, KVBoostConfig(**config))


def prompt(head: str, docs: list[str]) -> str:
    return head + "\n\n".join(passage(d) for d in docs) + QUESTION


def full_logits(engine: KVBoost, text: str) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(torch.tensor([engine.tokenize(text)])).logits[0, -1]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_passage_right_after_its_own_prefix_equals_full_prefill(arch: str, tokenizer) -> None:
    engine = engine_with(arch, tokenizer)
    engine.warm_passages(DOCS, prefix=prompt(HEAD, ["x"]))
    text = prompt(HEAD, [DOCS[1]])
    result = engine.generate(text, max_new_tokens=1)
    assert (result.passages_hit, result.passages_foreign) == (1, 0)
    torch.testing.assert_close(
        engine.first_token_logits(text), full_logits(engine, text), atol=1e-5, rtol=0
    )


def test_the_passage_kv_is_the_full_prefill_kv(tokenizer) -> None:
    engine = engine_with("llama", tokenizer)
    prefix = engine.passage_prefix(prompt(HEAD, ["x"]))
    tokens = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    cache = engine.inspect.passage_cache
    ((_, stored),) = cache.encoder.encode(prefix, [tokens])
    with torch.no_grad():
        out = engine.model(torch.tensor([prefix + tokens]))
    for (keys, values), fresh in zip(stored, out.cache.layers):
        torch.testing.assert_close(keys, fresh.keys[:, :, len(prefix) :], atol=1e-5, rtol=0)
        torch.testing.assert_close(values, fresh.values[:, :, len(prefix) :], atol=1e-5, rtol=0)


def test_bos_only_passages_are_not_exact(tokenizer) -> None:
    """The property above is the prefix's doing: after BOS only, the same prompt differs."""
    engine = engine_with("llama", tokenizer, passage_prefix="anchor")
    engine.warm_passages(DOCS)
    text = prompt(HEAD, [DOCS[1]])
    gap = (engine.first_token_logits(text) - full_logits(engine, text)).abs().max()
    assert gap > 1e-3


def test_prefix_keys_hits_and_misses(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, prefix_fallback="encode")
    engine.warm_passages(DOCS, prefix=prompt(HEAD, ["x"]))
    own = engine.generate(prompt(HEAD, DOCS[::-1]), max_new_tokens=1)
    assert (own.passages_hit, own.passages_missed, own.passages_foreign) == (3, 0, 0)
    other = engine.generate(prompt(OTHER_HEAD, DOCS), max_new_tokens=1)
    assert (other.passages_hit, other.passages_missed) == (0, 3)
    again = engine.generate(prompt(OTHER_HEAD, DOCS[1:]), max_new_tokens=1)
    assert (again.passages_hit, again.passages_missed, again.passages_foreign) == (2, 0, 0)


def test_unknown_prefix_borrows_the_nearest_variant_and_says_so(tokenizer) -> None:
    engine = engine_with("llama", tokenizer)  # prefix_fallback="nearest" by default
    engine.warm_passages(DOCS, prefix=prompt(HEAD, ["x"]))
    first = engine.generate(prompt(OTHER_HEAD, DOCS), max_new_tokens=1)
    assert (first.passages_hit, first.passages_missed, first.passages_foreign) == (3, 0, 3)
    # The layout came back: after this answer it gets variants of its own.
    second = engine.generate(prompt(OTHER_HEAD, DOCS), max_new_tokens=1)
    assert second.passages_foreign == 3
    third = engine.generate(prompt(OTHER_HEAD, DOCS[:2]), max_new_tokens=1)
    assert (third.passages_hit, third.passages_foreign) == (2, 0)


def test_the_nearest_prefix_is_the_one_sharing_most_leading_tokens(tokenizer) -> None:
    engine = engine_with("llama", tokenizer)
    cache = engine.inspect.passage_cache
    close = cache.prefix(engine.passage_prefix(prompt(HEAD + "A\n", ["x"])))
    far = cache.prefix(engine.passage_prefix(prompt(OTHER_HEAD, ["x"])))
    engine.warm_passages(DOCS[:1], prefix=prompt(HEAD + "A\n", ["x"]))
    engine.warm_passages(DOCS[:1], prefix=prompt(OTHER_HEAD, ["x"]))  # newer, further
    mine = cache.prefix(engine.passage_prefix(prompt(HEAD + "B\n", ["x"])))
    tokens = tokenizer(DOCS[0], add_special_tokens=False)["input_ids"]
    assert cache.find(mine, [tokens])[0][0] == close != far


def test_a_new_layout_with_most_passages_missing_is_prefilled_exactly(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, prefix_fallback="encode")
    engine.warm_passages(DOCS)  # BOS-only variants: no prompt's own prefix
    text = prompt(HEAD, DOCS)
    result = engine.generate(text, max_new_tokens=1)
    assert result.passages_missed == 3 and result.reused_tokens == 0
    torch.testing.assert_close(
        engine.first_token_logits(text),
        full_logits(engine, text),
        atol=1e-5,
        rtol=0,
    )


def test_variants_on_disk_serve_another_process_without_its_warming(tmp_path, tokenizer) -> None:
    model = make_model("llama")
    config = KVBoostConfig(block_tokens=8, fidelity="fast", cache_dir=tmp_path)
    KVBoost(model, tokenizer, config).warm_passages(DOCS, prefix=prompt(HEAD, ["x"]))
    fresh = KVBoost(model, tokenizer, config)
    result = fresh.generate(prompt(HEAD, DOCS), max_new_tokens=1)
    assert (result.passages_hit, result.passages_foreign) == (3, 0)


def test_passage_prefix_forms(tokenizer) -> None:
    engine = engine_with("llama", tokenizer)
    with_marker = engine.passage_prefix(HEAD + passage("x") + QUESTION)
    assert with_marker == engine.passage_prefix(HEAD) == engine.tokenize(HEAD)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HEAD}]
    chat = engine.passage_prefix(
        [messages[0], {"role": "user", "content": HEAD + passage("x") + QUESTION}]
    )
    assert chat == engine.tokenize_chat(messages)[: len(chat)]
    with pytest.raises(ValueError, match="mark no passage"):
        engine.passage_prefix(messages)
    with pytest.raises(TypeError, match="str or chat messages"):
        engine.passage_prefix(42)  # type: ignore[arg-type]


def test_a_prefix_with_bos_only_passages_is_an_error(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, passage_prefix="anchor")
    with pytest.raises(ValueError, match='passage_prefix="anchor"'):
        engine.warm_passages(DOCS, prefix=HEAD)
    with pytest.raises(ValueError, match="passage_prefix must be one of"):
        KVBoostConfig(passage_prefix="bos")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefix_fallback must be one of"):
        KVBoostConfig(prefix_fallback="guess")  # type: ignore[arg-type]


def test_answer_logits_match_a_full_forward_over_prompt_and_answer(tokenizer) -> None:
    engine = engine_with("llama", tokenizer, fidelity="exact")
    text, answer = prompt(HEAD, DOCS), [40, 41, 42]
    ours = engine.answer_logits(text, answer)
    with torch.no_grad():
        ids = torch.tensor([engine.tokenize(text) + answer[:-1]])
        full = engine.model(ids).logits[0, -len(answer) :]
    assert ours.shape == (3, full.shape[-1])
    torch.testing.assert_close(ours, full, atol=1e-5, rtol=0)


def test_a_prefix_and_passage_over_the_context_window_is_refused(tokenizer) -> None:
    from kvboost_rag.core.errors import ContextWindowError

    engine = engine_with("llama", tokenizer)  # a 512-token window
    with pytest.raises(ContextWindowError, match="after the 450-token prefix is 550 tokens"):
        engine.warm_passages(["a" * 100], prefix="b" * 450)
    assert engine.stats().cache.entries == 0


def test_a_later_chat_turn_reuses_its_passages_under_the_conversation_head(tokenizer) -> None:
    engine = engine_with("llama", tokenizer)
    system = {"role": "system", "content": "Answer from the documents."}

    def ask(docs: list[str]) -> dict[str, str]:
        return {"role": "user", "content": prompt("Documents:\n", docs)}

    engine.warm_passages(DOCS, prefix=[system, ask(["x"])])
    first = engine.chat([system, ask(DOCS[:2])], max_new_tokens=3)
    history = [system, ask(DOCS[:2]), {"role": "assistant", "content": first.text}]
    second = engine.chat([*history, ask(DOCS[2:])], max_new_tokens=1)
    # The first turn and its answer continue from the session cache; the new turn's passage
    # is found under the conversation head (the prompt's prefix before its first passage).
    assert (second.passages_hit, second.passages_missed, second.passages_foreign) == (1, 0, 0)
    assert second.reused_tokens > first.prompt_tokens
