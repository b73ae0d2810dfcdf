"""The repeat guard, answers decoded again as text, tool_choice="none" and the notes after
tool results: pure parts, then end to end on a tiny random model under the grammar."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import _tiny_kwargs, make_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.core.tools.formats import FORMATS, ToolCall
from kvboost_rag.core.tools.repeats import RepeatGuard, answered_calls, call_key, kept_tokens
from kvboost_rag.core.tools.template import NEXT_STEP, noted_result, render_chat

PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "Ping the server.",
        "parameters": {"type": "object", "properties": {}},
    },
}
ASKED = {"role": "user", "content": "Is the server up?"}
CALLED = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"id": "c1", "function": {"name": "ping", "arguments": "{}"}}],
}
ANSWERED = {"role": "tool", "tool_call_id": "c1", "content": "pong"}


def call(name: str, arguments: dict, id_: str = "c1") -> dict:
    return {"id": id_, "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_calls_are_the_same_by_name_and_canonical_arguments() -> None:
    assert call_key("add", {"a": 2, "b": 3.0}) == call_key("add", {"b": 3, "a": 2.0})
    assert call_key("add", {"a": 2}) != call_key("add", {"a": 2.5})
    assert call_key("add", {"a": 2}) != call_key("sub", {"a": 2})
    assert call_key("f", {"x": [1.0, {"y": 2.0}]}) == call_key("f", {"x": [1, {"y": 2}]})
    assert call_key("f", {"x": True}) != call_key("f", {"x": 1})


def test_answered_calls_are_those_with_a_result_since_the_last_question() -> None:
    made = {"role": "assistant", "content": "", "tool_calls": [call("add", {"a": 1, "b": 2})]}
    result = {"role": "tool", "tool_call_id": "c1", "content": "3"}
    other = {"role": "tool", "tool_call_id": "c9", "content": "3"}
    unnamed = {"role": "tool", "content": "3"}
    key = call_key("add", {"a": 1, "b": 2})
    assert answered_calls([ASKED, made, result]) == {key}
    assert answered_calls([ASKED, made]) == set()  # no result yet
    assert answered_calls([ASKED, made, other]) == set()  # a result of another call
    assert answered_calls([ASKED, made, unnamed]) == {key}  # results without ids
    assert answered_calls([ASKED, made, result, ASKED]) == set()  # a new question


def test_kept_tokens_write_the_content_before_the_call() -> None:
    ids = list(range(12))
    text = "Let me see. {call}"

    def decode(part: list[int]) -> str:
        return text[: len(part) * 2]  # two characters a token

    # six tokens write "Let me see. " (the space before the call counts with it)
    assert kept_tokens(ids, "Let me see.", decode) == 6
    assert kept_tokens(ids, "", decode) == 0
    assert kept_tokens(ids, "Other words", decode) == 0


def test_a_guard_names_the_repeated_calls() -> None:
    guard = RepeatGuard(frozenset({call_key("ping", {})}))
    calls = [ToolCall("ping", {}), ToolCall("ping", {"host": "a"})]
    assert guard.repeated(calls) == calls[:1]


def test_tool_results_carry_a_note_naming_their_call() -> None:
    tokenizer = make_tokenizer()
    messages = [ASKED, CALLED, ANSWERED]
    plain = render_chat(tokenizer, messages, [PING], FORMATS["hermes"])
    noted = render_chat(tokenizer, messages, [PING], FORMATS["hermes"], notes=True)
    note = NEXT_STEP
    assert note not in plain
    expected = "<tool_response>\nThe tool ping({}) answered: pong\n</tool_response>\n" + note
    assert noted_result("ping({})", "pong") == expected and expected in noted
    # no note where no tools are offered (the answer is asked for), nor in the JSON format
    assert note not in render_chat(tokenizer, messages, [], FORMATS["hermes"], notes=True)
    assert note not in render_chat(tokenizer, messages, [PING], FORMATS["json"], notes=True)


@pytest.fixture(scope="module")
def engine() -> KVBoost:
    """A tiny random model with room for the tool instructions (one token per character)."""
    torch.manual_seed(0)
    tokenizer = make_tokenizer()
    kwargs = {**_tiny_kwargs(len(tokenizer)), "max_position_embeddings": 2048}
    model = LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
    return KVBoost(model, tokenizer, KVBoostConfig(fidelity="exact"))


def looks_like_a_call(text: str) -> bool:
    return any(part in text for part in ('"name', "'name", "<tool_call>", "```json"))


def test_a_repeated_call_is_withheld_and_answered_as_text(engine: KVBoost) -> None:
    messages = [ASKED, CALLED, ANSWERED]
    options = {"tools": [PING], "tool_choice": "ping", "max_new_tokens": 64}
    first = engine.chat([ASKED], **options)  # type: ignore[arg-type]
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("ping", {})]
    assert first.retried == "" and first.withheld_tool_calls == []

    guarded = engine.chat(messages, **options)  # type: ignore[arg-type]
    assert guarded.tool_calls == [] and guarded.invalid_tool_calls == []
    assert [(c.name, c.arguments) for c in guarded.withheld_tool_calls] == [("ping", {})]
    assert guarded.retried.startswith("repeat guard: ping was called")
    assert guarded.text.strip() and not looks_like_a_call(guarded.text)
    assert guarded.finish_reason in ("stop", "length")
    assert guarded.prompt_tokens == len(engine.tokenize_chat(messages, tools=[PING]))

    unguarded = engine.chat(messages, repeat_guard=False, **options)  # type: ignore[arg-type]
    assert [(c.name, c.arguments) for c in unguarded.tool_calls] == [("ping", {})]
    assert unguarded.retried == ""

    stream = engine.stream_chat(messages, **options)  # type: ignore[arg-type]
    text = "".join(stream)
    assert stream.result is not None
    assert text == stream.result.text == guarded.text
    named = [(c.name, c.arguments) for c in stream.result.withheld_tool_calls]
    assert named == [("ping", {})] and stream.result.retried == guarded.retried


def test_repeat_guard_must_be_a_bool(engine: KVBoost) -> None:
    with pytest.raises(ValueError, match="repeat_guard must be True or False"):
        engine.chat([ASKED], tools=[PING], repeat_guard="no")  # type: ignore[typeddict-item]


def test_no_tools_and_no_repeat_answer_as_before(engine: KVBoost) -> None:
    plain = engine.chat([ASKED], max_new_tokens=8)
    again = engine.chat([ASKED], max_new_tokens=8, repeat_guard=False)
    assert plain.token_ids == again.token_ids and plain.retried == ""


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_none_answers_in_text_with_the_tools_in_the_prompt(
    engine: KVBoost, seed: int
) -> None:
    result = engine.chat(
        [ASKED], tools=[PING], tool_choice="none", max_new_tokens=16, temperature=1.0, seed=seed
    )
    assert result.tool_calls == [] and result.invalid_tool_calls == []
    assert result.text.strip() and not looks_like_a_call(result.text)
    assert result.prompt_tokens == len(engine.tokenize_chat([ASKED], tools=[PING]))
