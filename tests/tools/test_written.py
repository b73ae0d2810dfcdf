"""Calls rendered back as the model wrote them: only the engine's own, unchanged; any other
call as the chat template renders it. On Qwen2.5's real tokenizer and template."""

from __future__ import annotations

import pytest
from families import family_tokenizer

from kvboost_rag.core.tools.formats import FORMATS, ToolCall
from kvboost_rag.core.tools.template import render_chat
from kvboost_rag.core.tools.written import WrittenCalls

FENCED = '```json\n{"name": "multiply", "arguments": {"a": 12, "b": 7}}\n```'
CALL = ToolCall("multiply", {"a": 12, "b": 7}, id="call_1")
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two numbers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
            "required": ["a", "b"],
        },
    },
}
ASK = {"role": "user", "content": "What is 12 times 7?"}


def openai_call(name: str, arguments: str, id_: str = "call_1") -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_call_is_written_back_only_as_the_engine_returned_it() -> None:
    written = WrittenCalls()
    written.remember(FENCED, "", [CALL])
    assert written.text_of("", [CALL]) == FENCED
    # the same call as a framework sends it back: arguments as JSON, 12.0 for 12
    back = ToolCall("multiply", {"b": 7, "a": 12.0}, id="call_1")
    assert written.text_of("  ", [back]) == FENCED
    assert written.text_of("", [ToolCall("multiply", {"a": 12, "b": 8}, id="call_1")]) is None
    assert written.text_of("Sure.", [CALL]) is None  # content changed
    assert written.text_of("", [ToolCall("multiply", {"a": 12, "b": 7}, id="call_2")]) is None
    assert written.text_of("", [CALL, CALL]) is None  # not the calls it made


def test_the_oldest_answers_are_forgotten_first() -> None:
    written = WrittenCalls(limit=2)
    calls = [ToolCall("f", {}, id=f"c{i}") for i in range(3)]
    for i, call in enumerate(calls):
        written.remember(f"text {i}", "", [call])
    assert len(written) == 2
    assert written.text_of("", calls[:1]) is None
    assert written.text_of("", calls[2:]) == "text 2"
    with pytest.raises(ValueError, match="limit must be at least 1"):
        WrittenCalls(limit=0)


def test_qwen_s_next_prompt_holds_the_call_as_written() -> None:
    tokenizer = family_tokenizer("qwen2.5")
    written = WrittenCalls()
    written.remember(FENCED, "", [CALL])
    messages = [
        ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [openai_call("multiply", '{"a": 12, "b": 7}')],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "84"},
    ]
    fmt = FORMATS["hermes"]
    first = render_chat(tokenizer, [ASK], [MULTIPLY], fmt)
    as_written = render_chat(tokenizer, messages, [MULTIPLY], fmt, written=written)
    assert as_written.startswith(first + FENCED + "<|im_end|>")
    # without the record (another process's call, or one it never wrote): the template's tags
    templated = render_chat(tokenizer, messages, [MULTIPLY], fmt)
    assert templated.startswith(first + "<tool_call>")
    other = [
        *messages[:1],
        {**messages[1], "tool_calls": [openai_call("multiply", '{"a": 3, "b": 7}')]},
    ]
    assert FENCED not in render_chat(tokenizer, other, [MULTIPLY], fmt, written=written)
