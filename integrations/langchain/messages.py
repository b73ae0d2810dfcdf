"""LangChain messages to the engine's chat dicts, and an engine result back to messages:
content, tool calls (whole, or as the chunks a stream ends with) and token usage."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import (
    InvalidToolCall,
    ToolCall,
    ToolCallChunk,
    invalid_tool_call,
    tool_call,
    tool_call_chunk,
)

from kvboost_rag.core.results import GenerationResult
from kvboost_rag.integrations._common import documents_as_passages

_ROLES: dict[type[BaseMessage], str] = {
    SystemMessage: "system",
    HumanMessage: "user",
    AIMessage: "assistant",
    ToolMessage: "tool",
}
# Content blocks that repeat an AIMessage's ``tool_calls`` (Anthropic's, LangChain v1's).
_CALL_BLOCKS = ("tool_use", "tool_call")


def engine_messages(
    messages: Sequence[BaseMessage], documents: Sequence[Any]
) -> list[dict[str, Any]]:
    """LangChain messages as chat-template dicts; ``documents`` become marked passages at
    the start of the last user message."""
    dicts = [engine_message(m, i) for i, m in enumerate(messages)]
    if documents:
        users = [i for i, d in enumerate(dicts) if d["role"] == "user"]
        if not users:
            raise ValueError("documents= needs a user message to place the passages in")
        last = dicts[users[-1]]
        last["content"] = documents_as_passages(documents) + last["content"]
    return dicts


def engine_message(message: BaseMessage, index: int) -> dict[str, Any]:
    """One message: role and text, an assistant's ``tool_calls``, a tool result's call id
    and tool name. Invalid tool calls in the history are left out: they have no arguments
    to render."""
    calls = message.tool_calls if isinstance(message, AIMessage) else []
    out: dict[str, Any] = {"role": _role(message, index), "content": _text(message, index, calls)}
    if calls:
        out["tool_calls"] = [{"name": c["name"], "args": c["args"], "id": c["id"]} for c in calls]
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
        if message.name:
            out["name"] = message.name
    return out


def _role(message: BaseMessage, index: int) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    for kind, role in _ROLES.items():
        if isinstance(message, kind):
            return role
    raise ValueError(
        f"messages[{index}] is a {type(message).__name__}; ChatKVBoost takes system, human, "
        "AI, tool and generic chat messages"
    )


def _text(message: BaseMessage, index: int, calls: Sequence[ToolCall]) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if isinstance(block, str):
            parts.append(block)
        elif kind == "text":
            parts.append(str(block.get("text", "")))  # type: ignore[union-attr]
        elif not (calls and kind in _CALL_BLOCKS):  # those are rendered from tool_calls
            raise ValueError(
                f"messages[{index}] has a {kind!r} content block; only text is supported"
            )
    return "".join(parts)


def ai_message(result: GenerationResult, stats: dict[str, Any]) -> AIMessage:
    """The answer: content, tool calls, usage, and ``stats`` as response metadata."""
    return AIMessage(
        content=result.text,
        tool_calls=tool_calls(result),
        invalid_tool_calls=invalid_tool_calls(result),
        usage_metadata=usage(result),
        response_metadata=stats,
    )


def tool_calls(result: GenerationResult) -> list[ToolCall]:
    return [tool_call(name=c.name, args=c.arguments, id=c.id) for c in result.tool_calls]


def invalid_tool_calls(result: GenerationResult) -> list[InvalidToolCall]:
    return [
        invalid_tool_call(name=c.name, args=c.arguments, id=c.id, error=c.error)
        for c in result.invalid_tool_calls
    ]


def tool_call_chunks(result: GenerationResult) -> list[ToolCallChunk]:
    """The calls as stream chunks; summed, they give ``tool_calls(result)`` again.

    LangChain re-parses chunk arguments when it sums chunks, and completes a truncated JSON
    object. So an unreadable call's raw text goes as a JSON string, which stays an invalid
    call (with that string as its ``args``) instead of becoming a valid-looking one.
    """
    valid = [(c.name, json.dumps(c.arguments), c.id) for c in result.tool_calls]
    invalid = [(c.name, json.dumps(c.arguments or ""), c.id) for c in result.invalid_tool_calls]
    return [
        tool_call_chunk(name=name, args=args, id=id_, index=i)
        for i, (name, args, id_) in enumerate(valid + invalid)
    ]


def usage(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(  # type: ignore[typeddict-item]  # no output details to report
        input_tokens=result.prompt_tokens,
        output_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
        input_token_details={"cache_read": result.reused_tokens},
    )
