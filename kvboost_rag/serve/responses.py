"""OpenAI's answer bodies: whole (``chat.completion``, ``text_completion``) and as the SSE
chunks of a stream (``chat.completion.chunk``; text completions stream ``text_completion``
objects)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from kvboost_rag.core.results import GenerationResult
from kvboost_rag.serve.errors import APIError, engine_error, error_body
from kvboost_rag.serve.generation import Generation, RequestTimeout
from kvboost_rag.serve.translate import finish_reason, tool_calls, usage

__all__ = ["Reply", "answer", "events", "timeout_error"]

DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class Reply:
    """What every body or chunk of one answer repeats."""

    kind: Literal["chat", "text"]
    model: str
    n: int  # answers per prompt
    include_usage: bool = False  # a last chunk with usage (stream_options.include_usage)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def head(self, object_: str) -> dict[str, Any]:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return {
            "id": f"{prefix}-{self.id}",
            "object": object_,
            "created": self.created,
            "model": self.model,
        }


def timeout_error(seconds: float) -> APIError:
    return APIError(504, f"the request ran past the server's {seconds:g} s limit", code="timeout")


def answer(reply: Reply, results: list[GenerationResult]) -> dict[str, Any]:
    """The whole answer's body."""
    if reply.kind == "chat":
        choices = [_chat_choice(i, r) for i, r in enumerate(results)]
        body = reply.head("chat.completion")
    else:
        choices = [_text_choice(i, r.text, finish_reason(r)) for i, r in enumerate(results)]
        body = reply.head("text_completion")
    return {**body, "choices": choices, "usage": usage(results, reply.n)}


def _chat_choice(index: int, result: GenerationResult) -> dict[str, Any]:
    calls = tool_calls(result)
    # OpenAI's content is null beside calls when the model wrote nothing else.
    message: dict[str, Any] = {"role": "assistant", "content": result.text or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:
        message["content"] = ""
    return {"index": index, "message": message, "finish_reason": finish_reason(result)}


def _text_choice(index: int, text: str, finish: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


async def events(
    reply: Reply, generation: Generation, deadline: float, timeout_s: float
) -> AsyncIterator[str]:
    """The SSE lines of a streamed answer: each delta as the executor decodes it, then each
    answer's calls and finish reason, usage if asked, and ``[DONE]``. A failure after the
    first line is an ``{"error": ...}`` event (the status was sent already)."""
    answers = len(generation.streams)
    if reply.kind == "chat":
        for i in range(answers):
            yield _sse(_chunk(reply, i, {"role": "assistant", "content": ""}))
    try:
        async for index, delta in generation.deltas(deadline):
            yield _sse(_chunk(reply, index, delta))
    except RequestTimeout:
        yield _sse(_error(timeout_error(timeout_s)))
        return
    except Exception as error:
        yield _sse(_error(engine_error(error)))
        return
    results = generation.results
    for i, result in enumerate(results):
        for line in _ending(reply, i, result):
            yield _sse(line)
    if reply.include_usage:
        yield _sse({**_chunk_head(reply), "choices": [], "usage": usage(results, reply.n)})
    yield DONE


def _ending(reply: Reply, index: int, result: GenerationResult) -> list[dict[str, Any]]:
    """An answer's last chunks: its tool calls (each whole, in one delta), its finish."""
    calls = tool_calls(result) if reply.kind == "chat" else []
    lines = []
    if calls:
        delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        lines.append(_chunk(reply, index, delta))
    lines.append(_chunk(reply, index, {} if reply.kind == "chat" else "", finish_reason(result)))
    return lines


def _chunk_head(reply: Reply) -> dict[str, Any]:
    return reply.head("chat.completion.chunk" if reply.kind == "chat" else "text_completion")


def _chunk(
    reply: Reply, index: int, delta: dict[str, Any] | str, finish: str | None = None
) -> dict[str, Any]:
    """One chunk of answer ``index``: a chat delta (a text delta is its content), or the
    text of a text completion."""
    if reply.kind == "text":
        assert isinstance(delta, str)
        return {**_chunk_head(reply), "choices": [_text_choice(index, delta, finish)]}
    if isinstance(delta, str):
        delta = {"content": delta}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**_chunk_head(reply), "choices": [choice]}


def _error(error: APIError) -> dict[str, Any]:
    return error_body(error.status, error.message, error.code, error.param)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
