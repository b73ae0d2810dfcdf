"""Tool-call formats, parsing and chat rendering: pure functions, no model."""

from __future__ import annotations

import json

import pytest

from kvboost_rag.core.tools.formats import (
    FORMATS,
    ToolCall,
    format_for,
    no_special,
    strict_schema,
)
from kvboost_rag.core.tools.structure import TEXT_ONLY, Structure, json_schema
from kvboost_rag.core.tools.template import as_call, instructions, render_chat

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
HERMES = FORMATS["hermes"]
NAMES = ["add", "search"]


def test_hermes_reads_calls_and_keeps_the_text_around_them() -> None:
    text = (
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>[{"name": "search", "arguments": {"q": "x"}}]</tool_call> done'
    )
    parsed = HERMES.parse(text, NAMES)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("add", {"a": 1, "b": 2}),
        ("search", {"q": "x"}),
    ]
    assert parsed.invalid == []
    assert parsed.content == "Sure.\n\n done"
    assert len({c.id for c in parsed.calls}) == 2


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "add", "arguments": {"a": 1', "not valid JSON"),
        ('{"name": "mul", "arguments": {}}', "no tool named 'mul'"),
        ('{"arguments": {}}', "no string 'name'"),
        ('{"name": "add", "arguments": [1, 2]}', "not a JSON object"),
    ],
)
def test_malformed_calls_become_invalid_entries(body: str, error: str) -> None:
    parsed = HERMES.parse(f"<tool_call>\n{body}\n</tool_call>", NAMES)
    assert parsed.calls == []
    assert len(parsed.invalid) == 1 and error in parsed.invalid[0].error


def test_an_unterminated_call_is_read_to_the_end() -> None:
    parsed = HERMES.parse('<tool_call>\n{"name": "search", "arguments": {"q": "y"}}', NAMES)
    assert parsed.calls[0].arguments == {"q": "y"}


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    call = '{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
    assert HERMES.parse(f"<tool_call>{call}</tool_call>", NAMES).calls[0].arguments == {
        "a": 1,
        "b": 2,
    }


def test_text_without_a_call_is_all_content() -> None:
    for fmt in FORMATS.values():
        parsed = fmt.parse("The answer is 3.", NAMES)
        assert (parsed.content, parsed.calls, parsed.invalid) == ("The answer is 3.", [], [])


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "parameters": {"a": 1, "b": 2}}',
        '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```',
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}',
    ],
)
def test_json_formats_read_whole_answer_calls(text: str) -> None:
    parsed = FORMATS["llama3"].parse(text, NAMES)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("add", {"a": 1, "b": 2})]


def test_visible_holds_back_what_may_start_a_call() -> None:
    assert HERMES.visible("Hi <tool") == "Hi "
    assert HERMES.visible("Hi <tool_call>\n{") == "Hi "
    assert HERMES.visible("a < b") == "a < b"
    assert FORMATS["json"].visible('  {"na') == ""
    assert FORMATS["json"].visible("Paris.") == "Paris."


def test_render_round_trips_through_parse() -> None:
    call = ToolCall("add", {"b": 2, "a": 1})
    for fmt in FORMATS.values():
        (back,) = fmt.parse(fmt.render(call), NAMES).calls
        assert (back.name, list(back.arguments.items())) == ("add", [("b", 2), ("a", 1)])


def test_format_follows_the_chat_template() -> None:
    assert format_for("... <tool_call> ... tools ...").name == "hermes"
    assert format_for("{{ tools }} <|python_tag|>").name == "llama3"
    assert format_for("{% if tools %}{{ tools | tojson }}{% endif %}").name == "json"
    assert format_for("{{ message['content'] }}").name == "hermes"  # the fallback teaches it
    assert format_for(None, "llama3").name == "llama3"
    with pytest.raises(ValueError, match="tool_format must be"):
        format_for(None, "xml")


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class _Template:
    """A tokenizer stand-in: ``apply_chat_template`` through jinja, as transformers does."""

    def __init__(self, template: str) -> None:
        self.chat_template = template

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):  # type: ignore[no-untyped-def]
        import jinja2

        env = jinja2.Environment()
        env.filters["tojson"] = json.dumps
        template = env.from_string(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **kwargs
        )


def test_fallback_puts_tools_in_the_system_message_and_tool_results_in_user_turns() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": None, "tool_calls": [as_call(ADD_CALL)]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    text = render_chat(_Template(CHATML), messages, [ADD], HERMES)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + instructions([ADD], HERMES))
    assert json.dumps(ADD) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1' in text
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>" in text


ADD_CALL = {
    "id": "c1",
    "type": "function",
    "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
}


def test_templates_that_render_tools_get_them_natively() -> None:
    template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
        "</tool_call>{% endfor %}{% endif %}{% if m.role == 'tool' %} [tool]{% endif %}\n"
        "{% endfor %}"
    )
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [ADD_CALL]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    text = render_chat(_Template(template), messages, [ADD], HERMES)
    assert text.startswith("TOOLS:" + json.dumps([ADD]))
    assert 'assistant: <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}' in text
    assert "tool: 3 [tool]" in text
    assert "# Tools" not in text


def test_each_agent_step_extends_the_previous_prompt() -> None:
    """A call rendered back into the history reads exactly as the model wrote it, so the
    next step's prompt starts with the last prompt and the answer."""
    tok = _Template(CHATML)
    history = [{"role": "user", "content": "1+2?"}]
    prompt = render_chat(tok, history, [ADD], HERMES)
    call = ToolCall("add", {"a": 1, "b": 2}, "c1")
    answer = HERMES.render(call)
    history += [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    assert render_chat(tok, history, [ADD], HERMES).startswith(prompt + answer + "<|im_end|>")


def test_as_call_reads_the_common_shapes() -> None:
    assert as_call(ADD_CALL) == ToolCall("add", {"a": 1, "b": 2}, "c1")
    flat = as_call({"name": "add", "args": {"a": 1}, "id": "x"})
    assert (flat.name, flat.arguments, flat.id) == ("add", {"a": 1}, "x")
    assert as_call({"function": {"name": "add", "arguments": '{"a": 1}'}}).arguments == {"a": 1}
    with pytest.raises(ValueError, match="str name and dict arguments"):
        as_call({"function": {"name": 3}})
    # Nested past the JSON parser's recursion limit: a RecursionError was raised (a 500).
    with pytest.raises(ValueError, match="arguments are not JSON"):
        as_call({"function": {"name": "add", "arguments": "[" * 5000}})


def with_parameters(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP = nested(1000)
REF_INSIDE = {
    "type": "object",
    "properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}},
}


def test_tool_parameters_may_point_at_their_definitions() -> None:
    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/Node"}}}
    parameters = {"$defs": {"Node": node}, "type": "object", "properties": {"head": node}}
    assert Structure((with_parameters(parameters),), "required").grammar(no_special)
    assert Structure(
        response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}
    )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"tools": (ADD,), "tool_choice": "mul"}, "tool_choice must be"),
        ({"tools": (ADD, ADD)}, "unique"),
        ({"tools": ({"name": "add"},)}, "a tool must be"),
        ({"tools": (ADD,), "response_format": {"type": "json_object"}}, "not both"),
        ({"response_format": {"type": "yaml"}}, "response_format must be"),
        ({"tool_choice": "required"}, "need tools="),
        ({"parallel": True}, "need tools="),
        # In process these raised RecursionError, and the server answered a forced call to
        # the first with 200 and a call named "" (issue 64).
        ({"tools": (with_parameters(DEEP),)}, r"tools\[0\] parameters nests deeper than 64"),
        ({"tools": (ADD, with_parameters({"$ref": "#"}))}, r"tools\[1\] parameters: \$ref '#'"),
        ({"tools": (with_parameters(REF_INSIDE),)}, "points inside the parameters"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": DEEP}}}, "deeper"),
    ],
)
def test_structure_rejects_bad_requests(kwargs: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Structure(**kwargs)


def test_structure_grammar_follows_the_choice() -> None:
    assert Structure().grammar(no_special) is None
    assert Structure((ADD,), constrain=False).grammar(no_special) is None
    assert Structure((ADD,), "none").grammar(no_special) == TEXT_ONLY  # calls refused
    assert Structure((ADD,), "none", constrain=False).grammar(no_special) is None
    auto = Structure((ADD, SEARCH)).grammar(no_special)
    assert auto is not None and "[lazy]" in auto and '"search"' in auto
    named = Structure((ADD, SEARCH), "search").grammar(no_special)
    assert named is not None and "[lazy]" not in named and '"add"' not in named
    assert Structure((ADD,), "none").parse("<tool_call>{}</tool_call>").calls == []


@pytest.mark.parametrize("text", ["", "<", "<tool_c", "<tool_call", "Sure, here it is"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_a_forced_call_the_answer_does_not_hold_is_an_invalid_call(choice: str, text: str) -> None:
    """An answer cut before its opening tag was whole (max_tokens=4 gave '<tool_call') was
    plain content with no call, and LangChain's parser returned None for it."""
    parsed = Structure((ADD, SEARCH), choice).parse(text)
    assert (parsed.content, parsed.calls) == ("", [])
    (invalid,) = parsed.invalid
    assert (
        invalid.arguments == text and "asks for a call and the answer holds none" in invalid.error
    )
    assert invalid.name == (None if choice == "required" else "add")
    auto = Structure((ADD, SEARCH)).parse(text)  # "auto" may answer in text
    assert (auto.content, auto.invalid) == (text, [])


def test_json_schema_and_strictness() -> None:
    assert json_schema({"type": "json_object"}) == {"type": "object"}
    schema = {"type": "object", "properties": {"p": {"type": "object", "properties": {}}}}
    strict = strict_schema(json_schema({"type": "json_schema", "json_schema": {"schema": schema}}))
    assert strict["additionalProperties"] is False
    assert strict["properties"]["p"]["additionalProperties"] is False
    kept = strict_schema({"type": "object", "properties": {}, "additionalProperties": True})
    assert kept["additionalProperties"] is True
    # Properties that are not an object were walked as one (AttributeError, a 500 from the
    # server); they are left as they are, for llguidance to refuse with its message
    # (tests/serve/test_fuzz.py's FOUND).
    for properties in (5, [], "x"):
        assert strict_schema({"properties": properties}) == {"properties": properties}


def test_nested_models_keep_their_references_resolvable() -> None:
    import llguidance

    trip = {
        "type": "object",
        "properties": {"to": {"$ref": "#/$defs/City"}, "days": {"type": "integer"}},
        "$defs": {"City": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    tool = {"type": "function", "function": {"name": "trip", "parameters": trip}}
    grammar = HERMES.grammar([tool], required=True)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    other = {**trip, "$defs": {"City": {"type": "string"}}}
    with pytest.raises(ValueError, match="City differently"):
        HERMES.grammar(
            [tool, {"type": "function", "function": {"name": "b", "parameters": other}}], True
        )
