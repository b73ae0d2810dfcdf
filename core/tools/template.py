"""Chat messages with tools through the tokenizer's chat template, or a documented fallback.

A template that renders ``tools=`` gets them there; one that does not (SmolLM2's, Llama 2's)
gets them in the system message, with the format's instructions. Assistant ``tool_calls``
and ``tool`` results are passed to templates that render them, else written as text in the
format the model is asked to use: calls as the format writes them, results in
``<tool_response>`` tags of a user turn. Calls this engine returned are written back as the
model wrote them (``written.py``). Rendering is deterministic, so each agent step's
prompt extends the previous one token for token and its KV is read from the cache.

With ``notes`` (``KVBoostConfig.tool_result_notes``) and tools offered, a result in the
Hermes format is written that way whatever the template does, as a sentence naming the call
and its answer, followed by what to do next (``noted_result``). Qwen2.5-Coder's own
rendering (the bare ``<tool_response>`` turn) left both sizes unable to use a result:
after ``multiply(17, 23)`` returned 391, the 1.5B answered "I cannot generate a response
based on the provided XML structure" and the 0.5B called the tool again. A note after the
bare result ("This is the result of ...") fixed the 1.5B, but the 0.5B copied the note as
its answer (2 of 9 right at an agent's second step); the result inside a sentence ("The
tool multiply(...) answered: 391") is what it copies now, and it answers 9 of 9, the 1.5B
8 of 9 either way (issue 61's probes; ``benchmarks.tools`` measures agents).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost_rag.core.tools.formats import Tool, ToolCall, ToolFormat, check_schema, function_of
from kvboost_rag.core.tools.written import WrittenCalls

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)
# A tool's result as a sentence naming its call, then what to do with it.
RESULT_TURN = "<tool_response>\nThe tool {call} answered: {content}\n</tool_response>\n{next}"
NEXT_STEP = "Now answer the question in a sentence, or call the next tool it needs."
JSON_INSTRUCTIONS = (
    "# Tools\n\nYou may call one of these functions to assist with the user query:\n"
    "{tools}\n\nTo call one, answer with only a JSON object: "
    '{{"name": <function-name>, "{key}": <args-json-object>}}'
)


@dataclass(frozen=True)
class TemplateSupport:
    """What a chat template renders itself, read from its source."""

    tools: bool
    tool_calls: bool
    tool_role: bool

    @classmethod
    def of(cls, template: str | None) -> TemplateSupport:
        source = template or ""
        return cls(
            tools="tools" in source,
            tool_calls="tool_calls" in source,
            tool_role="'tool'" in source or '"tool"' in source,
        )


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Tool],
    fmt: ToolFormat,
    notes: bool = False,
    written: WrittenCalls | None = None,
) -> str:
    """The prompt text for ``messages`` (and ``tools``), generation prompt included;
    ``notes``: tool results as ``noted_result`` writes them where tools are offered, in the
    Hermes format; ``written``: an assistant turn whose calls it holds, as they were
    written."""
    support = TemplateSupport.of(getattr(tokenizer, "chat_template", None))
    # A request that offers no tools asks for the answer: no note (SmolLM2-135M copied it)
    made = _calls_made(messages) if notes and tools and fmt.name == "hermes" else None
    dicts = [_message(m, support, fmt, made, written) for m in messages]
    kwargs: dict[str, Any] = {}
    if tools and support.tools:
        kwargs["tools"] = [dict(t) for t in tools]
    elif tools:
        dicts = _with_system(dicts, instructions(tools, fmt))
    return tokenizer.apply_chat_template(
        dicts, tokenize=False, add_generation_prompt=True, **kwargs
    )


def instructions(tools: Sequence[Tool], fmt: ToolFormat) -> str:
    """The fallback system text that presents ``tools`` and the format to call them in."""
    listed = "\n".join(json.dumps(dict(t)) for t in tools)
    if fmt.name == "hermes":
        return FALLBACK_INSTRUCTIONS.format(tools=listed)
    return JSON_INSTRUCTIONS.format(tools=listed, key=fmt.arguments_key)


def _with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _calls_made(messages: Sequence[Mapping[str, Any]]) -> dict[str | None, str]:
    """Each assistant call as ``name({arguments})``, by its id; under None, the latest."""
    made: dict[str | None, str] = {}
    for message in messages:
        if message.get("role") == "assistant":
            for raw in message.get("tool_calls") or []:
                call = as_call(raw)
                made[call.id] = made[None] = f"{call.name}({json.dumps(call.arguments)})"
    return made


def _message(
    message: Mapping[str, Any],
    support: TemplateSupport,
    fmt: ToolFormat,
    made: dict[str | None, str] | None = None,
    written: WrittenCalls | None = None,
) -> dict:
    role = message["role"]
    content = message.get("content") or ""
    if role == "tool" and made is not None:
        call = made.get(message.get("tool_call_id")) or made.get(None, "the tool call")
        return {"role": "user", "content": noted_result(call, content)}
    calls = [as_call(c) for c in message.get("tool_calls") or []]
    if role == "assistant" and calls:
        text = written.text_of(content, calls) if written is not None else None
        if text is not None:
            return {"role": role, "content": text}
        if support.tool_calls:
            return {"role": role, "content": content, "tool_calls": [hf_call(c) for c in calls]}
        rendered = "\n".join(fmt.render(c) for c in calls)
        return {"role": role, "content": f"{content}\n{rendered}" if content else rendered}
    if role == "tool" and not support.tool_role:
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    extra = {k: message[k] for k in ("name", "tool_call_id") if k in message and role == "tool"}
    return {"role": role, "content": content, **extra}


def noted_result(call: str, content: str) -> str:
    """The user turn that carries a tool's result, ``call`` written as ``name({arguments})``."""
    return RESULT_TURN.format(call=call, content=content, next=NEXT_STEP)


def as_call(call: Any) -> ToolCall:
    """A ``ToolCall``, or an OpenAI / HF dict (``{"function": {"name", "arguments"}}``), or a
    flat ``{"name", "arguments"|"args", "id"}`` dict, as a ``ToolCall``."""
    if isinstance(call, ToolCall):
        return call
    if not isinstance(call, Mapping):
        raise ValueError(f"a tool call must be a dict or ToolCall, got {call!r}")
    inner = call.get("function", call)
    if not isinstance(inner, Mapping) or not isinstance(inner.get("name"), str):
        raise ValueError(f"a tool call needs a str name and dict arguments, got {call!r}")
    args = inner.get("arguments", inner.get("args", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):  # RecursionError: nested too deep
            raise ValueError(f"a tool call's arguments are not JSON, got {call!r}") from None
    if not isinstance(args, dict):
        raise ValueError(f"a tool call needs a str name and dict arguments, got {call!r}")
    return ToolCall(inner["name"], args, **({"id": call["id"]} if call.get("id") else {}))


def hf_call(call: ToolCall) -> dict[str, Any]:
    """A call as transformers' chat templates take it."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def check_tools(tools: Sequence[Tool]) -> list[str]:
    """The tools' names; ``ValueError`` for a malformed tool, a repeated name or parameters
    the grammar cannot take (``check_schema``)."""
    names = [str(function_of(t)["name"]) for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    for i, tool in enumerate(tools):
        check_schema(function_of(tool).get("parameters"), f"tools[{i}] parameters", nested=True)
    return names
