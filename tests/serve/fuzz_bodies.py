"""What test_fuzz sends the server and what it holds every answer to: valid bodies per POST
endpoint, the values each field is mutated to (each marked accepted, refused, or either),
any JSON, raw bytes, and the verdict on a response.

The valid bodies decode at most one token, and their stop strings end a greedy answer within
two (the 'Hi' chat says "Hello!", the completion " Paris"), so a mutation that lifts
``max_tokens`` to 2**63 still answers at once."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import strategies as st

from kvboost_rag import passage

MODEL = "smollm2-135m-instruct"
OK, REFUSED, EITHER = "accepted", "refused", "either"  # what a mutation's answer must be
REMOVE = object()  # the mutation that drops the field
PAIRED = "(several)"  # the mutation that sets the fields of its value, together
UNKNOWN = "(unknown)"  # the mutation that adds a field the server does not know
TRACEBACK = ("Traceback", 'File "', '.py", line')
NAN, INF = float("nan"), float("inf")  # json.dumps writes NaN / Infinity, as some clients do


class Raw(str):
    """JSON text that ``encoded`` puts in a body as it is: values nested deeper than this
    process's json.dumps may recurse."""


def nested(depth: int, inner: str = "{}", key: str = "items") -> Raw:
    """A JSON schema ``depth`` levels deep; up to ~900 levels, what the server's parser takes."""
    return Raw(f'{{"type": "array", "{key}": ' * depth + inner + "}" * depth)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
DEEP = nested(500)  # past the engine's recursion limit in its schema walk


def tool(parameters: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def schema(value: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}


def call(arguments: str) -> list[dict[str, Any]]:
    """A conversation whose assistant turn called a tool with ``arguments``."""
    made = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [made]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]


def marked(ok: list[Any] = (), refused: list[Any] = (), either: list[Any] = ()) -> list[Any]:
    return [(v, OK) for v in ok] + [(v, REFUSED) for v in refused] + [(v, EITHER) for v in either]


# Accepted values are few (each decodes a token); refused ones are many and cost nothing.
SAMPLING: dict[str, list[Any]] = {
    "model": marked(refused=[REMOVE, None, 5, "", "gpt-4o", [MODEL], MODEL + " "]),
    "max_tokens": marked([2], [0, -1, -(2**63), 1.5, "1", True, NAN, INF, [1]]),
    "temperature": marked([2, 1e-300], [-1, 1e308, 2.0001, NAN, INF, -INF, "0", True]),
    "top_p": marked([1e-300], [0, 2, -1, NAN, INF, "1", True, [1]]),
    "n": marked([2], [0, -1, 17, 10**6, 2**64, 1.0, "2", True, None]),
    "seed": marked([2**64 - 1], [-1, 2**64, 10**30, 1.5, "7", True, NAN]),
    "stop": marked(
        [["x"] * 16],
        ["", [""], ["x"] * 17, ["x"] * 100, 5, [5], [None], {"a": 1}, "\ud800", ["a\udfff"]],
    ),
    "stream": marked([True], ["yes", 1, None, []]),
    "stream_options": marked([{"include_usage": True}], [5, [], {"include_usage": 1}]),
    "logit_bias": marked([], [{"5": 10}, {"5": NAN}, [1], "x", nested(800, "1")]),
    "logprobs": marked([], [True, 1]),
    "top_logprobs": marked([], [2, -1]),
    "frequency_penalty": marked([], [0.5, -2, NAN]),
    "presence_penalty": marked([], [1]),
    "best_of": marked([], [2, 0]),
    "function_call": marked([], [{"name": "f"}]),
    "functions": marked([], [[{"name": "f"}]]),
}
# What the refused fields may be set to, and fields the server does not use, all at once.
HARMLESS = {"logit_bias": {}, "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0}
HARMLESS.update(presence_penalty=0, best_of=1, function_call="auto", functions=[], user=5)
HARMLESS["metadata"] = nested(800, "1")
CHAT_FIELDS: dict[str, list[Any]] = {
    **SAMPLING,
    "messages": marked(
        [
            [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            [{"role": "user", "content": [{"type": "text", "text": "Hi", "extra": 1}]}],
            call('{"city": "Paris"}'),
        ],
        [REMOVE, [], "Hi", None, [None], [[]], [{"role": "user"}], [{"content": "Hi"}]]
        + [[{"role": r, "content": "Hi"}] for r in ("robot", "", None, 5, "USER", "function")]
        + [[{"role": "user", "content": c}] for c in (5, None, {"text": "Hi"}, [["Hi"]], [5])]
        + [[{"role": "user", "content": [{"type": t, "text": "Hi"}]}] for t in ("image", None)]
        + [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]]
        + [[{"role": "user", "content": [{"type": "text"}]}]]
        + [[{"role": "user", "content": "Hi \ud800"}], [{"role": "user", "content": "w " * 9000}]]
        + [call(a) for a in ("{not json", "[1]", "5", "NaN", "[" * 5000, "[" * 900 + "]" * 900)],
        [[{"role": "user", "content": ""}], [{"role": "user", "content": []}], call("")],
    ),
    # A greedy answer to 'Hi' ends at 10 tokens: any max_tokens is quick here.
    "max_tokens": marked([2**63], SAMPLING["max_tokens"]),
    "max_completion_tokens": marked([2], [0, -1, 1.5, "1", True, NAN]),
    "tools": marked(
        [[], [WEATHER], tool(None)],
        [
            5,
            [5],
            [{"type": "nope", "function": WEATHER["function"]}],
            [{"type": "function", "function": {"name": "bad name!"}}],
            [{"type": "function", "function": {"name": "x" * 65}}],
            [{"type": "function"}],
            [WEATHER, WEATHER],
            tool("x"),
            tool([]),
        ]
        + [tool({"type": "object", "properties": p}) for p in (5, [], "x", {"a": 5})]
        + [tool({"type": "object", "properties": {"a": {"properties": []}}})]
        + [tool({"type": "object", "required": 5}), tool({"type": 5}), tool({"$ref": "#/no"})]
        + [tool(DEEP), tool(nested(800))],
        [tool({"$ref": "#"}), tool({"type": "object", "properties": {"a": {"$ref": "#"}}})],
    ),
    "tool_choice": marked(
        ["none"],
        ["required", "sometimes", 5, {"type": "function"}, {"type": "function", "function": {}}]
        + [{"type": "function", "function": {"name": "get_weather"}}],
    ),
    "parallel_tool_calls": marked([True], ["yes", 1]),
    "response_format": marked(
        [{"type": "text"}, schema({"type": "object"})],
        ["json_object", {"type": "xml"}, {"type": "json_schema"}, schema(5), schema([])]
        + [schema({"type": t}) for t in ("nope", 5, None)]
        + [schema({"type": "object", "properties": p}) for p in (5, [], {"a": 5})]
        + [schema({"type": "string", "pattern": "("}), schema({"enum": []})]
        + [schema({"$ref": "#/definitions/x"}), schema({"minimum": 10**40, "type": "integer"})]
        + [schema(DEEP), schema(nested(800)), schema(nested(800, key="additionalProperties"))]
        + [{"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}],
        [schema({"$ref": "#"}), schema({"anyOf": [{"type": "string"}] * 500})],
    ),
}
CHAT_FIELDS[PAIRED] = marked(
    [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": WEATHER["function"]}},
        {"tools": [WEATHER], "tool_choice": "required", "stream": True},
        {"n": 4, "seed": 2**64 - 1, "temperature": 2, "stream": True},
        HARMLESS,
    ],
    [
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [WEATHER], "response_format": {"type": "json_object"}},
        {"stream": True, "response_format": schema({"type": "nope"})},
        {"stream": True, "messages": [{"role": "user", "content": "w " * 9000}]},
        {"max_tokens": 1, "max_completion_tokens": 0},
    ],
)
COMPLETION_FIELDS: dict[str, list[Any]] = {
    **SAMPLING,
    "prompt": marked(
        [["Hi", "The sky is"], "Hi \x00 there"],
        [REMOVE, "", [], [""], 5, [1, 2, 3], [[1, 2]], None, "\ud800", [["a"]], "w " * 9000],
    ),
    "echo": marked([], [True]),
    "suffix": marked([], ["x"]),
    PAIRED: marked(
        [
            {
                "prompt": ["a", "b"],
                "n": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
            {**HARMLESS, "echo": False, "suffix": ""},
        ],
        [{"stream": True, "prompt": "\ud800"}, {"stream": True, "prompt": "w " * 9000}],
    ),
}
WARM_FIELDS: dict[str, list[Any]] = {
    "documents": marked(
        [["One.", "Two."], [""], ["  \n"]],
        [REMOVE, [], "x", None, [5], [None], [["x"]], ["x \ud800"]],
    ),
    "prefix": marked(
        ["Context: ", [{"role": "user", "content": passage("x") + " Question?"}]],
        [5, [], [{"role": "tool", "content": "x"}], [{"role": "user"}]]
        + [[{"role": "user", "content": "no marker"}], "w " * 9000],
    ),
    "system": marked(["Answer from the documents."], [5, ["x"], "w " * 9000]),
    "batch_size": marked([1, 10**30], [0, -1, 1.5, "2", True, [1], NAN]),
    "stream": marked([True], ["yes", 1, None]),
    "unknown": marked([5, nested(800, "1")]),
    PAIRED: marked(
        [{"stream": True, "batch_size": 1, "documents": ["One.", "Two.", "Three."]}],
        [
            {"prefix": "Context: ", "system": "Answer."},
            {"stream": True, "prefix": [{"role": "user", "content": "no marker"}]},
            {"stream": True, "documents": ["x \ud800"]},
            {"stream": True, "system": "w " * 9000},
        ],
    ),
}
# Valid bodies, whose fields a mutation changes one at a time; and the fields it gives only
# their marked values (a completion runs on to max_tokens, so any JSON there could be long).
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1}
WARM = {"documents": ["A lighthouse keeper's log."]}
ENDPOINTS = {
    "/v1/chat/completions": (CHAT, CHAT_FIELDS, ()),
    "/v1/completions": (COMPLETION, COMPLETION_FIELDS, ("max_tokens",)),
    "/v1/kvboost/warm": (WARM, WARM_FIELDS, ()),
}


def mutated(valid: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    if field == PAIRED:
        return {**valid, **value}
    body = {k: v for k, v in valid.items() if k != field}
    if value is not REMOVE:
        body[field] = value
    return body


def mutations(path: str) -> st.SearchStrategy[tuple[str, Any, str]]:
    """One field of the path's valid body given a marked value or any JSON (either
    verdict), or a field of a name the server does not know given any JSON (ignored)."""
    _, fields, marked_only = ENDPOINTS[path]
    unknown = st.text(min_size=1).filter(lambda name: name not in KNOWN)

    def values(name: str) -> st.SearchStrategy[tuple[str, Any, str]]:
        if name == UNKNOWN:
            return st.tuples(unknown, JSON, st.just(OK))
        listed = st.sampled_from(fields[name]) if fields[name] else st.nothing()
        if name not in marked_only and name != PAIRED:
            listed = listed | JSON.map(lambda v: (v, EITHER))
        return listed.map(lambda marked_value: (name, *marked_value))

    return st.sampled_from([*sorted(fields), UNKNOWN]).flatmap(values)


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**100, -0.0, 1e308, NAN, INF, -INF])
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["\ud800", "a\udfffb", "user", "text", "function"])
)
KNOWN = {*CHAT_FIELDS, *COMPLETION_FIELDS, *WARM_FIELDS, "audio", "prediction", *HARMLESS}
KEYS = st.sampled_from(sorted(KNOWN | {"role", "content", "type", "function", "name"}))
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(KEYS | st.text(), inner, max_size=4)
    ),
    max_leaves=12,
)


def encoded(value: Any) -> bytes:
    """JSON text; NaN and Infinity as Python writes them, lone surrogates escaped."""
    raws: list[Raw] = []

    def swap(item: Any) -> Any:
        if isinstance(item, Raw):
            raws.append(item)
            return f"@raw{len(raws) - 1}@"
        if isinstance(item, dict):
            return {key: swap(inner) for key, inner in item.items()}
        return [swap(inner) for inner in item] if isinstance(item, list) else item

    text = json.dumps(swap(value))
    for index, raw in enumerate(raws):
        text = text.replace(f'"@raw{index}@"', raw)
    return text.encode()


def check(response: httpx.Response, expected: str, body: Any = None) -> None:
    """A 4xx in OpenAI's error shape, or (where ``expected`` allows) a whole answer; never a
    5xx or a traceback."""
    status, text = response.status_code, response.text
    assert status < 500, f"{status}: {text[:2000]}"
    assert not any(mark in text for mark in TRACEBACK), text[:2000]
    if status >= 400:
        assert expected != OK, f"refused a valid body: {text[:2000]}"
        assert_error(response.json())
    else:
        assert expected != REFUSED, f"accepted an invalid body ({status}): {text[:2000]}"
        assert status == 200, text[:2000]
        assert_answer(response, body)


def assert_error(payload: Any) -> None:
    assert isinstance(payload, dict) and set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"].strip(), error
    assert error["type"] in ("invalid_request_error", "not_found_error"), error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error


def assert_answer(response: httpx.Response, body: dict[str, Any]) -> None:
    """A whole answer: every choice the body asked for, or every warm line and a summary."""
    kind = response.headers["content-type"]
    if kind.startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        chunks = [json.loads(event) for event in events[:-1]]
        assert chunks and not any("error" in chunk for chunk in chunks), events
        indices = {c["index"] for chunk in chunks for c in chunk["choices"]}
    elif kind.startswith("application/x-ndjson"):
        lines = [json.loads(line) for line in response.text.splitlines()]
        assert lines[-1]["object"] == "kvboost.warm", lines
        assert all(line["object"] == "kvboost.warm.progress" for line in lines[:-1]), lines
        return
    else:
        answer = response.json()
        if answer["object"] == "kvboost.warm":
            assert answer["documents"] == len(body["documents"]), answer
            return
        assert answer["object"] in ("chat.completion", "text_completion"), answer
        assert answer["usage"]["total_tokens"] > 0, answer
        finishes = {c["finish_reason"] for c in answer["choices"]}
        assert finishes <= {"stop", "length", "tool_calls"}, answer
        indices = {c["index"] for c in answer["choices"]}
    prompts = body.get("prompt", [""])
    answers = body.get("n", 1) * (len(prompts) if isinstance(prompts, list) else 1)
    assert indices == set(range(answers)), (indices, answers)
