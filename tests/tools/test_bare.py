"""Calls written as bare or fenced JSON (what small Qwen models answer ``tool_choice="auto"``
with): read as calls or reported as invalid ones, never lost, and ordinary JSON answers
left as content; streaming holds such a call back while it is written."""

from __future__ import annotations

import pytest
from families import family_real

from kvboost_rag.core.generation.streaming import DeltaQueue, TextDeltas
from kvboost_rag.core.tools.bare import bare_calls, bare_start
from kvboost_rag.core.tools.formats import FORMATS
from kvboost_rag.core.tools.structure import Structure


def tool(name: str, **properties: str) -> dict:
    props = {key: {"type": kind} for key, kind in properties.items()}
    schema = {"type": "object", "properties": props, "required": list(props)}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = (tool("multiply", a="number", b="number"), tool("get_weather", city="string"))
NAMES = ["multiply", "get_weather"]
# Answers Qwen2.5-Coder-0.5B-Instruct wrote to tool_choice="auto" (bf16, greedy).
QWEN_BARE = '{"name": "multiply", "arguments": {"a": 12, "b": 7}}'
QWEN_FENCED = (
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
)


@pytest.mark.parametrize(
    ("text", "call", "content"),
    [
        (QWEN_BARE, ("multiply", {"a": 12, "b": 7}), ""),
        (QWEN_FENCED, ("get_weather", {"city": "Paris"}), ""),
        (
            '```\n{"name": "get_weather", "parameters": {"city": "Oslo"}}\n```',
            ("get_weather", {"city": "Oslo"}),
            "",
        ),
        (
            'Let me look.\n```json\n{"name": "get_weather", "arguments": {"city": "Rome"}}'
            "\n```\nOK?",
            ("get_weather", {"city": "Rome"}),
            "Let me look.\n\nOK?",
        ),
        ('{"name": "multiply"}', ("multiply", {}), ""),
    ],
)
def test_bare_and_fenced_calls_are_read(text: str, call: tuple, content: str) -> None:
    for fmt in FORMATS.values():
        parsed = Structure(TOOLS, fmt=fmt).parse(text)
        assert [(c.name, c.arguments) for c in parsed.calls] == [call], fmt.name
        assert (parsed.content, parsed.invalid) == (content, [])


def test_a_bare_call_s_arguments_take_the_declared_types_where_nothing_is_lost() -> None:
    """Qwen2.5-Coder-0.5B under LlamaIndex's FunctionAgent wrote numbers as strings, and
    ``multiply`` failed on them; the grammar never saw that call (it was free text)."""
    flags = tool("setup", n="integer", on="boolean", tags="array", opt=["number", "null"])
    flags["function"]["parameters"]["properties"]["tags"]["items"] = {"type": "number"}
    text = (
        '{"name": "multiply", "arguments": {"a": "12", "b": " -7.5e1"}}\n'
        '{"name": "get_weather", "arguments": {"city": "12"}}\n'
        '{"name": "setup", "arguments": {"n": "3", "on": "true", "tags": ["1", "x"], '
        '"opt": "2", "extra": "5"}}\n'
        '{"name": "setup", "arguments": {"n": "3.5", "on": "yes", "opt": "0x1"}}'
    )
    parsed = Structure((*TOOLS, flags), parallel=True).parse(text)
    assert [c.arguments for c in parsed.calls] == [
        {"a": 12, "b": -75.0},
        {"city": "12"},  # a string where one is declared
        {"n": 3, "on": True, "tags": [1, "x"], "opt": 2},  # "extra" is not declared
        {"n": "3.5", "on": "yes", "opt": "0x1"},  # not exactly the declared type: kept
    ]


def test_a_bare_call_loses_keys_its_schema_does_not_allow() -> None:
    """Qwen2.5-Coder-0.5B under LangChain's agent copied the schema's ``"type": "object"``
    into its arguments; the grammar (``strict_schema``) would have refused the key."""
    open_ended = tool("tag", label="string")
    open_ended["function"]["parameters"]["additionalProperties"] = True
    nested = tool("post", body="object")
    nested["function"]["parameters"]["properties"]["body"]["properties"] = {"x": {}}
    text = (
        '{"name": "multiply", "arguments": {"a": 2, "b": 3, "type": "object"}}\n'
        '{"name": "tag", "arguments": {"label": "x", "type": "object"}}\n'
        '{"name": "post", "arguments": {"body": {"x": 1, "y": 2}, "z": 3}}'
    )
    parsed = Structure((*TOOLS, open_ended, nested), parallel=True).parse(text)
    assert [c.arguments for c in parsed.calls] == [
        {"a": 2, "b": 3},
        {"label": "x", "type": "object"},  # the schema allows other keys
        {"body": {"x": 1}},
    ]


def test_text_after_a_bare_call_is_content() -> None:
    parsed = Structure(TOOLS).parse(QWEN_BARE + "\nThis multiplies them.")
    assert [(c.name, c.arguments) for c in parsed.calls] == [("multiply", {"a": 12, "b": 7})]
    assert parsed.content == "This multiplies them."


def test_calls_one_a_line_are_several_calls() -> None:
    """Qwen2.5-Coder-0.5B's answer after a tool result, cut at max_tokens."""
    text = (
        '{"name": "multiply", "arguments": {"a": 84, "b": 7}}\n'
        '{"name": "get_weather", "arguments": {"city": "London"}}\n{"name'
    )
    parsed = Structure(TOOLS, parallel=True).parse(text)
    assert [c.name for c in parsed.calls] == ["multiply", "get_weather"]
    assert len(parsed.invalid) == 1 and parsed.content == ""
    # one call per answer unless parallel: the first, and nothing after it
    one = Structure(TOOLS).parse(text)
    assert [c.name for c in one.calls] == ["multiply"] and one.invalid == []


# Qwen2.5-Coder-0.5B's first answer under LangChain's create_agent to "What is 1.5 times 40,
# multiplied by 7?" (benchmarks.tools): it came back as text, no call made.
QWEN_FENCED_CALLS = (
    '```json\n{"name": "multiply", "arguments": {"a": 1.5, "b": 40, "type": "object"}}\n'
    '{"name": "order_status", "arguments": {"order_id": "A17", "type": "object"}}\n'
    '{"name": "get_weather", "arguments": {"city": "London", "type": "object"}}\n```'
)


def test_a_fenced_block_of_calls_one_a_line_is_several_calls() -> None:
    tools = (*TOOLS, tool("order_status", order_id="string"))
    parsed = Structure(tools, parallel=True).parse(QWEN_FENCED_CALLS)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("multiply", {"a": 1.5, "b": 40}),
        ("order_status", {"order_id": "A17"}),
        ("get_weather", {"city": "London"}),
    ]
    assert (parsed.content, parsed.invalid) == ("", [])
    one = Structure(tools).parse("Let me see.\n" + QWEN_FENCED_CALLS)
    assert [(c.name, c.arguments) for c in one.calls] == [("multiply", {"a": 1.5, "b": 40})]
    assert (one.content, one.invalid) == ("Let me see.", [])


def test_a_fenced_block_with_more_than_calls_stays_content() -> None:
    text = f"```json\n{QWEN_BARE}\nprint(1)\n```"
    assert bare_calls(text, NAMES) is None


def test_a_list_of_bare_calls_is_several_calls() -> None:
    text = (
        '[{"name": "multiply", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "get_weather", "arguments": {"city": "X"}}]'
    )
    parsed = Structure(TOOLS, parallel=True).parse(text)
    assert [c.name for c in parsed.calls] == ["multiply", "get_weather"]
    assert [c.name for c in Structure(TOOLS).parse(text).calls] == ["multiply"]


@pytest.mark.parametrize(
    ("text", "name", "error"),
    [
        # Qwen's answer to "Tell me a joke about cats." with three tools offered.
        ('{"name": "cat joke", "arguments": {"cat": "Meow"}}', "cat joke", "no tool named"),
        ('{"name": "multiply", "arguments": {"a": 12, "b"', "multiply", "not valid JSON"),
        ('```json\n{"name": "get_weather", "arguments": {"ci', "get_weather", "not valid JSON"),
        ('{"name": "multiply", "arguments": [12, 7]}', "multiply", "not a JSON object"),
    ],
)
def test_a_call_that_cannot_be_read_is_reported(text: str, name: str, error: str) -> None:
    parsed = Structure(TOOLS).parse(text)
    assert parsed.calls == [] and parsed.content == ""
    (invalid,) = parsed.invalid
    assert invalid.name == name and error in invalid.error


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "Lima", "country": "Peru"}',
        '{"name": "Lima"}',
        '{"capital": "Lima"}',
        "[1, 2, 3]",
        '```json\n{"a": 1}\n```',
        '```python\nprint({"name": "multiply", "arguments": {}})\n```',
        'I would call {"name": "multiply"} here.',
        "Plain text.",
    ],
)
def test_ordinary_json_and_text_stay_content(text: str) -> None:
    assert bare_calls(text, NAMES) is None
    parsed = Structure(TOOLS).parse(text)
    assert (parsed.content, parsed.calls, parsed.invalid) == (text, [], [])


def test_without_tools_json_is_never_a_call() -> None:
    parsed = Structure().parse(QWEN_BARE)
    assert (parsed.content, parsed.calls) == (QWEN_BARE, [])
    assert Structure(TOOLS, "none").parse(QWEN_BARE).calls == []


def test_a_forced_choice_takes_a_bare_call() -> None:
    parsed = Structure(TOOLS, "required", constrain=False).parse(QWEN_FENCED)
    assert [c.name for c in parsed.calls] == ["get_weather"] and parsed.invalid == []


def streamed(text: str, structure: Structure) -> list[str]:
    """The deltas a stream of ``text`` (one character a token) yields, the last one what
    the end of the answer releases."""
    out = DeltaQueue()
    deltas = TextDeltas(lambda ids: text[: len(ids)], (), out, structure.visible)
    for i in range(len(text)):
        deltas.on_token(i)
    deltas.finish(structure.parse(text).content)
    out.close()
    got = []
    while (item := out.get()) is not DeltaQueue.DONE:
        got.append(item[0])  # type: ignore[index]
    return got


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (QWEN_BARE, ""),
        (QWEN_FENCED, ""),
        ('Let me look.\n```json\n{"name": "get_weather", "arguments": {}}\n```', "Let me look."),
        ('Sure.\n<tool_call>\n{"name": "multiply", "arguments": {}}\n</tool_call>', "Sure."),
    ],
)
def test_streaming_holds_a_bare_call_back(text: str, shown: str) -> None:
    deltas = streamed(text, Structure(TOOLS))
    assert "".join(deltas).strip() == shown
    assert "{" not in "".join(deltas)


@pytest.mark.parametrize(
    "text",
    [
        '{"capital": "Lima"} is the JSON.',
        "Use `x` and ```python\nprint(1)\n``` to print.",
        '```json\n{"a": 1}\n```\nThat is JSON.',
    ],
)
def test_streaming_releases_what_is_not_a_call_as_it_comes(text: str) -> None:
    deltas = streamed(text, Structure(TOOLS))
    assert "".join(deltas) == text
    assert len(deltas) > 2  # not all at the end


def test_bare_start_marks_where_a_call_may_begin() -> None:
    assert bare_start('  {"name": "mul', NAMES) == 2
    assert bare_start("Hi ``", NAMES) == 3
    assert bare_start("Hi ```js", NAMES) == 3
    assert bare_start("Hi ```py", NAMES) == len("Hi ```py")


@pytest.mark.embedded
def test_the_real_qwen_s_bare_json_answer_comes_back_as_a_call() -> None:
    """Qwen2.5-Coder-0.5B-Instruct answers ``tool_choice="auto"`` with bare JSON, not its
    ``<tool_call>`` tags: tool_calls and invalid_tool_calls were both empty before."""
    engine = family_real("qwen2.5")
    tools = [*TOOLS, tool("capital_of", country="string")]
    ask = [{"role": "user", "content": "What is 12 times 7?"}]
    result = engine.chat(ask, tools=tools, max_new_tokens=40)
    assert [(c.name, c.arguments) for c in result.tool_calls] == [("multiply", {"a": 12, "b": 7})]
    assert result.text == "" and result.finish_reason == "tool_calls"
    # The next step renders the call as written, not in <tool_call> tags the model never
    # wrote: its prompt continues the answer, whose KV is read (all but the end token's,
    # which no forward computed), not computed again.
    (call,) = result.tool_calls
    history = [
        *ask,
        {"role": "assistant", "content": result.text, "tool_calls": result.tool_calls},
        {"role": "tool", "tool_call_id": call.id, "content": "84"},
    ]
    answer = engine.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert answer in engine.tokenizer.decode(engine.tokenize_chat(history, tools=tools))
    second = engine.chat(history, tools=tools, max_new_tokens=1)
    assert second.reused_tokens == result.prompt_tokens + len(result.token_ids) - 1
