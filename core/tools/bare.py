"""Calls written without the format's tags: a JSON object (or a list of them) as the whole
answer, or in a ```` ```json ```` fence, as small models write them. Measured on
Qwen2.5-Coder-0.5B-Instruct with three tools and ``tool_choice="auto"``: four answers of
four were bare or fenced JSON, none used the template's ``<tool_call>`` tags.

JSON is a call only when it has a call's shape: a string ``name`` and no keys but
``name``, ``arguments`` and ``parameters``, naming an offered tool or holding arguments (a
misspelt tool then comes back as an invalid call, not as text). Any other JSON answer,
``{"name": "Lima"}`` included, stays content.

A fenced block holds calls when all of it is calls, one after another (one a line, as
Qwen2.5-Coder-0.5B fenced three under LangChain's agent: the block came back as text).

Such a call escaped the grammar (it was free text), so its arguments are fitted to the
tool's schema as the grammar would have written them (``fitted``): a string spelling a
number where a number is declared becomes that number, "true" / "false" a boolean, where
that loses nothing; a key the schema does not declare is dropped where the schema does not
allow others (the grammar's ``strict_schema`` refuses it). Qwen2.5-Coder-0.5B wrote
``{"a": "12", "b": "7"}`` for ``multiply(a: float, b: float)`` under LlamaIndex's
``FunctionAgent``, and the tool failed on strings; under LangChain's agent it copied the
schema's ``"type": "object"`` into each call's arguments.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvboost_rag.core.tools.calls import InvalidToolCall, Parsed, ToolCall, read_calls

CALL_KEYS = frozenset({"name", "arguments", "parameters"})
ARGUMENT_KEYS = ("arguments", "parameters")
# A fenced block, "json" or no language, to its closing fence or the end of the answer.
FENCE = re.compile(r"```[ \t]*(?:json)?[ \t]*\n(.*?)(?:```|\Z)", re.S)
# What an unclosed fence holds while it may still be a JSON block: a prefix of "json",
# then a newline and nothing or JSON.
OPENING = re.compile(r"[ \t]*(?:j(?:s(?:on?)?)?)?[ \t]*(?:\n\s*(?:[{\[].*)?)?", re.S)
_DECODER = json.JSONDecoder()


def bare_calls(text: str, names: Sequence[str]) -> Parsed | None:
    """The calls ``text`` writes as bare or fenced JSON, with the text around them as
    content; None when it holds none."""
    return _leading_calls(text, names) or _fenced_calls(text, names)


def fitted(calls: Sequence[ToolCall], schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall]:
    """``calls`` with each argument in the type its tool's parameter schema
    (``schemas[name]``) declares, where a string spells it exactly, and without keys an
    object's schema neither declares nor allows; others unchanged."""
    out = []
    for call in calls:
        arguments = _fitted(call.arguments, schemas.get(call.name) or {})
        out.append(call if arguments == call.arguments else replace(call, arguments=arguments))
    return out


INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")


def _fitted(value: Any, schema: Mapping[str, Any]) -> Any:
    declared = schema.get("type")
    types = set(declared) if isinstance(declared, list) else {declared}
    if isinstance(value, dict):
        properties = schema.get("properties")
        if not isinstance(properties, Mapping):
            return {k: _fitted(v, {}) for k, v in value.items()}
        # strict_schema's rule: an object that does not say allows no other keys
        others = schema.get("additionalProperties", False) is not False
        kept = {k: v for k, v in value.items() if k in properties or others}
        return {k: _fitted(v, properties.get(k) or {}) for k, v in kept.items()}
    if isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [_fitted(v, schema["items"]) for v in value]
    if not isinstance(value, str) or "string" in types:
        return value
    text = value.strip()
    if types & {"integer", "number"} and INTEGER.fullmatch(text):
        return int(text)
    if "number" in types and NUMBER.fullmatch(text):
        return float(text)
    if "boolean" in types and text in ("true", "false"):
        return text == "true"
    return value


def _leading_calls(text: str, names: Sequence[str]) -> Parsed | None:
    """Calls opening the answer; one call a line is several calls."""
    parsed = _calls_ahead(text.strip(), names)
    return parsed if parsed.calls or parsed.invalid else None


def _calls_ahead(text: str, names: Sequence[str]) -> Parsed:
    """The calls ``text`` opens with, one after another, and the text after them."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    rest = text
    while rest.startswith(("{", "[")):
        end = _call_end(rest, names, cut=bool(calls or invalid))
        if end is None:
            break
        read_calls(rest[:end], names, calls, invalid)
        rest = rest[end:].strip()
    return Parsed(rest, calls, invalid)


def _fenced_calls(text: str, names: Sequence[str]) -> Parsed | None:
    """Calls in fenced blocks anywhere in the answer, a block holding only calls; the
    other blocks stay content."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    content: list[str] = []
    last = 0
    for match in FENCE.finditer(text):
        block = _calls_ahead(match.group(1).strip(), names)
        if (block.calls or block.invalid) and not block.content:
            content.append(text[last : match.start()])
            last = match.end()
            calls += block.calls
            invalid += block.invalid
    if not calls and not invalid:
        return None
    content.append(text[last:])
    return Parsed("".join(content).strip(), calls, invalid)


def bare_start(text: str, names: Sequence[str]) -> int:
    """Where in a growing answer a bare or fenced call may be being written (``len(text)``
    where none may): what streams as content stops there."""
    stripped = text.lstrip()
    lead = len(text) - len(stripped)
    if stripped.startswith(("{", "[")):
        try:
            value, end = _DECODER.raw_decode(stripped)
        except json.JSONDecodeError:
            return lead  # not whole yet
        if _is_call(value, names):
            return lead
    return _fence_start(text, names)


def _fence_start(text: str, names: Sequence[str]) -> int:
    at = 0
    while (start := text.find("```", at)) >= 0:
        close = text.find("```", start + 3)
        if close < 0:  # still open: held while it may be a JSON block
            return start if OPENING.fullmatch(text[start + 3 :]) else len(text)
        block = FENCE.fullmatch(text[start : close + 3])
        if block and _call_end(block.group(1).strip(), names) is not None:
            return start
        at = close + 3
    return len(text.rstrip("`"))  # a "`" or "``" at the end may open a fence


def _call_end(body: str, names: Sequence[str], cut: bool = False) -> int | None:
    """Where the call JSON opening ``body`` ends; None when ``body`` does not open with a
    call. JSON that does not parse counts as a call, to the end of ``body``, when it names
    an offered tool or holds arguments, or follows calls (``cut``): it is then reported,
    not dropped."""
    try:
        value, end = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        holds = re.search(r'"(?:arguments|parameters)"\s*:', body)
        called = cut or name and (name.group(1) in names or holds)
        return len(body) if called else None
    return end if _is_call(value, names) else None


def _is_call(value: Any, names: Sequence[str]) -> bool:
    items = value if isinstance(value, list) and value else [value]
    return all(
        isinstance(item, dict)
        and isinstance(item.get("name"), str)
        and set(item) <= CALL_KEYS
        and (item["name"] in names or any(key in item for key in ARGUMENT_KEYS))
        for item in items
    )
