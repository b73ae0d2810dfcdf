"""The leaderboard's questions as both arms take them, and its own AST checker.

``bfcl-eval`` ships its data and checker in the wheel (``pip install --no-deps
bfcl-eval==2026.3.23``). Its checker imports the leaderboard's model table only to ask
whether a model's names map "." to "_": ``_stub_model_table`` answers that (yes, as its
OpenAI handler does) without importing every API client. Its function docs are not JSON
Schema ("dict", "float", "tuple", "any"): ``json_schema`` converts them, and tool names map
"." to "_" (OpenAI's name rule), for both arms alike.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from importlib import resources
from typing import Any

CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance")
MODEL = "kvboost"  # the name the checker is given; the stub maps its dots
TYPES = {"dict": "object", "float": "number", "tuple": "array", "int": "integer"}


@dataclass(frozen=True)
class Question:
    id: str
    category: str
    messages: list[dict[str, str]]
    functions: list[dict[str, Any]]  # the leaderboard's docs, for its checker
    tools: list[dict[str, Any]]  # OpenAI tools, as both arms offer them
    answer: list[dict[str, Any]] | None  # the possible answers (None for irrelevance)


def json_schema(doc: Any) -> Any:
    """A leaderboard parameter doc as JSON Schema."""
    if isinstance(doc, list):
        return [json_schema(item) for item in doc]
    if not isinstance(doc, dict):
        return doc
    out = {key: json_schema(value) for key, value in doc.items()}
    kind = doc.get("type")
    if kind == "any":
        out.pop("type")
    elif isinstance(kind, str):
        out["type"] = TYPES.get(kind, kind)
    if isinstance(doc.get("properties"), dict):
        out["properties"] = {k: json_schema(v) for k, v in doc["properties"].items()}
    return out


def tool(function: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": function["name"].replace(".", "_"),
            "description": function.get("description", ""),
            "parameters": json_schema(function.get("parameters", {"type": "dict"})),
        },
    }


def load(category: str, limit: int | None) -> list[Question]:
    data = resources.files("bfcl_eval") / "data"
    name = f"BFCL_v4_{category}.json"
    rows = [json.loads(line) for line in (data / name).read_text().splitlines() if line]
    answers: dict[str, Any] = {}
    if category != "irrelevance":
        lines = (data / "possible_answer" / name).read_text().splitlines()
        answers = {row["id"]: row["ground_truth"] for row in map(json.loads, filter(None, lines))}
    return [
        Question(
            row["id"],
            category,
            row["question"][0],
            row["function"],
            [tool(f) for f in row["function"]],
            answers.get(row["id"]),
        )
        for row in rows[:limit]
    ]


def _stub_model_table() -> None:
    if "bfcl_eval.constants.model_config" in sys.modules:
        return
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    stub.MODEL_CONFIG_MAPPING = {MODEL: types.SimpleNamespace(underscore_to_dot=True)}  # type: ignore[attr-defined]
    sys.modules[stub.__name__] = stub


def right(question: Question, calls: list[tuple[str, dict[str, Any]]]) -> bool:
    """The leaderboard's verdict on an answer's calls (irrelevance: right when none)."""
    if question.category == "irrelevance":
        return not calls
    if not calls:
        return False
    _stub_model_table()
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    output = [{name: arguments} for name, arguments in calls]
    verdict = ast_checker(
        question.functions, output, question.answer, Language.PYTHON, question.category, MODEL
    )
    return bool(verdict["valid"])
