"""The tool benchmark's tools and tasks: three tools (arithmetic, a lookup only the tool can
answer, the weather) and three kinds of task, six or more of each: one call; two calls in
sequence, the second's arguments read from the first's result; and one call whose
arguments come from a retrieved passage sent with the question. What a right call and a
right final answer are."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SYSTEM = "You are a helpful assistant. Use a tool when one can answer. Answer briefly."
# Made up, so the model cannot answer from what it knows.
ORDERS = {  # each names a city, for the tasks that ask the weather there next
    "A17": "shipped to Oslo, arriving on Tuesday",
    "B42": "delayed, now arriving in Cairo on March 9",
    "C08": "delivered to the front desk of the Paris office",
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
    # "Oslo, Norway" as weather services take it: the city before the comma
    return WEATHER.get(city.split(",")[0].strip().title(), f"no weather for {city!r}")


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


Call = tuple[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ToolTask:
    question: str
    tool: str  # the tool a right answer calls first
    arguments: Mapping[str, Any]  # its right arguments
    answers: tuple[str, ...]  # a right final answer holds one of these (any case)
    then: tuple[Call, ...] = ()  # the calls after it, in order
    passages: tuple[str, ...] = ()  # retrieved text sent before the question

    @property
    def kind(self) -> str:
        return "call + passage" if self.passages else "two calls" if self.then else "one call"

    @property
    def prompt(self) -> str:
        """The user's message: the passages as a RAG chain sends them, then the question."""
        if not self.passages:
            return self.question
        context = "\n\n".join(self.passages)
        return f"Context:\n{context}\n\nQuestion: {self.question}"

    def right_call(self, name: str, arguments: Mapping[str, Any]) -> bool:
        if name != self.tool:
            return False
        if name == "multiply" and set(arguments) == {"a", "b"}:  # 19 x 23 is 23 x 19
            swapped = {"a": arguments["b"], "b": arguments["a"]}
            return _same(arguments, self.arguments) or _same(swapped, self.arguments)
        return _same(arguments, self.arguments)

    def right_answer(self, text: str) -> bool:
        """Holds one of the answers, and is not a question ("Is it snowing in Oslo
        today?", the 1.5B's answer to "Is it cold in Oslo today?", holds "snow")."""
        if text.rstrip().endswith("?"):
            return False
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
    ToolTask(
        "Where was order C08 delivered?", "order_status", {"order_id": "C08"}, ("front desk",)
    ),
    ToolTask("How hot is it in Cairo?", "get_weather", {"city": "Cairo"}, ("31",)),
)


def _weather_after(order: str, city: str) -> dict[str, Any]:
    return {
        "tool": "order_status",
        "arguments": {"order_id": order},
        "then": (("get_weather", {"city": city}),),
    }


def _product(a: float, b: float, c: float) -> dict[str, Any]:
    return {
        "tool": "multiply",
        "arguments": {"a": a, "b": b},
        "then": (("multiply", {"a": a * b, "b": c}),),
    }


# The second call's arguments are in the first one's result (the weather where an order
# goes), or the first one's result itself (a product of three numbers, asked in two steps).
TWO_CALL_TASKS: Sequence[ToolTask] = (
    ToolTask(
        "What's the weather where order A17 is going?",
        answers=("-3", "snow"),
        **_weather_after("A17", "Oslo"),
    ),
    ToolTask(
        "Multiply 12 by 7, then multiply the result by 3.", answers=("252",), **_product(12, 7, 3)
    ),
    ToolTask(
        "How warm is it in the city order B42 is going to?",
        answers=("31",),
        **_weather_after("B42", "Cairo"),
    ),
    ToolTask(
        "Multiply 23 by 19, then multiply that by 2.", answers=("874",), **_product(23, 19, 2)
    ),
    ToolTask(
        "What's the weather at the office where order C08 was delivered?",
        answers=("18",),
        **_weather_after("C08", "Paris"),
    ),
    ToolTask("What is 1.5 times 40, multiplied by 7?", answers=("420",), **_product(1.5, 40, 7)),
)

# What the question needs from the passage: an order id, a city, a number. Each task sends
# its passage and the next task's, as a retriever would (the right one first).
_FACTS: tuple[tuple[str, str, str, dict[str, Any], tuple[str, ...]], ...] = (
    (
        "Maria Lopez placed order B42 on March 1 for a standing desk.",
        "When will Maria Lopez's order arrive?",
        "order_status",
        {"order_id": "B42"},
        ("march 9",),
    ),
    (
        "Nordwind Ltd. has its head office in Oslo, Norway.",
        "What is the weather at Nordwind's head office?",
        "get_weather",
        {"city": "Oslo"},
        ("-3", "snow"),
    ),
    (
        "A Contoso desk lamp costs 23 dollars.",
        "How much do 19 Contoso desk lamps cost?",
        "multiply",
        {"a": 23, "b": 19},
        ("437",),
    ),
    (
        "Jonas Berg ordered a bicycle; his order id is A17.",
        "When does Jonas Berg's order arrive?",
        "order_status",
        {"order_id": "A17"},
        ("tuesday",),
    ),
    (
        "The 2027 sales meeting will be held in Cairo.",
        "How warm is it where the sales meeting is held?",
        "get_weather",
        {"city": "Cairo"},
        ("31",),
    ),
    (
        "Each crate holds 12 bottles.",
        "How many bottles are in 7 crates?",
        "multiply",
        {"a": 12, "b": 7},
        ("84",),
    ),
)
PASSAGE_TASKS: Sequence[ToolTask] = tuple(
    ToolTask(
        question, tool, arguments, answers, passages=(passage, _FACTS[(i + 1) % len(_FACTS)][0])
    )
    for i, (passage, question, tool, arguments, answers) in enumerate(_FACTS)
)
KINDS: dict[str, Sequence[ToolTask]] = {
    "one call": TASKS,
    "two calls": TWO_CALL_TASKS,
    "call + passage": PASSAGE_TASKS,
}
