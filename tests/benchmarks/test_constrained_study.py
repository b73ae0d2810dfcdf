"""The constrained-decoding benchmark's pure parts: its task set and its validity checks
(the timed program itself is run by hand: ``python -m benchmarks.constrained``)."""

import re

import pytest

from benchmarks.constrained.grammars import _bytes_to_unicode, literal
from benchmarks.constrained.schema_check import check_schema, schema_errors
from benchmarks.constrained.tasks import (
    JSON_TASKS,
    TOOL_TASKS,
    TOOLS,
    call_errors,
    json_errors,
)
from kvboost_rag.core.tools.formats import InvalidToolCall, ToolCall, tool_name
from kvboost_rag.core.tools.structure import Structure


def test_every_task_offers_well_formed_tools_and_a_valid_choice() -> None:
    assert len(TOOL_TASKS) >= 20 and len(JSON_TASKS) >= 8
    for task in TOOL_TASKS:
        assert 1 <= len(task.tools) <= 4
        assert task.choice == "required" or task.choice in task.tools
        Structure(tuple(task.specs), task.choice)  # the engine accepts the request
        for spec in task.specs:
            check_schema(spec["function"]["parameters"], tool_name(spec))
    for task in JSON_TASKS:
        check_schema(task.schema)
        Structure(response_format=task.response_format)
    assert {t.choice for t in TOOL_TASKS} >= {"required", "add", "book_table"}
    assert len({t.question for t in (*TOOL_TASKS, *JSON_TASKS)}) == 32


def test_check_schema_refuses_keywords_it_cannot_judge() -> None:
    with pytest.raises(ValueError, match="pattern"):
        check_schema({"type": "string", "pattern": "^a$"})
    with pytest.raises(ValueError, match="unknown type"):
        check_schema({"type": "int"})


def test_a_valid_call_passes_and_invalid_ones_say_why() -> None:
    weather = [TOOLS["get_weather"], TOOLS["add"]]
    good = ToolCall("get_weather", {"city": "Oslo", "unit": "f"})
    assert call_errors([good], [], weather) == []
    assert call_errors([good], [], weather, "get_weather") == []
    assert call_errors([good], [], weather, "add") != []  # not the named tool
    bad_unit = ToolCall("get_weather", {"city": "Oslo", "unit": "kelvin"})
    assert "not in" in call_errors([bad_unit], [], weather)[0]
    assert "missing 'unit'" in call_errors([ToolCall("get_weather", {"city": "X"})], [], weather)[0]
    assert call_errors([ToolCall("search_essays", {"query": "x", "k": 1})], [], weather)
    assert call_errors([], [], weather) == ["no tool call"]
    broken = InvalidToolCall("add", "{", "tool call is not valid JSON")
    assert call_errors([good], [broken], weather)


def test_nested_and_array_arguments_are_checked_all_the_way_down() -> None:
    book = TOOLS["book_table"]["function"]["parameters"]
    assert schema_errors({"restaurant": "Nopa", "party": {"size": 2, "name": "G"}}, book) == []
    assert schema_errors({"restaurant": "Nopa", "party": {"size": "2", "name": "G"}}, book)
    assert schema_errors({"restaurant": "Nopa", "party": {"size": True, "name": "G"}}, book)
    event = TOOLS["create_event"]["function"]["parameters"]
    assert schema_errors({"title": "x", "attendees": ["a"]}, event) == []
    assert schema_errors({"title": "x", "attendees": []}, event)
    assert schema_errors({"title": "x", "attendees": ["a", 1]}, event)


def test_json_answers_must_parse_and_validate() -> None:
    schema = JSON_TASKS[0].schema
    assert json_errors('{"name": "Ada", "age": 36}', schema) == []
    assert json_errors('{"name": "Ada", "age": 36.5}', schema)
    fenced = '```json\n{"name": "Ada", "age": 36}\n```'
    assert json_errors(fenced, schema)[0].startswith("not JSON")
    assert json_errors(fenced, schema, unfence=True) == []
    strict = {**schema, "additionalProperties": False}
    assert json_errors('{"name": "Ada", "age": 36, "x": 1}', strict)


def test_literal_regexes_match_exactly_their_text() -> None:
    for text in ["<tool_call>\n", "\n</tool_call>", "a.b*c+(d)?[e]{f}|g^$\\-~#&"]:
        assert re.fullmatch(literal(text), text)
        assert not re.fullmatch(literal(text), text + "x")


def test_byte_map_is_a_bijection_onto_printable_characters() -> None:
    chars = _bytes_to_unicode()
    assert sorted(chars) == list(range(256)) and len(set(chars.values())) == 256
    assert chars[ord(" ")] == "Ġ" and chars[ord("\n")] == "Ċ" and chars[ord("a")] == "a"


@pytest.mark.parametrize(
    "value",
    [
        {"restaurant": "Nopa", "party": {"size": 2, "name": "G"}},
        {"restaurant": "Nopa", "party": {"size": 2.5, "name": "G"}},
        {"restaurant": "Nopa", "party": {"size": False, "name": "G"}},
        {"restaurant": "Nopa", "party": {"name": "G"}},
        {"restaurant": "Nopa", "party": {"size": 2, "name": "G", "x": 1}, "y": None},
        {"restaurant": 1, "party": []},
    ],
)
def test_the_checker_agrees_with_jsonschema_where_it_is_installed(value: object) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schemas = [TOOLS["book_table"]["function"]["parameters"], JSON_TASKS[6].schema]
    schemas.append({**schemas[0], "additionalProperties": False})
    for schema in schemas:
        expected = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert (schema_errors(value, schema) == []) == expected, (schema, value)
