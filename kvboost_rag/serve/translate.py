"""OpenAI request bodies as engine calls, and the engine's results as OpenAI's answers.

Nothing here decides how to answer: messages, tools, ``tool_choice``, ``response_format``
and sampling options are renamed into what ``KVBoost.stream_chat`` / ``stream`` take, and
the engine validates them (its ``ValueError`` is the client's 400).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import partial
from typing import Any

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.generation.sampling import MAX_SEED
from kvboost_rag.core.results import GenerationResult
from kvboost_rag.integrations._common import result_stats
from kvboost_rag.serve.generation import Opener
from kvboost_rag.serve.schemas import ChatMessage, ChatRequest, CompletionRequest, _Sampling

__all__ = [
    "chat_openers",
    "completion_openers",
    "finish_reason",
    "tool_calls",
    "usage",
]

# Counts of each answer's engine statistics that usage.kvboost sums over the answers.
SUMMED = (
    "prompt_tokens",
    "reused_tokens",
    "recomputed_tokens",
    "passages_hit",
    "passages_missed",
    "passages_unused",
    "passages_foreign",
)


def chat_openers(engine: KVBoost, body: ChatRequest) -> list[Opener]:
    """One ``stream_chat`` call per answer asked for (``n``)."""
    messages = [engine_message(m) for m in body.messages]
    form = _form(body)
    return [
        partial(engine.stream_chat, messages, **form, **options)
        for options in _options(body, body.max_completion_tokens or body.max_tokens)
    ]


def completion_openers(engine: KVBoost, body: CompletionRequest) -> list[Opener]:
    """One ``stream`` call per answer: ``n`` for each prompt, prompt by prompt (the order of
    OpenAI's choice indices)."""
    return [
        partial(engine.stream, prompt, **options)
        for prompt in body.prompts
        for options in _options(body, body.max_tokens)
    ]


def engine_message(message: ChatMessage) -> dict[str, Any]:
    """A message as the engine's chat dicts: OpenAI's "developer" is the system role of
    the chat templates; calls keep their JSON argument text (the engine parses it)."""
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.text}
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in message.tool_calls
        ]
    if message.role == "tool":
        if message.tool_call_id is not None:
            out["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            out["name"] = message.name
    return out


def _form(body: ChatRequest) -> dict[str, Any]:
    """tools / tool_choice / parallel_tool_calls / response_format as the engine takes them."""
    form: dict[str, Any] = {}
    if body.tools:
        form["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        choice = body.tool_choice or "auto"
        form["tool_choice"] = choice if isinstance(choice, str) else choice.function.name
        # One call per answer unless asked: the engine's default (OpenAI's is several).
        form["parallel_tool_calls"] = bool(body.parallel_tool_calls)
        if body.repeat_guard is not None:
            form["repeat_guard"] = body.repeat_guard
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        form["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_  # type: ignore[union-attr]
        form["response_format"] = {"type": "json_schema", "json_schema": {"schema": schema}}
    return form


def _options(body: _Sampling, max_tokens: int | None) -> list[dict[str, Any]]:
    """Sampling options for each of the ``n`` answers; with a seed, answer i takes
    seed + i, so the answers differ as OpenAI's do and each is reproducible."""
    base: dict[str, Any] = {"stop": body.stop}
    given = {"max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p}
    base.update({k: v for k, v in given.items() if v is not None})
    if body.seed is None:
        return [dict(base) for _ in range(body.n)]
    return [{**base, "seed": (body.seed + i) % (MAX_SEED + 1)} for i in range(body.n)]


def finish_reason(result: GenerationResult) -> str:
    """OpenAI's finish reason: "tool_calls" when the answer called tools; a request the
    server cancelled (shutdown) reads "stop"."""
    if result.finish_reason == "length":
        return "length"
    return "tool_calls" if (result.tool_calls or result.invalid_tool_calls) else "stop"


def tool_calls(result: GenerationResult) -> list[dict[str, Any]]:
    """The answer's calls in OpenAI's shape. A call the engine could not read (only when
    decoding is unconstrained) keeps the model's raw argument text, as OpenAI's do."""
    valid = [(c.id, c.name, json.dumps(c.arguments)) for c in result.tool_calls]
    invalid = [(c.id, c.name or "", c.arguments or "") for c in result.invalid_tool_calls]
    return [
        {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
        for id_, name, args in valid + invalid
    ]


def usage(results: Sequence[GenerationResult], n: int) -> dict[str, Any]:
    """OpenAI's usage for answers in groups of ``n`` per prompt: each prompt counted once,
    as OpenAI counts it, with the tokens the engine reused for its first answer as its
    cached tokens; under ``kvboost``, the engine's counts summed over every answer (each
    answer is a request of its own to the engine: ``n=3`` reads the prompt three times),
    with ``answers`` saying how many, and the first answer's ``ttft_ms`` and
    ``reuse_reason``."""
    firsts = results[::n]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(r.completion_tokens for r in results)
    stats = [result_stats(r) for r in results]
    kvboost: dict[str, Any] = {"answers": len(results)}
    kvboost.update({key: sum(s[key] for s in stats) for key in SUMMED})
    kvboost.update(ttft_ms=stats[0]["ttft_ms"], reuse_reason=results[0].reuse_reason)
    # Answers decoded again as text (``core/retry.py``): how many, why, and the repeated
    # calls the repeat guard withheld from them.
    kvboost.update(
        retried=[r.retried for r in results if r.retried],
        withheld_tool_calls=[w for s in stats for w in s["withheld_tool_calls"]],
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.reused_tokens for r in firsts)},
        "kvboost": kvboost,
    }
