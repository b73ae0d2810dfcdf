"""``kvboost-rag serve`` as a separate process on the embedded SmolLM2, through the real
``openai`` client: its answers are the in-process engine's, token by token when streamed,
with tools, JSON schemas, usage and OpenAI's refusals."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from server_process import ServerProcess

from kvboost_rag import KVBoost

pytestmark = pytest.mark.embedded

KEY = "test-key-0123"
MODEL = "smollm2-135m-instruct"
BODY_LIMIT = 65536
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    args = [MODEL, "--dtype", "float32", "--api-key", KEY, "--max-body-bytes", str(BODY_LIMIT)]
    with ServerProcess(*args) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def test_chat_answers_as_the_engine_does_in_process(client, embedded: KVBoost) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12)
    here = embedded.chat(QUESTION, max_new_tokens=12)
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == here.text and here.text
    assert choice.finish_reason == here.finish_reason
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == len(embedded.tokenize_chat(QUESTION)) == here.prompt_tokens
    assert reply.usage.completion_tokens == here.completion_tokens
    assert reply.usage.total_tokens == here.prompt_tokens + here.completion_tokens


def test_streamed_deltas_are_the_whole_answer_token_by_token(client) -> None:
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta]
    text = "".join(d for d in deltas if d)
    assert text == whole.choices[0].message.content
    assert sum(1 for d in deltas if d) >= 8  # token by token, not one chunk at the end
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_async_requests_in_flight_together_answer_as_alone(server, client) -> None:
    questions = [[{"role": "user", "content": f"Count from {i} to {i + 3}."}] for i in (1, 5, 9)]
    alone = [
        client.chat.completions.create(model=MODEL, messages=q, max_tokens=12)
        .choices[0]
        .message.content
        for q in questions
    ]

    async def together() -> list[str | None]:
        aclient = openai.AsyncOpenAI(base_url=server.url, api_key=KEY, max_retries=0)
        calls = [
            aclient.chat.completions.create(model=MODEL, messages=q, max_tokens=12)
            for q in questions
        ]
        return [r.choices[0].message.content for r in await asyncio.gather(*calls)]

    assert asyncio.run(together()) == alone


def test_completion_answers_as_generate_and_stops_where_asked(client, embedded: KVBoost) -> None:
    prompt = "The three primary colours are"
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16)
    here = embedded.generate(prompt, max_new_tokens=16)
    assert reply.choices[0].text == here.text and len(here.text) >= 8
    assert reply.object == "text_completion"
    stop = here.text[5:8]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop])
    assert cut.choices[0].text == here.text[: here.text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == here.text


def test_n_answers_with_a_seed_differ_and_repeat(client) -> None:
    def ask() -> list[str | None]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=QUESTION, max_tokens=10, n=2, temperature=1.0, seed=7
        )
        reply = raw.parse()
        assert [c.index for c in reply.choices] == [0, 1]
        # OpenAI's usage counts the prompt once; the engine's account, each answer's request
        usage = json.loads(raw.text)["usage"]
        assert usage["kvboost"]["answers"] == 2
        assert usage["kvboost"]["prompt_tokens"] == 2 * usage["prompt_tokens"]
        return [c.message.content for c in reply.choices]

    first = ask()
    assert first == ask()
    assert first[0] != first[1]


def test_a_repeated_prompt_reads_its_tokens_from_the_cache(client) -> None:
    messages = [
        {"role": "system", "content": "You answer questions about geography briefly. " * 8},
        {"role": "user", "content": "Which ocean lies west of Portugal?"},
    ]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    again = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4
    )
    usage = json.loads(again.text)["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached > usage["prompt_tokens"] // 2
    assert usage["kvboost"]["reused_tokens"] == cached
    assert (
        usage["kvboost"]["reused_tokens"] + usage["kvboost"]["recomputed_tokens"]
        == (usage["prompt_tokens"])
    )
    assert isinstance(usage["kvboost"]["reuse_reason"], str) and usage["kvboost"]["reuse_reason"]


def test_a_forced_tool_call_comes_back_in_openai_shape(client) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice=choice, max_tokens=40
    )
    answer = reply.choices[0]
    assert answer.finish_reason == "tool_calls"
    (call,) = answer.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice=choice,
        max_tokens=40,
        stream=True,
    )
    calls = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [(tc.index, tc.function.name) for tc in calls] == [(0, "get_weather")]
    assert json.loads(calls[0].function.arguments) == json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_schema_that_cannot_be_constrained_is_a_400_naming_it(client, stream) -> None:
    """A forced call to parameters that point at the call's own root was answered 200 with
    a call named "" (issue 64): refused before any stream opens, the field named."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=[WEATHER, tool],
            tool_choice="required",
            max_tokens=8,
            stream=stream,
        )
    error = refused.value.body
    assert refused.value.status_code == 400 and error["param"] == "tools.1", error
    assert error["message"].startswith("tools[1] parameters: $ref '#' points inside"), error
    assert "\n" not in error["message"] and len(error["message"]) < 300, error


def test_a_conversation_with_a_tool_result_is_answered(client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."},
    ]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=16
    )
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert not reply.choices[0].message.tool_calls


def test_a_json_schema_answer_is_valid_against_it(client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "country": {"type": "string", "maxLength": 16},
        },
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give a city and its country as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        max_tokens=60,
    )
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_requests_without_the_key_are_refused(server) -> None:
    for key in ("", "wrong-key", KEY + "x"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(f"{server.url}/chat/completions", json={}, headers=headers)
        assert response.status_code == 401, key
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0).models.list()
    assert httpx.get(f"{server.root}/health").json()["status"] == "ok"  # probes need no key


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)


def _post(server: ServerProcess, content: bytes | object, path: str = "/chat/completions"):
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def test_bodies_over_the_limit_are_refused_declared_or_chunked(server) -> None:
    big = json.dumps({"model": MODEL, "messages": QUESTION, "pad": "x" * BODY_LIMIT}).encode()
    assert _post(server, big).status_code == 413
    chunks = (big[i : i + 4096] for i in range(0, len(big), 4096))  # no Content-Length
    response = _post(server, chunks)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


MALFORMED = [
    b"{",
    b"",
    b"[]",
    b"null",
    b'{"model": "smollm2-135m-instruct"}',
    b'{"model": "smollm2-135m-instruct", "messages": "hello"}',
    b'{"model": "smollm2-135m-instruct", "messages": []}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "robot", "content": "x"}]}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": 3}]}',
    b'{"model": 5, "messages": [{"role": "user", "content": "x"}]}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"temperature": "hot"}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"max_tokens": -1}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"stream": "yes"}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"tool_choice": "required"}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"response_format": {"type": "xml"}}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "x"}], '
    b'"logit_bias": {"5": 10}}',
    b'{"model": "smollm2-135m-instruct", "messages": [{"role": "assistant", "content": null, '
    b'"tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", '
    b'"arguments": "{not json"}}]}, {"role": "user", "content": "x"}]}',
    b"\xff\xfe\x00",
]


@pytest.mark.parametrize("body", MALFORMED, ids=range(len(MALFORMED)))
def test_malformed_bodies_get_a_400_in_openai_shape(server, body: bytes) -> None:
    response = _post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in response.text and 'File "' not in response.text


def test_unknown_routes_and_methods_get_openai_errors(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    for method, path, status in [
        ("GET", "/v1/embeddings", 404),
        ("GET", "/v1/chat/completions", 405),
        ("POST", "/v1/completions/x", 404),
    ]:
        response = httpx.request(method, f"{server.root}{path}", headers=headers)
        assert response.status_code == status, path
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_the_server_shuts_down_cleanly(server) -> None:
    """Last in the module: SIGTERM ends it with status 0 and no traceback in its log."""
    assert server.stop() == 0
    assert "Traceback" not in server.log, server.log
