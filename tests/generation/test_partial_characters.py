"""A generated text never ends in half a character (issue 48 row 10: an answer cut by
``max_new_tokens`` inside an emoji ended in U+FFFD). Qwen2.5's real tokenizer writes " 🚀"
as three byte-level tokens; a tiny Qwen2 whose weights are set to write a fixed token
sequence stops after each of them in turn."""

from __future__ import annotations

import pytest
import torch
from families import family_path, family_tokenizer

from kvboost_rag import KVBoost, KVBoostConfig

PROMPT = "Réponds en une ligne:"
ANSWER = " 🚀 done"  # the model writes these tokens, whatever it is asked


@pytest.fixture(scope="module")
def scripted() -> tuple[KVBoost, list[int]]:
    """An engine whose model writes ``ANSWER``'s tokens after ``PROMPT``, and those ids."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = family_tokenizer("qwen2.5")
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    chain = [tokenizer.encode(PROMPT, add_special_tokens=False)[-1], *answer]
    assert len(set(chain)) == len(chain)  # each token says which comes next
    config = AutoConfig.from_pretrained(family_path("qwen2.5"))
    for key, value in dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2).items():
        setattr(config, key, value)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 4, 2, 16
    config.tie_word_embeddings = False
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: config.num_hidden_layers]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # Each position's hidden state is its own token's embedding (attention and MLP
        # add nothing), and the head maps chain token i to chain token i + 1.
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (token, following) in enumerate(zip(chain, chain[1:])):
            model.model.embed_tokens.weight[token] = torch.nn.functional.one_hot(
                torch.tensor(i), config.hidden_size
            ).float()
            model.lm_head.weight[following, i] = 50.0
    return KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact")), answer


def complete_text(tokenizer: object, ids: list[int]) -> str:
    """The whole characters the byte-level tokens ``ids`` spell, found from their bytes
    (GPT-2's byte alphabet), not from the tokenizer's decode."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    tokens = tokenizer.convert_ids_to_tokens(ids)  # type: ignore[attr-defined]
    data = bytes(byte_of[c] for token in tokens for c in token)
    return data.decode("utf-8", errors="ignore")  # a partial last character is dropped


def test_the_tokenizer_splits_the_emoji_and_the_model_writes_the_script(scripted) -> None:
    engine, answer = scripted
    assert len(answer) >= 4 and "\ufffd" in engine.tokenizer.decode(answer[:1])
    result = engine.generate(PROMPT, max_new_tokens=len(answer))
    assert result.token_ids == answer and result.text == ANSWER


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_a_result_cut_inside_a_character_ends_before_it(scripted, count: int) -> None:
    engine, answer = scripted
    result = engine.generate(PROMPT, max_new_tokens=count)
    assert result.token_ids == answer[:count] and result.finish_reason == "length"
    assert result.text == complete_text(engine.tokenizer, answer[:count])
    assert "\ufffd" not in result.text


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_a_stream_holds_a_partial_character_back_to_the_end(scripted, count: int) -> None:
    engine, answer = scripted
    stream = engine.stream(PROMPT, max_new_tokens=count)
    deltas = list(stream)
    assert not any("\ufffd" in delta for delta in deltas), deltas
    assert stream.result is not None
    assert "".join(deltas) == stream.result.text == complete_text(engine.tokenizer, answer[:count])
