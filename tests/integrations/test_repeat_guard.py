"""The repeat guard through both frameworks: a call the history already answered comes back
as text, and the metadata says so; ``repeat_guard=False`` passes through."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage, TextBlock, ToolCallBlock

from kvboost_rag import KVBoost, KVBoostConfig
from kvboost_rag.integrations.langchain import ChatKVBoost
from kvboost_rag.integrations.llamaindex import KVBoostLLM

PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "description": "Ping the server.",
        "parameters": {"type": "object", "properties": {}},
    },
}
QUESTION = "Is the server up?"


@pytest.fixture(scope="module")
def engine(embedded: KVBoost) -> KVBoost:
    return KVBoost(embedded.model, embedded.tokenizer, KVBoostConfig())


def test_langchain_gets_the_answer_as_text_and_says_why(engine: KVBoost) -> None:
    chat = ChatKVBoost(engine=engine, max_tokens=48).bind_tools([PING], tool_choice="ping")
    history = [
        HumanMessage(QUESTION),
        AIMessage("", tool_calls=[{"name": "ping", "args": {}, "id": "c1"}]),
        ToolMessage("pong", tool_call_id="c1"),
    ]
    answer = chat.invoke(history)
    assert answer.tool_calls == [] and str(answer.content).strip()
    meta = answer.response_metadata
    assert meta["retried"].startswith("repeat guard: ping")
    assert meta["withheld_tool_calls"] == [{"name": "ping", "arguments": {}}]
    again = ChatKVBoost(engine=engine, max_tokens=48).bind_tools(
        [PING], tool_choice="ping", repeat_guard=False
    )
    unguarded = again.invoke(history)
    assert [c["name"] for c in unguarded.tool_calls] == ["ping"]
    assert unguarded.response_metadata["retried"] == ""
    first = chat.invoke([HumanMessage(QUESTION)])  # nothing answered yet: the call stands
    assert [c["name"] for c in first.tool_calls] == ["ping"]


def test_llamaindex_gets_the_answer_as_text_and_says_why(engine: KVBoost) -> None:
    llm = KVBoostLLM(engine=engine, max_tokens=48)
    call = ToolCallBlock(tool_call_id="c1", tool_name="ping", tool_kwargs={})
    history = [
        ChatMessage(role="user", content=QUESTION),
        ChatMessage(role="assistant", blocks=[TextBlock(text=""), call]),
        ChatMessage(role="tool", content="pong", additional_kwargs={"tool_call_id": "c1"}),
    ]
    response = llm.chat(history, tools=[PING], tool_choice="ping")
    assert str(response.message.content or "").strip()
    assert response.additional_kwargs["retried"].startswith("repeat guard: ping")
    assert not llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
