"""LlamaIndex chat messages to the engine's message dicts and back.

An answer's text is a ``TextBlock`` and each tool call a ``ToolCallBlock``: what
``FunctionAgent`` reads through ``get_tool_calls_from_response`` and sends back in the next
step's history, where the call is rendered exactly as the model wrote it (so that step's
prompt extends this one's cached KV).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection

from kvboost_rag.core.results import GenerationResult
from kvboost_rag.core.tools.formats import ToolCall


def engine_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """``messages`` as ``KVBoost.chat`` takes them: role and text, an assistant's tool
    calls, a tool result's ``tool_call_id`` / ``name`` (from ``additional_kwargs``).
    ``ValueError`` for what the engine cannot read (images, audio, documents)."""
    return [_engine_message(message, i) for i, message in enumerate(messages)]


def response_message(result: GenerationResult) -> ChatMessage:
    """The engine's answer as an assistant message: its text, and its calls as
    ``ToolCallBlock``s. For LlamaIndex code that reads calls from
    ``additional_kwargs["tool_calls"]`` (streamed structured outputs, chat engines), they
    are also there as OpenAI-style dicts, as LlamaIndex's OpenAI LLM puts them. Output that
    looked like a call but could not be read is in ``additional_kwargs["invalid_tool_calls"]``."""
    blocks = [
        ToolCallBlock(tool_call_id=call.id, tool_name=call.name, tool_kwargs=call.arguments)
        for call in result.tool_calls
    ]
    extra: dict[str, Any] = {}
    if result.tool_calls:
        extra["tool_calls"] = [_openai_call(call) for call in result.tool_calls]
    if result.invalid_tool_calls:
        extra["invalid_tool_calls"] = [asdict(call) for call in result.invalid_tool_calls]
    return ChatMessage(
        role=MessageRole.ASSISTANT,
        blocks=[TextBlock(text=result.text), *blocks],
        additional_kwargs=extra,
    )


def first_call_only(message: ChatMessage) -> ChatMessage:
    """``message`` with its first tool call alone (blocks and ``additional_kwargs``)."""
    calls = [i for i, block in enumerate(message.blocks) if isinstance(block, ToolCallBlock)]
    blocks = [block for i, block in enumerate(message.blocks) if i not in calls[1:]]
    extra = dict(message.additional_kwargs)
    if extra.get("tool_calls"):
        extra["tool_calls"] = extra["tool_calls"][:1]
    return message.model_copy(update={"blocks": blocks, "additional_kwargs": extra})


def tool_selections(message: ChatMessage) -> list[ToolSelection]:
    """The tool calls in a message's ``ToolCallBlock``s, as LlamaIndex selections."""
    return [
        ToolSelection(
            tool_id=block.tool_call_id or "",
            tool_name=block.tool_name,
            tool_kwargs=_arguments(block),
        )
        for block in message.blocks
        if isinstance(block, ToolCallBlock)
    ]


def _openai_call(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": json.dumps(call.arguments)}
    return {"id": call.id, "type": "function", "function": function}


def _engine_message(message: ChatMessage, index: int) -> dict[str, Any]:
    _check_blocks(message, index)
    out: dict[str, Any] = {"role": message.role.value, "content": message.content or ""}
    if message.role == MessageRole.ASSISTANT:
        calls = _assistant_calls(message, index)
        if calls:
            out["tool_calls"] = calls
    if message.role == MessageRole.TOOL:
        extra = message.additional_kwargs
        out.update({k: str(extra[k]) for k in ("tool_call_id", "name") if extra.get(k)})
    return out


def _check_blocks(message: ChatMessage, index: int) -> None:
    allowed: tuple[type, ...] = (TextBlock,)
    if message.role == MessageRole.ASSISTANT:
        allowed = (TextBlock, ToolCallBlock)
    for block in message.blocks:
        if not isinstance(block, allowed):
            raise ValueError(
                f"messages[{index}] ({message.role.value}) has a {type(block).__name__}: "
                "KVBoostLLM reads text, and tool calls in assistant messages"
            )


def _assistant_calls(message: ChatMessage, index: int) -> list[dict[str, Any]]:
    """Calls from ``ToolCallBlock``s, or else from ``additional_kwargs["tool_calls"]``
    (OpenAI-style dicts or objects, as older histories hold them)."""
    blocks = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if blocks:
        return [
            {"id": b.tool_call_id, "name": b.tool_name, "arguments": _arguments(b, index)}
            for b in blocks
        ]
    listed = message.additional_kwargs.get("tool_calls") or []
    return [_plain_call(call, index) for call in listed]


def _plain_call(call: Any, index: int) -> dict[str, Any]:
    plain = call.model_dump() if callable(getattr(call, "model_dump", None)) else call
    if not isinstance(plain, Mapping):
        raise ValueError(
            f"messages[{index}]: additional_kwargs['tool_calls'] holds a "
            f"{type(call).__name__}; give OpenAI-style dicts or ToolCallBlock blocks"
        )
    return dict(plain)


def _arguments(block: ToolCallBlock, index: int | None = None) -> dict[str, Any]:
    kwargs: Any = block.tool_kwargs
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs) if kwargs.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(kwargs, dict):
        where = f"messages[{index}]: " if index is not None else ""
        raise ValueError(
            f"{where}tool call {block.tool_name!r} has arguments that are not a JSON "
            f"object: {block.tool_kwargs!r}"
        )
    return kwargs
