"""The tool benchmark's tools and tasks: three tools (arithmetic, a lookup only the tool can
answer, the weather), a few questions for each, and what a right call and a right final
answer are."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SYSTEM = "You are a helpful assistant. Use a tool when one can answer. Answer briefly."
# Made up, so the model cannot answer from what it knows.
ORDERS = {
    "A17": "shipped, arriving on Tuesday",
    "B42": "delayed, the new delivery date is March 9",
    "C08": "delivered to the front desk",
}
WEATHER = {"Paris": "18 C, light rain", "Cairo": "31 C, sunny", "Oslo": "-3 C, snowing"}


def multiply(a: float, b: float) -> float:
    """Multiply two numbers."""
    return a * b


def order_status(order_id: str) -> str:
    """The delivery status of an order, by its id (such as A17)."""
    return ORDERS.get(order_id.strip().upper(), f"no order {order_id!r}")


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER.get(city.strip().title(), f"no weather for {city!r}")


FUNCTIONS: tuple[Callable[..., Any], ...] = (multiply, order_status, get_weather)


def _spec(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    params = {"type": "object", "properties": properties, "required": list(properties)}
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": params},
    }


NUMBER, STRING = {"type": "number"}, {"type": "string"}
# The OpenAI dicts the engine routes offer: what LangChain and LlamaIndex make of FUNCTIONS.
SPECS = [
    _spec("multiply", "Multiply two numbers.", {"a": NUMBER, "b": NUMBER}),
    _spec(
        "order_status",
        "The delivery status of an order, by its id (such as A17).",
        {"order_id": STRING},
    ),
    _spec("get_weather", "The current weather in a city.", {"city": STRING}),
]


@dataclass(frozen=True)
class ToolTask:
    question: str
    tool: str  # the tool a right answer calls
    arguments: Mapping[str, Any]  # its right arguments
    answers: tuple[str, ...]  # a right final answer holds one of these (any case)

    def right_call(self, name: str, arguments: Mapping[str, Any]) -> bool:
        return name == self.tool and _same(arguments, self.arguments)

    def right_answer(self, text: str) -> bool:
        return any(answer.lower() in text.lower() for answer in self.answers)


def _same(got: Mapping[str, Any], want: Mapping[str, Any]) -> bool:
    if set(got) != set(want):
        return False
    return all(_value(got[k]) == _value(want[k]) for k in want)


def _value(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value.strip().lower()
    return float(value) if isinstance(value, int | float) else value


# One of each tool in turn, so that --limit 3 asks each tool once.
TASKS: Sequence[ToolTask] = (
    ToolTask("What is 12 times 7?", "multiply", {"a": 12, "b": 7}, ("84",)),
    ToolTask("Where is my order A17?", "order_status", {"order_id": "A17"}, ("tuesday",)),
    ToolTask("What's the weather in Paris right now?", "get_weather", {"city": "Paris"}, ("18",)),
    ToolTask("Multiply 23 by 19.", "multiply", {"a": 23, "b": 19}, ("437",)),
    ToolTask("What is the status of order B42?", "order_status", {"order_id": "B42"}, ("march 9",)),
    ToolTask("Is it cold in Oslo today?", "get_weather", {"city": "Oslo"}, ("-3", "snow")),
    ToolTask("How much is 1.5 times 40?", "multiply", {"a": 1.5, "b": 40}, ("60",)),
    ToolTask("Has order C08 arrived yet?", "order_status", {"order_id": "C08"}, ("front desk",)),
    ToolTask("How hot is it in Cairo?", "get_weather", {"city": "Cairo"}, ("31",)),
)
