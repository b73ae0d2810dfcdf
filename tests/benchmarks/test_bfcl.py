"""The leaderboard harness's pure parts: its function docs as JSON Schema and OpenAI
tools, and (where ``bfcl-eval`` is installed) its own checker's verdicts through the stub."""

from __future__ import annotations

import pytest

from benchmarks.bfcl.questions import json_schema, tool


def test_leaderboard_types_become_json_schema() -> None:
    doc = {
        "type": "dict",
        "properties": {
            "x": {"type": "float"},
            "pair": {"type": "tuple", "items": {"type": "integer"}},
            "anything": {"type": "any", "description": "d"},
            "nested": {"type": "dict", "properties": {"n": {"type": "float"}}},
        },
        "required": ["x"],
    }
    assert json_schema(doc) == {
        "type": "object",
        "properties": {
            "x": {"type": "number"},
            "pair": {"type": "array", "items": {"type": "integer"}},
            "anything": {"description": "d"},
            "nested": {"type": "object", "properties": {"n": {"type": "number"}}},
        },
        "required": ["x"],
    }


def test_dotted_names_map_to_underscores() -> None:
    made = tool({"name": "math.factorial", "description": "d", "parameters": {"type": "dict"}})
    assert made["function"]["name"] == "math_factorial"
    assert made["function"]["parameters"] == {"type": "object"}


def test_the_leaderboards_checker_judges_calls() -> None:
    pytest.importorskip("bfcl_eval")
    from benchmarks.bfcl.questions import load, right

    factorial = load("simple_python", 2)[1]  # math.factorial of 5
    assert right(factorial, [("math_factorial", {"number": 5})])
    assert not right(factorial, [("math_factorial", {"number": 6})])
    assert not right(factorial, [])
    (unrelated,) = load("irrelevance", 1)
    assert right(unrelated, []) and not right(unrelated, [("determine_body_mass_index", {})])
