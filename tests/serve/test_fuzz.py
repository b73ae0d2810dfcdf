"""Fuzzed request bodies against every POST endpoint (hypothesis): any JSON, a valid body
with one field given a wrong type or an out-of-range value, raw bytes, truncated JSON,
10,000 levels of nesting, non-UTF-8, lone surrogates, wrong content types. Every answer is
a 4xx in OpenAI's error shape, or a whole answer where the body is in fact valid (each
mutation says which it must be: ``fuzz_bodies``); never a 5xx, never a traceback.

Most run in process through the ASGI app (``TestClient``), around the session's engine; the
nastiest bodies and broken HTTP framing also go through a real uvicorn (``serving``: the
server ``kvboost-rag serve`` runs, on a thread), for h11's parsing and the body limit.
A run sends ~800 bodies: 330 generated, 355 listed mutations, the rest fixed."""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from fuzz_bodies import (
    CHAT,
    COMPLETION,
    DEEP,
    EITHER,
    ENDPOINTS,
    JSON,
    MODEL,
    OK,
    REFUSED,
    TRACEBACK,
    WARM,
    WEATHER,
    call,
    check,
    encoded,
    mutated,
    mutations,
    schema,
    tool,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvboost_rag import KVBoost
from kvboost_rag.serve import ServeSettings, create_app, serving

pytestmark = pytest.mark.embedded

KEY = "fuzz-key-0123"
BODY_LIMIT = 65536
PATHS = sorted(ENDPOINTS)
CHAT_PATH, COMPLETION_PATH, WARM_PATH = PATHS
# Content types FastAPI reads as JSON, and types it does not (the body is then refused).
JSON_TYPES = ["application/json; charset=utf-8", "application/x+json"]
OTHER_TYPES = ["", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )


@pytest.fixture(scope="module")
def client(embedded: KVBoost) -> TestClient:
    app = create_app(embedded, ServeSettings(model_name=MODEL))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def post(client: TestClient, path: str, content: bytes, kind: str = "application/json"):
    return client.post(path, content=content, headers={"content-type": kind} if kind else {})


def verdict(response: httpx.Response) -> httpx.Response:
    event(f"answered {response.status_code}")
    return response


# -- in process ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@fuzz(30)
@given(value=JSON)
def test_any_json_is_refused_or_a_valid_warm(client, path, value) -> None:
    # {"documents": ["x"]} is a valid warm; no chat or completion names the model (404).
    check(
        verdict(post(client, path, encoded(value))), EITHER if path == WARM_PATH else REFUSED, value
    )


@pytest.mark.parametrize("path", PATHS)
@fuzz(50)
@given(data=st.data())
def test_a_valid_body_with_one_field_changed_is_answered_or_refused(client, path, data) -> None:
    field, value, expected = data.draw(mutations(path), label="mutation")
    body = mutated(ENDPOINTS[path][0], field, value)
    check(verdict(post(client, path, encoded(body))), expected, body)


@pytest.mark.parametrize("path", PATHS)
def test_every_marked_value_is_answered_as_marked(client, path) -> None:
    """Each field's listed values once, so none is left to chance."""
    valid, fields, _ = ENDPOINTS[path]
    wrong = []
    for field, values in fields.items():
        for value, expected in values:
            body = mutated(valid, field, value)
            response = post(client, path, encoded(body))
            try:
                check(response, expected, body)
            except AssertionError as error:
                wrong.append(f"{field}={str(value)[:80]!r}: {str(error)[:300]}")
    assert not wrong, "\n".join(wrong)


def truncated(path: str) -> st.SearchStrategy[bytes]:
    whole = encoded(ENDPOINTS[path][0])
    return st.integers(0, len(whole) - 1).map(lambda cut: whole[:cut])


def broken(path: str) -> st.SearchStrategy[bytes]:
    """A valid body with bytes that are not UTF-8 (or a lone surrogate) inside a string."""
    whole = encoded(ENDPOINTS[path][0])
    quotes = [i for i, byte in enumerate(whole) if byte == ord('"')]
    junk = st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\\ud800"])
    return st.tuples(st.sampled_from(quotes[1::2]), junk).map(
        lambda at: whole[: at[0]] + at[1] + whole[at[0] :]
    )


@pytest.mark.parametrize("path", PATHS)
@fuzz(30)
@given(data=st.data())
def test_raw_bytes_truncated_and_broken_json_are_refused(client, path, data) -> None:
    content = data.draw(st.binary(max_size=64) | truncated(path) | broken(path))
    check(verdict(post(client, path, content)), REFUSED)


NASTY = [
    b"",
    b"{",
    b'{"model": ',
    b"[" * 10_000 + b"]" * 10_000,
    b'{"a": ' * 10_000 + b"1" + b"}" * 10_000,
    b"[" * 800 + b"]" * 800,
    b'{"model": "' + MODEL.encode() + b'", "max_tokens": ' + b"9" * 5000 + b"}",
    b"\xff\xfe\x00",
    b"\xef\xbb\xbf",
    b'"\\ud800"',
    b"NaN",
    b"-Infinity",
    b"\x00" * 64,
]


@pytest.mark.parametrize("path", PATHS)
def test_nasty_bodies_are_refused(client, path) -> None:
    for content in NASTY:
        check(post(client, path, content), REFUSED)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", JSON_TYPES + OTHER_TYPES)
def test_a_valid_body_is_read_as_json_only_when_typed_so(client, path, kind) -> None:
    valid = ENDPOINTS[path][0]
    response = post(client, path, encoded(valid), kind)
    check(response, OK if kind in JSON_TYPES else REFUSED, valid)
    if kind in OTHER_TYPES:
        assert "application/json" in response.json()["error"]["message"]


def chat(**fields: Any) -> bytes:
    return encoded({**CHAT, **fields})


# What the fuzzing found, each its smallest body: a 500 (the first five), a 200 for a
# refusal, or a refusal that did not say which field or what was wrong.
FOUND = {
    "tool properties not an object (500)": (
        CHAT_PATH,
        chat(tools=tool({"type": "object", "properties": 5})),
        "tools",  # was None
        "properties must be an object",
    ),
    "schema properties not an object (500)": (
        CHAT_PATH,
        chat(response_format=schema({"properties": []})),
        "response_format",  # was None
        "properties must be an object",
    ),
    "tool parameters pointing at the root, forced (200, a call named '')": (
        CHAT_PATH,
        chat(tools=tool({"$ref": "#"}), tool_choice="required"),
        "tools.0",
        "$ref '#' points inside the parameters",
    ),
    "tool parameters 500 deep (500)": (
        CHAT_PATH,
        chat(tools=tool(DEEP)),
        "tools.0.function.parameters",
        "deeper than 64",
    ),
    "schema 500 deep (500)": (
        CHAT_PATH,
        chat(response_format=schema(DEEP)),
        "response_format.json_schema.schema",
        "deeper than 64",
    ),
    "tool call arguments 5000 deep (500)": (
        CHAT_PATH,
        chat(messages=call("[" * 5000)),
        None,
        "arguments are not JSON",
    ),
    "streamed warm of a bad prefix (200)": (
        WARM_PATH,
        encoded({**WARM, "stream": True, "prefix": [{"role": "user", "content": "x"}]}),
        None,
        "mark no passage",
    ),
    "batch_size a string (200)": (
        WARM_PATH,
        encoded({**WARM, "batch_size": "2"}),
        "batch_size",
        "valid integer",
    ),
    "prompt over the context window": (
        COMPLETION_PATH,
        encoded({**COMPLETION, "prompt": "w " * 9000}),
        "prompt",
        "context window",
    ),
    "tool_choice names no tool offered": (
        CHAT_PATH,
        chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
        "tool_choice",
        "'x', which is not among the tools offered",
    ),
    "stop of 100 strings": (CHAT_PATH, chat(stop=["x"] * 100), "stop", "at most 16 items"),
    "logit_bias": (CHAT_PATH, chat(logit_bias={"5": 10}), "logit_bias", "not supported"),
    "10,000 levels": (CHAT_PATH, b"[" * 10_000 + b"]" * 10_000, None, "nests too deeply"),
    "not UTF-8": (CHAT_PATH, b'{"model": "\xff"}', None, "not UTF-8"),
    "truncated": (CHAT_PATH, b'{"model": "x", "messages": [', None, "at character 28"),
}


@pytest.mark.parametrize(("path", "content", "param", "said"), FOUND.values(), ids=list(FOUND))
def test_what_the_fuzzing_found_is_refused_clearly(client, path, content, param, said) -> None:
    response = post(client, path, content)
    check(response, REFUSED)
    error = response.json()["error"]
    assert error["param"] == param and said in error["message"], error


# -- through uvicorn ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(embedded: KVBoost) -> str:
    settings_ = ServeSettings(model_name=MODEL, port=0, api_key=KEY, max_body_bytes=BODY_LIMIT)
    with serving(embedded, settings_) as url:
        yield url.removesuffix("/v1")


@pytest.mark.parametrize("path", PATHS)
def test_nasty_bodies_through_uvicorn_are_refused(server, path) -> None:
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    bodies = [
        *NASTY,
        chat(response_format=schema(DEEP)),
        b"[" * (BODY_LIMIT + 1),
        encoded({**WARM, "x": "y" * BODY_LIMIT}),
    ]
    for content in bodies:
        response = httpx.post(f"{server}{path}", content=content, headers=headers, timeout=120)
        check(response, REFUSED)
    chunks = (bytes([byte]) * 4096 for byte in b"[" * (BODY_LIMIT // 4096 + 2))  # chunked
    response = httpx.post(f"{server}{path}", content=chunks, headers=headers, timeout=120)
    assert response.status_code == 413, response.text


def exchange(server: str, request: bytes) -> bytes:
    """What uvicorn answers ``request`` with, sent as it is on a fresh connection (the
    sending side then closed, as a client that sent all it will)."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


# Requests h11 cannot frame get its own plain-text 400 ("Invalid HTTP request received."),
# before the app sees them; one that stops short of its Content-Length and closes gets
# nothing; the rest reach the app.
H11, NOTHING, APP = "h11", "nothing", "app"
FRAMING = [
    (b"Content-Length: abc\r\n\r\n{}", H11),
    (b"Content-Length: -5\r\n\r\n{}", H11),
    (b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", H11),
    (b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", H11),
    (b'Content-Length: 100\r\n\r\n{"model"', NOTHING),
    (b"Transfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\n{}\r\n0\r\n\r\n", APP),
    (b"X-Name: caf\xc3\xa9 \xff\r\nContent-Length: 2\r\n\r\n{}", APP),
    (b"Content-Length: 2\r\n\r\n[]", APP),
]


@pytest.mark.parametrize(("framing", "answerer"), FRAMING, ids=range(len(FRAMING)))
def test_broken_http_framing_is_refused_without_a_traceback(server, framing, answerer) -> None:
    head = f"POST {CHAT_PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
    answer = exchange(server, f"{head}Content-Type: application/json\r\n".encode() + framing)
    assert not any(mark.encode() in answer for mark in TRACEBACK), answer
    if answerer == NOTHING:
        assert answer == b""
        return
    head_lines, body = answer.split(b"\r\n\r\n", 1)
    assert head_lines.startswith(b"HTTP/1.1 400 "), answer
    if answerer == H11:
        assert b"Invalid HTTP request received." in body, answer
    else:
        assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}, answer
