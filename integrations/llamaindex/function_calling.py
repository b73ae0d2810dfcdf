"""LlamaIndex's function-calling protocol on the engine's tools: ``FunctionCallingLLM``'s
hooks (what ``chat_with_tools``, ``predict_and_call``, ``FunctionAgent`` and
``structured_predict`` call), and LlamaIndex tools and tool choices as the engine's
``tools=`` and ``tool_choice=``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    MessageRole,
)
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools.types import BaseTool

from kvboost_rag.integrations.llamaindex.messages import first_call_only, tool_selections

# The engine's chat options for tools, taken by ``KVBoostLLM.chat`` beside sampling.
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "repeat_guard")


class ToolCalling:
    """``FunctionCallingLLM``'s hooks for an LLM whose ``chat`` takes ``TOOL_OPTIONS``
    and answers with ``ToolCallBlock``s."""

    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: str | Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``chat``'s arguments: the history and ``user_msg``, the tools, the engine's
        ``tool_choice`` ("required" when ``tool_required``)."""
        messages = list(chat_history or [])
        if isinstance(user_msg, str):
            user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
        if user_msg is not None:
            messages.append(user_msg)
        return {
            "messages": messages,
            "tools": list(tools),
            "tool_choice": engine_tool_choice(tool_choice, tool_required),
            "parallel_tool_calls": allow_parallel_tool_calls,
            **kwargs,
        }

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        """One call unless parallel calls were allowed: the grammar ends an answer after
        one, unconstrained decoding (``constrain=False``) may not."""
        if not allow_parallel_tool_calls:
            response.message = first_call_only(response.message)
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        """The calls in the response's ``ToolCallBlock``s; ``ValueError`` when there are
        none and ``error_on_no_tool_call``."""
        selections = tool_selections(response.message)
        if not selections and error_on_no_tool_call:
            raise _no_call_error(response)
        return selections


def _no_call_error(response: ChatResponse) -> ValueError:
    invalid = response.message.additional_kwargs.get("invalid_tool_calls")
    if response.additional_kwargs.get("finish_reason") == "length":
        hint = "the answer reached max_tokens; raise max_tokens"
    else:
        hint = "make the model call one with tool_required=True or tool_choice=<tool name>"
    return ValueError(
        f"the model answered without a tool call: {response.message.content!r}"
        + (f"; unreadable calls: {invalid}" if invalid else "")
        + f". To get one, {hint}"
    )


def tool_specs(tools: Sequence[BaseTool | Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-style tool dicts: a LlamaIndex tool through ``metadata.to_openai_tool()``, a
    dict as given (the engine checks its shape)."""
    specs = []
    for i, tool in enumerate(tools):
        if isinstance(tool, BaseTool):
            specs.append(tool.metadata.to_openai_tool())
        elif isinstance(tool, Mapping):
            specs.append(dict(tool))
        else:
            raise TypeError(
                f"tools[{i}] is a {type(tool).__name__}: pass LlamaIndex tools (FunctionTool, "
                "QueryEngineTool, ...) or OpenAI-style dicts"
            )
    return specs


def engine_tool_choice(choice: str | Mapping[str, Any] | None, required: bool) -> str:
    """The engine's ``tool_choice``: "auto", "required", "none" or a tool's name, from a
    LlamaIndex one (a string, an OpenAI ``{"type": "function", "function": {"name"}}``
    dict, or None) and ``tool_required`` (which turns "auto" into "required")."""
    name = "auto" if choice is None else _choice_name(choice)
    if required and name == "none":
        raise ValueError("tool_required=True contradicts tool_choice='none'")
    return "required" if required and name == "auto" else name


def _choice_name(choice: str | Mapping[str, Any]) -> str:
    if isinstance(choice, str):
        return choice
    function = choice.get("function") if isinstance(choice, Mapping) else None
    if isinstance(function, Mapping) and isinstance(function.get("name"), str):
        return function["name"]
    raise ValueError(
        "tool_choice must be 'auto', 'required', 'none', a tool's name or "
        f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}"
    )
