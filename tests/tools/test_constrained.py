"""Constrained decoding end to end: under the grammar even a random model's answer is a
valid call or valid JSON, on the plain path and on the reused-passage path (whose first
token comes from the repair pass's logits)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from conftest import _tiny_kwargs, found, make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.prompt.chunker import passage

# Bounded arguments, so a random model's sampled call ends within a few dozen tokens.
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the essays.",
        "parameters": {
            "type": "object",
            "properties": {"q": {"type": "string", "maxLength": 8}},
            "required": ["q"],
        },
    },
}
USER = [{"role": "user", "content": "What is 1 plus 2?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, SEARCH)}


def engine_for(arch: str, fidelity: str = "exact") -> KVBoost:
    """A tiny random model with room for the tool instructions (one token per character)."""
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    kwargs = {**_tiny_kwargs(len(tokenizer)), "max_position_embeddings": 2048}
    config, cls = (
        (LlamaConfig, LlamaForCausalLM) if arch == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    )
    model = cls(config(**kwargs)).eval()
    return KVBoost(model, tokenizer, KVBoostConfig(fidelity=fidelity))


@pytest.fixture(scope="module")
def llama() -> KVBoost:
    return engine_for("llama")


def assert_valid(result, names: set[str]) -> None:  # type: ignore[no-untyped-def]
    assert result.invalid_tool_calls == []
    assert result.tool_calls, result
    for call in result.tool_calls:
        assert call.name in names
        jsonschema.validate(call.arguments, PARAMS[call.name])


@pytest.mark.parametrize("seed", range(4))
def test_a_random_model_under_the_grammar_makes_valid_calls(llama: KVBoost, seed: int) -> None:
    result = llama.chat(
        USER,
        tools=[ADD, SEARCH],
        tool_choice="required",
        temperature=1.0,
        seed=seed,
        max_new_tokens=200,
    )
    assert_valid(result, {"add", "search"})
    assert result.finish_reason == "tool_calls" and len(result.tool_calls) == 1


def test_a_named_tool_choice_calls_that_tool(llama: KVBoost) -> None:
    result = llama.chat(USER, tools=[ADD, SEARCH], tool_choice="search", max_new_tokens=200)
    assert_valid(result, {"search"})


def test_parallel_calls_are_allowed_when_asked(llama: KVBoost) -> None:
    for seed in range(6):
        result = llama.chat(
            USER,
            tools=[ADD],
            tool_choice="required",
            parallel_tool_calls=True,
            temperature=1.0,
            seed=seed,
            max_new_tokens=300,
        )
        assert result.invalid_tool_calls == []
        if len(result.tool_calls) > 1 or result.finish_reason == "length":
            return
    pytest.fail("no sampled answer went past one call although parallel calls were allowed")


@pytest.mark.parametrize("seed", range(3))
def test_auto_choice_gives_text_or_valid_calls_never_broken_ones(llama: KVBoost, seed: int) -> None:
    result = llama.chat(USER, tools=[ADD], temperature=1.0, seed=seed, max_new_tokens=120)
    assert result.invalid_tool_calls == []
    if result.tool_calls:
        assert_valid(result, {"add"})


def test_without_the_grammar_a_random_model_makes_no_call(llama: KVBoost) -> None:
    result = llama.chat(
        USER, tools=[ADD], tool_choice="required", constrain=False, max_new_tokens=30
    )
    assert result.tool_calls == []


CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "age"],
}


@pytest.mark.parametrize("seed", range(3))
def test_json_schema_answers_parse_and_validate(llama: KVBoost, seed: int) -> None:
    schema_format = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
    result = llama.chat(
        USER, response_format=schema_format, temperature=1.0, seed=seed, max_new_tokens=200
    )
    jsonschema.validate(json.loads(result.text), {**CAT, "additionalProperties": False})
    completion = llama.generate(
        "A cat:",
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=seed,
        max_new_tokens=200,
    )
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)


@pytest.mark.parametrize("fidelity", ["fast", "balanced"])
def test_reused_passages_keep_the_grammar_from_the_first_token(fidelity: str) -> None:
    engine = engine_for("qwen2", fidelity)
    docs = ["Alpha beta gamma delta. " * 3, "Epsilon zeta eta theta. " * 3]
    messages = [{"role": "user", "content": "".join(passage(d) for d in docs) + "Sum?"}]
    engine.warm_passages(docs, prefix=messages)
    result = engine.chat(messages, tools=[ADD], tool_choice="required", max_new_tokens=200)
    assert found(result) == 2 and result.reused_tokens > 0
    assert_valid(result, {"add"})


def test_a_call_cut_by_the_token_limit_is_reported_not_raised(llama: KVBoost) -> None:
    result = llama.chat(USER, tools=[ADD], tool_choice="required", max_new_tokens=12)
    assert result.finish_reason == "length"
    assert result.tool_calls == [] and len(result.invalid_tool_calls) == 1


def test_streaming_holds_the_call_back_and_ends_with_it(llama: KVBoost) -> None:
    stream = llama.stream_chat(USER, tools=[ADD], tool_choice="required", max_new_tokens=200)
    assert "".join(stream) == ""
    assert_valid(stream.result, {"add"})
    plain = llama.stream_chat(USER, tools=[ADD], tool_choice="none", max_new_tokens=20)
    assert "".join(plain) == plain.result.text


def test_a_schema_llguidance_cannot_compile_is_a_clear_error(llama: KVBoost) -> None:
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "$ref": "#/x"}}}
    with pytest.raises(ValueError, match="cannot constrain decoding"):
        llama.chat(USER, response_format=bad, max_new_tokens=4)


@pytest.mark.embedded
def test_the_embedded_model_calls_a_named_tool_and_the_next_step_reuses_the_history(
    embedded: KVBoost,
) -> None:
    ask = [{"role": "user", "content": "What is 17 plus 25?"}]
    first = embedded.chat(ask, tools=[ADD, SEARCH], tool_choice="add", max_new_tokens=60)
    assert_valid(first, {"add"})
    history = ask + [
        {"role": "assistant", "content": first.text, "tool_calls": first.tool_calls},
        {"role": "tool", "content": "42", "tool_call_id": first.tool_calls[0].id},
    ]
    second = embedded.chat(history, tools=[ADD, SEARCH], max_new_tokens=8)
    # Everything but the tool result and the turn markers after it comes from the cache.
    assert second.reused_tokens >= first.prompt_tokens + first.completion_tokens - 16


def test_a_grammar_error_is_one_line_naming_its_field() -> None:
    """llguidance's parser errors go on with its statistics as JSON; a client was sent
    them whole (issue 64). The field comes first, so the server can name it."""
    from kvboost_rag.core.tools.structure import said

    stats = (
        'parser error: Too many items (limit 50000)\n{\n  "rows": 43751,\n  "lexer_cost": 2550\n}'
    )
    assert said(stats) == "parser error: Too many items (limit 50000)"
    assert said("x" * 500).endswith("...") and len(said("x" * 500)) == 300
    tokenizer = make_tokenizer()
    model = LlamaForCausalLM(LlamaConfig(**_tiny_kwargs(len(tokenizer))))
    engine = KVBoost(model, tokenizer)
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 5}}}
    with pytest.raises(ValueError, match="^response_format: cannot constrain") as raised:
        engine.chat([{"role": "user", "content": "hi"}], response_format=bad, max_new_tokens=4)
    assert "\n" not in str(raised.value)


def deep_object(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    ("parameters", "choice", "said"),
    [
        (deep_object(1000), "auto", r"^tools\[0\] parameters nests deeper than 64 levels"),
        ({"$ref": "#"}, "required", r"^tools\[0\] parameters: \$ref '#' points inside"),
    ],
)
def test_chat_refuses_a_tool_schema_it_cannot_constrain(parameters, choice, said) -> None:
    """In process the deep one raised RecursionError, and a forced call to the other was
    answered with a call named "" (only the server checked schemas; issue 64)."""
    tokenizer = make_tokenizer()
    engine = KVBoost(LlamaForCausalLM(LlamaConfig(**_tiny_kwargs(len(tokenizer)))), tokenizer)
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=said):
        engine.chat(ask, tools=[tool], tool_choice=choice, max_new_tokens=4)
    with pytest.raises(ValueError, match=said):
        list(engine.stream_chat(ask, tools=[tool], tool_choice=choice, max_new_tokens=4))
