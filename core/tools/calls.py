"""Tool calls read from a model's output: the records a parse yields, and the reading of
one JSON body into calls or into what went wrong (never an exception)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class InvalidToolCall:
    """Output that looked like a call but could not be read as one."""

    name: str | None
    arguments: str | None  # the raw argument text, when there was one
    error: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside tool calls
    calls: list[ToolCall]
    invalid: list[InvalidToolCall]


def read_calls(
    body: str, names: Sequence[str], calls: list[ToolCall], invalid: list[InvalidToolCall]
) -> None:
    """The call(s) in one JSON body, appended to ``calls``, or what went wrong to ``invalid``."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as error:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        invalid.append(
            InvalidToolCall(name and name.group(1), body, f"tool call is not valid JSON: {error}")
        )
        return
    for item in value if isinstance(value, list) else [value]:
        read_call(item, names, calls, invalid)


def read_call(
    item: Any, names: Sequence[str], calls: list[ToolCall], invalid: list[InvalidToolCall]
) -> None:
    raw = json.dumps(item)
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        invalid.append(InvalidToolCall(None, raw, "tool call has no string 'name'"))
        return
    name = item["name"]
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        invalid.append(InvalidToolCall(name, raw, "tool call arguments are not a JSON object"))
    elif names and name not in names:
        invalid.append(InvalidToolCall(name, json.dumps(args), f"no tool named {name!r}"))
    else:
        calls.append(ToolCall(name, args))


def unfenced(text: str) -> str:
    match = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.S)
    return match.group(1) if match else text


def call_key(name: str, arguments: Mapping[str, Any]) -> str:
    """A call as one string: equal for calls the guard counts as the same."""
    return json.dumps([name, _canonical(dict(arguments))], sort_keys=True)


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return value
