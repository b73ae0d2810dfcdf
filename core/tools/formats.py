"""Tool calls in and out of text: the formats models are trained on, parsed without crashing.

A format knows how a call looks in the model's output (``render``), how to read calls back
(``parse``: malformed ones become ``InvalidToolCall`` entries, never exceptions), what part of
a growing output is plain content that may be streamed (``visible``), and the grammar that
constrains decoding to valid calls (``grammar``, llguidance's Lark dialect). Tools are
OpenAI-style dicts: ``{"type": "function", "function": {"name", "description", "parameters"}}``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvboost_rag.core.choices import TOOL_FORMATS
from kvboost_rag.core.tools.calls import (
    InvalidToolCall,
    Parsed,
    ToolCall,
    read_calls,
    unfenced,
)

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # its stubs' type; not a runtime name

Tool = Mapping[str, Any]
# The id of the tokenizer's special token spelled ``text``, or None where it has none.
SpecialToken = Callable[[str], int | None]


def no_special(text: str) -> None:
    """A tokenizer with no special token for any tag: tags are matched as text."""
    return None


# JSON exactly as ``json.dumps`` writes it, so a constrained call re-renders token for token
# (the next agent step's prompt then extends this one's cache).
CANONICAL_JSON: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


def tool_name(tool: Tool) -> str:
    return str(function_of(tool)["name"])


def function_of(tool: Tool) -> Mapping[str, Any]:
    """The ``function`` part of an OpenAI-style tool; ``ValueError`` when it has none."""
    function = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(
            "a tool must be {'type': 'function', 'function': {'name': str, 'description': str, "
            f"'parameters': JSON schema}}, got {tool!r}"
        )
    return function


# How deep a JSON schema (tool parameters, response_format) may nest, in JSON levels.
# OpenAI's structured outputs take 10 levels of objects (~25 JSON levels); the engine walks
# a schema recursively, and one nested ~400 levels exhausts Python's recursion limit.
MAX_SCHEMA_DEPTH = 64
# Where a tool's ``$ref`` may point: a call nests the parameters inside a schema of its own
# and moves their definitions to its root (``call_schema``), so any other pointer ("#"
# itself, "#/properties/...") would resolve against the call, not the parameters.
REF_ROOTS = ("#/$defs/", "#/definitions/")


def check_schema(schema: Any, what: str, nested: bool = False) -> None:
    """``ValueError`` naming ``what`` for a schema whose lists and objects nest deeper than
    MAX_SCHEMA_DEPTH (walked without recursion: a deep one is what recursion cannot walk);
    ``nested`` (a tool's parameters): also for a ``$ref`` outside ``REF_ROOTS``."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            ref = value.get("$ref")
            if nested and ref is not None and not str(ref).startswith(REF_ROOTS):
                raise ValueError(
                    f"{what}: $ref {ref!r} points inside the parameters, which a call nests in "
                    "a schema of its own; move the shared part to $defs and point at "
                    "'#/$defs/<name>'"
                )
            value = list(value.values())
        if isinstance(value, list):
            if depth > MAX_SCHEMA_DEPTH:
                raise ValueError(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels of JSON")
            stack.extend((child, depth + 1) for child in value)


def parameters_of(tool: Tool) -> dict[str, Any]:
    params = function_of(tool).get("parameters") or {"type": "object", "properties": {}}
    return dict(params)


class ToolFormat:
    """Hermes / Qwen: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, any
    number of them, after optional text. A tag may also hold a JSON list of calls."""

    name = "hermes"
    arguments_key = "arguments"
    open, close = "<tool_call>\n", "\n</tool_call>"
    trigger = "<tool_call>"

    def render(self, call: ToolCall) -> str:
        body = json.dumps({"name": call.name, self.arguments_key: call.arguments})
        return f"{self.open}{body}{self.close}"

    def visible(self, text: str) -> str:
        """The part of a growing output that is surely content: before any call, holding
        back a tail that may start one."""
        cut = text.find(self.trigger)
        if cut >= 0:
            return text[:cut]
        for n in range(min(len(self.trigger) - 1, len(text)), 0, -1):
            if text.endswith(self.trigger[:n]):
                return text[:-n]
        return text

    def parse(self, text: str, names: Sequence[str]) -> Parsed:
        if self.trigger not in text:
            return Parsed(text, [], [])
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        content: list[str] = []
        pattern = re.compile(re.escape(self.trigger) + r"(.*?)(?:</tool_call>|\Z)", re.S)
        last = 0
        for match in pattern.finditer(text):
            content.append(text[last : match.start()])
            last = match.end()
            read_calls(match.group(1).strip(), names, calls, invalid)
        content.append(text[last:])
        return Parsed("".join(content).strip(), calls, invalid)

    def grammar(
        self,
        tools: Sequence[Tool],
        required: bool,
        parallel: bool = False,
        special: SpecialToken = no_special,
    ) -> str:
        """Calls of ``tools`` only. ``required``: calls and nothing else; else free text
        that may turn into a call where the model writes the opening tag. Without
        ``parallel`` the answer ends after one call. ``special`` finds the tags among the
        tokenizer's special tokens: Qwen writes ``<tool_call>`` as token 151657, which no
        text literal matches, so where the tag is a token the grammar takes that token."""
        call = json.dumps(call_schema(tools, self.arguments_key))
        opening, closing = (_tag(text, special) for text in ("<tool_call>", "</tool_call>"))
        body = f'"\\n" %json {call} "\\n" {closing}'
        if required:
            calls = 'call ("\\n" call)*' if parallel else "call"
            return f"%llguidance {{}}\nstart: {calls}\ncall: {opening} {body}\n"
        if opening.startswith("<["):  # a special token ends the free text by itself
            trigger, lazy = f"TEXT? {opening}", ""
        else:  # a lazy lexeme: the text path ends where the model writes the tag
            trigger, lazy = "trig", f"trig[lazy]: TEXT {opening}\n"
        return (
            "%llguidance {}\n"
            f"start: {'(call)* TEXT' if parallel else 'call | TEXT'}\n"
            f"TEXT: /(.|\\n)*/\n{lazy}"
            f"call: {trigger} {body}\n"
        )


def _tag(text: str, special: SpecialToken) -> str:
    """A tag as a grammar item: its special token where the tokenizer has one, else text."""
    token = special(text)
    return json.dumps(text) if token is None else f"<[{token}]>"


class JsonFormat(ToolFormat):
    """The whole answer is a call: ``{"name": ..., "arguments": {...}}`` (or a list)."""

    name = "json"
    trigger = "{"

    def render(self, call: ToolCall) -> str:
        return json.dumps({"name": call.name, self.arguments_key: call.arguments})

    def visible(self, text: str) -> str:
        stripped = text.lstrip()
        return "" if not stripped or stripped[0] in "{[<" else text

    def parse(self, text: str, names: Sequence[str]) -> Parsed:
        body = unfenced(text.strip()).removeprefix("<|python_tag|>").strip()
        if not body.startswith(("{", "[")):
            return Parsed(text, [], [])
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        read_calls(body, names, calls, invalid)
        return Parsed("", calls, invalid)

    def grammar(
        self,
        tools: Sequence[Tool],
        required: bool,
        parallel: bool = False,
        special: SpecialToken = no_special,
    ) -> str:
        """One call (a JSON list of them when ``parallel``), or free text not opening
        with "{" unless ``required``. No tags, so no special tokens."""
        one = call_schema(tools, self.arguments_key)
        call = json.dumps(
            {"type": "array", "items": one, "minItems": 1, "x-guidance": one["x-guidance"]}
            if parallel
            else one
        )
        if required:
            return f"%llguidance {{}}\nstart: %json {call}\n"
        # Text that does not open with "{" stays free; "{" commits to a call.
        return (
            '%llguidance {}\nstart: call | TEXT | ""\n'
            f"call: %json {call}\n"
            "TEXT: /[^{](.|\\n)*/\n"
        )


class Llama3Format(JsonFormat):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``."""

    name = "llama3"
    arguments_key = "parameters"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (ToolFormat(), JsonFormat(), Llama3Format())}
assert tuple(FORMATS) == TOOL_FORMATS  # the names config checks ``tool_format`` against


def format_for(template: str | None, override: str = "auto") -> ToolFormat:
    """The tool-call format a chat template's model was trained on (``override`` names
    one of ``FORMATS`` instead). A template without tool support gets Hermes tags, which
    the fallback rendering teaches in the system message."""
    if override != "auto":
        if override not in FORMATS:
            raise ValueError(
                f"tool_format must be 'auto' or one of {sorted(FORMATS)}, got {override!r}"
            )
        return FORMATS[override]
    source = template or ""
    if "<tool_call>" in source:
        return FORMATS["hermes"]
    if "<|python_tag|>" in source or "parameters" in source and "tools" in source:
        return FORMATS["llama3"]
    if "tools" in source:
        return FORMATS["json"]
    return FORMATS["hermes"]


def call_schema(tools: Sequence[Tool], arguments_key: str) -> dict[str, Any]:
    """One call of any of ``tools``, as a JSON schema; canonical JSON for llguidance. The
    arguments are the declared ones only (``strict_schema``). Each tool's ``$defs`` move
    to the root, where its ``#/$defs/...`` references point once it is nested."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    options = []
    for t in tools:
        params = strict_schema(parameters_of(t))
        for where, found in defs.items():
            for name, schema in params.pop(where, {}).items():
                if found.setdefault(name, schema) != schema:
                    raise ValueError(f"tools define {where}/{name} differently; rename one")
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool_name(t)}, arguments_key: params},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    refs = {where: found for where, found in defs.items() if found}
    return {**schema, **refs, "x-guidance": {**CANONICAL_JSON, "lenient": True}}


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that does not say
    (OpenAI's strict structured outputs): a small model otherwise invents keys until it
    runs out of tokens."""
    if isinstance(schema, list):
        return [strict_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: strict_schema(value) for key, value in schema.items()}
    properties = schema.get("properties")
    # The property names themselves are not schemas. Properties that are not an object are
    # left for llguidance to refuse, with its message.
    if isinstance(properties, dict):
        strict["properties"] = {k: strict_schema(v) for k, v in properties.items()}
        strict.setdefault("additionalProperties", False)
    return strict
