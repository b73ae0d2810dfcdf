"""Tool calls and structured output on the chat templates of the families users run
(SmolLM2, Qwen2.5, Gemma 3): their real tokenizers over tiny random weights, decoded under
the grammar. Qwen2.5 writes ``<tool_call>`` as one added token (151657), which a grammar
spelling the tag as text refused with "token [151657] doesn't satisfy the grammar"."""

from __future__ import annotations

import json

import jsonschema
import pytest
from families import family, family_engine  # noqa: F401 - the fixture

from kvboost_rag import KVBoost
from kvboost_rag.core.generation.handle import eos_ids
from kvboost_rag.core.tools.structure import Constrainer

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
CITY = {"type": "string", "maxLength": 8, "pattern": "^[A-Za-z]+$"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": CITY}, "required": ["city"]},
    },
}
TOOLS = [ADD, WEATHER]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is 17 plus 25?"}]


def assert_valid(result, names: set[str]) -> None:  # type: ignore[no-untyped-def]
    assert result.invalid_tool_calls == [], result.invalid_tool_calls
    assert result.tool_calls and result.finish_reason == "tool_calls", result
    for call in result.tool_calls:
        assert call.name in names
        jsonschema.validate(call.arguments, PARAMS[call.name])


def answer_text(engine: KVBoost, result) -> str:  # type: ignore[no-untyped-def]
    """What the model wrote, special tokens included, without the token that ended it."""
    ids = result.token_ids[:-1] if result.finish_reason == "tool_calls" else result.token_ids
    return str(engine.tokenizer.decode(ids, skip_special_tokens=False))


@pytest.mark.parametrize(("choice", "seed"), [("required", 0), ("required", 1), ("add", 2)])
def test_forced_calls_are_valid_and_render_back_as_written(
    family: KVBoost,  # noqa: F811
    choice: str,
    seed: int,
) -> None:
    """The call parses, and the next step's prompt holds the answer as the model wrote it
    (its KV is then read from the cache)."""
    options = dict(tools=TOOLS, tool_choice=choice, max_new_tokens=80)
    result = family.chat(USER, temperature=1.0, seed=seed, **options)
    assert_valid(result, {"add"} if choice == "add" else {"add", "get_weather"})
    call = result.tool_calls[0]
    history = USER + [
        {"role": "assistant", "content": result.text, "tool_calls": result.tool_calls},
        {"role": "tool", "content": "42", "tool_call_id": call.id},
    ]
    prompt = family.tokenizer.decode(family.tokenize_chat(USER, tools=TOOLS))
    rendered = family.tokenizer.decode(family.tokenize_chat(history, tools=TOOLS))
    assert rendered.startswith(prompt + answer_text(family, result))
    second = family.chat(history, tools=TOOLS, max_new_tokens=4)
    assert second.reused_tokens >= result.prompt_tokens


def test_qwen_writes_its_tags_as_its_own_tokens() -> None:
    engine = family_engine("qwen2.5")
    result = engine.chat(USER, tools=TOOLS, tool_choice="required", max_new_tokens=80)
    assert_valid(result, {"add", "get_weather"})
    tag, end = engine.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert result.token_ids[0] == tag and result.token_ids[-2] == end


@pytest.mark.parametrize("text", ["", "Let me add them. "])
def test_the_auto_grammar_takes_a_call_as_the_tokenizer_writes_it(
    family: KVBoost,  # noqa: F811
    text: str,
) -> None:
    """A call after free text, tokenized as the template would render it: Qwen's tags are
    special tokens there, the others' are text."""
    eos = sorted(eos_ids(family.model))
    constrainer = Constrainer(family.tokenizer, eos)
    grammar = family.structure(TOOLS).grammar(constrainer.special)
    assert grammar is not None
    processor = constrainer.processor(grammar)

    def allowed(token: int) -> bool:
        return bool(processor.bitmask()[token // 8] >> (token % 8) & 1)

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'
    for token in family.tokenizer.encode(text + call, add_special_tokens=False):
        assert allowed(token), family.tokenizer.decode([token])
        processor.consume(token)
    assert any(allowed(token) for token in eos), "the answer may end after the call"


@pytest.mark.parametrize("seed", range(2))
def test_auto_choice_gives_text_or_valid_calls(family: KVBoost, seed: int) -> None:  # noqa: F811
    result = family.chat(USER, tools=TOOLS, temperature=1.0, seed=seed, max_new_tokens=24)
    assert result.invalid_tool_calls == []
    if result.tool_calls:
        assert_valid(result, {"add", "get_weather"})


def test_streaming_holds_the_call_back(family: KVBoost) -> None:  # noqa: F811
    stream = family.stream_chat(USER, tools=TOOLS, tool_choice="add", max_new_tokens=80)
    assert "".join(stream) == ""
    assert stream.result is not None
    assert_valid(stream.result, {"add"})


CAT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8, "pattern": "^[A-Za-z]+$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
    },
    "required": ["name", "age"],
}


def test_json_answers_parse_and_validate(family: KVBoost) -> None:  # noqa: F811
    schema = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT}}
    sampled = dict(temperature=1.0, seed=0, max_new_tokens=48)
    result = family.chat(USER, response_format=schema, **sampled)
    assert result.finish_reason == "stop", result
    jsonschema.validate(json.loads(result.text), {**CAT, "additionalProperties": False})
    free = family.chat(USER, response_format={"type": "json_object"}, **sampled)
    if free.finish_reason == "stop":
        assert isinstance(json.loads(free.text), dict)
