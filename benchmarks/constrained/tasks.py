"""The constrained-decoding benchmark's fixed requests and the checks that score them.

Tool tasks: a user question, 2-4 tools offered, ``tool_choice`` "required" or a tool's name.
A call is valid when it names an offered tool (the chosen one, for a named choice) and its
arguments validate against that tool's schema, and nothing failed to parse. JSON tasks ask
for a ``response_format`` JSON schema; valid when the text parses and validates
(``schema_check``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.constrained.schema_check import Schema, schema_errors
from kvboost_rag.core.tools.formats import InvalidToolCall, ToolCall, parameters_of, tool_name


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


INT = {"type": "integer"}
TOOLS = {
    "add": _tool("add", "Add two integers.", {"a": INT, "b": INT}),
    "multiply": _tool("multiply", "Multiply two integers.", {"a": INT, "b": INT}),
    "search_essays": _tool(
        "search_essays",
        "Search Paul Graham's essays; returns the k best passages.",
        {"query": {"type": "string"}, "k": {"type": "integer", "description": "1 to 10"}},
    ),
    "get_weather": _tool(
        "get_weather",
        "Current weather in a city.",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
    ),
    "create_event": _tool(
        "create_event",
        "Put an event in the calendar.",
        {
            "title": {"type": "string"},
            "attendees": {"type": "array", "items": {"type": "string"}, "minItems": 1},
        },
    ),
    "book_table": _tool(
        "book_table",
        "Book a restaurant table.",
        {
            "restaurant": {"type": "string"},
            "party": {
                "type": "object",
                "properties": {"size": INT, "name": {"type": "string"}},
                "required": ["size", "name"],
            },
        },
    ),
}


@dataclass(frozen=True)
class ToolTask:
    question: str
    tools: tuple[str, ...]  # keys of TOOLS
    choice: str = "required"  # or one of ``tools``

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [TOOLS[name] for name in self.tools]

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.question}]

    @property
    def request(self) -> dict[str, Any]:
        """The ``engine.chat`` keywords that ask for this task's answer form."""
        return {"tools": self.specs, "tool_choice": self.choice}

    def errors(
        self,
        text: str,
        calls: Sequence[ToolCall],
        invalid: Sequence[InvalidToolCall],
        unfence: bool = False,  # the engine's call parser already reads fenced JSON
    ) -> list[str]:
        return call_errors(calls, invalid, self.specs, self.choice)


CALC, WEATHER = ("add", "multiply"), ("get_weather", "search_essays")
TOOL_TASKS = (
    ToolTask("What is 17 plus 25?", CALC),
    ToolTask("Multiply 12 by 9.", CALC),
    ToolTask("How much is 340 + 1250?", (*CALC, "get_weather")),
    ToolTask("What is 7 times 8?", (*CALC, "search_essays")),
    ToolTask("I have 3 boxes of 24 eggs. How many eggs is that?", CALC, "multiply"),
    ToolTask("Add 1000 and 2024.", (*CALC, "get_weather", "search_essays"), "add"),
    ToolTask("Find essays about startups and fundraising, top 3.", ("search_essays", "add")),
    ToolTask("What did Paul Graham write about procrastination?", WEATHER),
    ToolTask("Search the essays for 'how to do great work', 5 results.", ("search_essays",)),
    ToolTask(
        "Look up essays on programming languages like Lisp.",
        (*WEATHER, "add"),
        "search_essays",
    ),
    ToolTask("Show me two passages about hiring.", ("search_essays", "multiply", "add")),
    ToolTask("Essays about wealth creation, please.", WEATHER, "search_essays"),
    ToolTask("What's the weather in Paris in celsius?", WEATHER),
    ToolTask("Is it hot in Phoenix right now? Use fahrenheit.", ("get_weather", "add")),
    ToolTask("Weather in Tokyo?", (*WEATHER, "multiply")),
    ToolTask("How cold is it in Oslo, in degrees F?", ("get_weather", "create_event")),
    ToolTask("Tell me the temperature in Cairo.", (*WEATHER, "add", "multiply"), "get_weather"),
    ToolTask("Weather for Berlin in c.", ("get_weather",)),
    ToolTask("Schedule a 'Design review' with Ana and Bo.", ("create_event", "get_weather")),
    ToolTask("Create an event called Standup for Kim, Lee and Max.", ("create_event", "add")),
    ToolTask(
        "Put 'Lunch with Sam' in my calendar, with Sam.",
        ("create_event", "search_essays", "get_weather"),
        "create_event",
    ),
    ToolTask("Book a table for 4 at Chez Panisse under the name Ada.", ("book_table", "add")),
    ToolTask("Reserve Nopa for two people, name Grace.", ("book_table", "get_weather")),
    ToolTask(
        "Get me a table at Zuni for 6, booked as Linus.",
        ("book_table", "create_event", "search_essays"),
        "book_table",
    ),
)


def _obj(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties)}


STR, NUM, BOOL = {"type": "string"}, {"type": "number"}, {"type": "boolean"}


@dataclass(frozen=True)
class JsonTask:
    question: str
    schema: dict[str, Any]

    @property
    def response_format(self) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"schema": self.schema}}

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{self.question} Answer in JSON."}]

    @property
    def request(self) -> dict[str, Any]:
        return {"response_format": self.response_format}

    def errors(
        self,
        text: str,
        calls: Sequence[ToolCall],
        invalid: Sequence[InvalidToolCall],
        unfence: bool = False,
    ) -> list[str]:
        return json_errors(text, self.schema, unfence)


JSON_TASKS = (
    JsonTask("Describe a person named Ada who is 36.", _obj({"name": STR, "age": INT})),
    JsonTask(
        "Classify the sentiment of: 'I love this bakery!'",
        _obj({"sentiment": {"type": "string", "enum": ["positive", "negative", "neutral"]}}),
    ),
    JsonTask("Give a city and its country: Paris.", _obj({"city": STR, "country": STR})),
    JsonTask(
        "List three fruits.",
        _obj({"fruits": {"type": "array", "items": STR, "minItems": 3, "maxItems": 3}}),
    ),
    JsonTask("Is 17 a prime number?", _obj({"number": INT, "is_prime": BOOL})),
    JsonTask(
        "Give a recipe name and its ingredients for pancakes.",
        _obj({"recipe": STR, "ingredients": {"type": "array", "items": STR}}),
    ),
    JsonTask(
        "Where is the Eiffel Tower? Give the name and an address with city and country.",
        _obj({"name": STR, "address": _obj({"city": STR, "country": STR})}),
    ),
    JsonTask("What is the price of a coffee in dollars, roughly?", _obj({"item": STR, "usd": NUM})),
)


Task = ToolTask | JsonTask


def call_errors(
    calls: Sequence[ToolCall],
    invalid: Sequence[InvalidToolCall],
    tools: Sequence[Mapping[str, Any]],
    choice: str = "required",
) -> list[str]:
    """Why an answer is not a valid call of ``tools`` (empty when it is)."""
    if invalid:
        return [f"invalid call: {c.error}" for c in invalid]
    if not calls:
        return ["no tool call"]
    allowed = {tool_name(t): t for t in tools}
    errors = []
    for call in calls:
        if call.name not in allowed or choice not in ("required", call.name):
            errors.append(f"call of {call.name!r}, not an offered/chosen tool")
        else:
            params = parameters_of(allowed[call.name])
            errors += schema_errors(call.arguments, params, f"{call.name}()")
    return errors


def json_errors(text: str, schema: Schema, unfence: bool = False) -> list[str]:
    """Why ``text`` is not a JSON value valid under ``schema`` (empty when it is).
    ``unfence``: read the inside of a Markdown code fence, as lenient clients do."""
    if unfence:
        fenced = re.fullmatch(r"\s*```(?:json)?\s*(.*?)\s*```\s*", text, re.S)
        text = fenced.group(1) if fenced else text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        return [f"not JSON: {error}"]
    return schema_errors(value, schema)
