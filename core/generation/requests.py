"""The public requests: complete a prompt, answer a conversation (with tools or a JSON
format), stream either. A part of ``KVBoost``: each call validates what it was given
before the model runs, then hands one tokenized prompt to the engine's request path."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from transformers import StopStringCriteria

from kvboost_rag.core.config import KVBoostConfig
from kvboost_rag.core.generation.result import GenerationResult
from kvboost_rag.core.generation.sampling import SamplingOptions
from kvboost_rag.core.generation.streaming import Cancelled, GenerationStream
from kvboost_rag.core.prompt.chunker import TokenizedPrompt
from kvboost_rag.core.prompt.prompts import Message, PromptEncoder
from kvboost_rag.core.tools.formats import Tool
from kvboost_rag.core.tools.structure import Structure

ResponseFormat = Mapping[str, Any]


class Requests:
    """``KVBoost``'s request methods; the engine sets these attributes and methods."""

    config: KVBoostConfig
    tokenizer: Any
    _prompts: PromptEncoder
    _run: Callable[..., GenerationResult]
    _stream: Callable[..., GenerationStream]

    def generate(
        self,
        prompt: str,
        *,
        passages: Sequence[str] | None = None,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Complete ``prompt``. Passages may be marked inside it with ``passage(text)`` or
        given as ``passages=`` (placed before it). Options: max_new_tokens, temperature,
        top_p, top_k, stop, seed; ``response_format`` / ``constrain`` as in ``chat``."""
        start = time.perf_counter()
        sampling, structure = self._request(
            options, response_format=response_format, constrain=constrain
        )
        prompt_ids = self._prompts.text(prompt, passages)
        return self._run(prompt_ids, sampling, structure, start, None, Cancelled())

    def chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = False,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
        **options: Any,
    ) -> GenerationResult:
        """Answer the last message of a conversation, using the tokenizer's chat template.

        ``tools`` (OpenAI-style dicts) are offered to the model; its calls come back in
        ``result.tool_calls`` and ``result.text`` holds the rest. ``tool_choice``: "auto",
        "required", "none" or a tool's name; one call per answer unless
        ``parallel_tool_calls``. ``response_format`` (``{"type": "json_object"}`` or
        ``{"type": "json_schema", "json_schema": {"schema": ...}}``) asks for JSON. Both
        decode under a grammar unless ``constrain=False`` (default:
        ``config.constrained_decoding``). Messages may carry ``tool_calls`` (assistant)
        and be ``{"role": "tool", "content", "tool_call_id"}`` results."""
        start = time.perf_counter()
        sampling, structure = self._request(
            options, tools, tool_choice, parallel_tool_calls, response_format, constrain
        )
        prompt = self._prompts.chat(messages, structure.tools, structure.fmt)
        return self._run(prompt, sampling, structure, start, None, Cancelled())

    def stream(
        self,
        prompt: str,
        *,
        passages: Sequence[str] | None = None,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
        **options: Any,
    ) -> GenerationStream:
        """Like ``generate`` but yields text deltas; ``.result`` is set when it ends."""
        start = time.perf_counter()
        sampling, structure = self._request(
            options, response_format=response_format, constrain=constrain
        )
        return self._stream(self._prompts.text(prompt, passages), sampling, structure, start)

    def stream_chat(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Tool] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = False,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
        **options: Any,
    ) -> GenerationStream:
        """Like ``chat`` but yields content deltas (a tool call being written is held
        back); ``.result``, with the calls, is set when it ends."""
        start = time.perf_counter()
        sampling, structure = self._request(
            options, tools, tool_choice, parallel_tool_calls, response_format, constrain
        )
        prompt = self._prompts.chat(messages, structure.tools, structure.fmt)
        return self._stream(prompt, sampling, structure, start)

    def structure(
        self,
        tools: Sequence[Tool] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = False,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
    ) -> Structure:
        """What a request asks of the answer's form, validated (``ValueError``)."""
        return Structure(
            tuple(tools or ()),
            tool_choice,
            response_format,
            self.config.constrained_decoding if constrain is None else constrain,
            self._prompts.tool_format(self.config.tool_format),
            parallel_tool_calls,
        )

    def _request(
        self,
        options: dict[str, Any],
        tools: Sequence[Tool] | None = None,
        tool_choice: str = "auto",
        parallel_tool_calls: bool = False,
        response_format: ResponseFormat | None = None,
        constrain: bool | None = None,
    ) -> tuple[SamplingOptions, Structure]:
        sampling = SamplingOptions.build(**options)
        self._check_stops(sampling.stop)
        structure = self.structure(
            tools, tool_choice, parallel_tool_calls, response_format, constrain
        )
        return sampling, structure

    def _check_stops(self, stops: tuple[str, ...]) -> None:
        """Stop strings the tokenizer cannot write could never end an answer, and
        transformers refuses them mid-request: refuse them here, before the model runs."""
        if not stops:
            return
        try:
            StopStringCriteria(self.tokenizer, list(stops))
        except ValueError as error:
            raise ValueError(
                f"stop strings {list(stops)!r} cannot be written with this tokenizer's "
                "vocabulary, so they could never end an answer; pass text the model can write"
            ) from error

    def tokenize(self, prompt: str, *, passages: Sequence[str] | None = None) -> list[int]:
        """The exact token ids the model sees for ``prompt`` (markers removed)."""
        return self._prompts.text(prompt, passages).tokens

    def tokenize_chat(
        self, messages: Sequence[Message], *, tools: Sequence[Tool] | None = None
    ) -> list[int]:
        """The exact token ids the model sees for ``messages`` and ``tools`` (markers
        removed)."""
        return self._chat_prompt(messages, tools).tokens

    def _chat_prompt(
        self, messages: Sequence[Message], tools: Sequence[Tool] | None
    ) -> TokenizedPrompt:
        structure = self.structure(tools)
        return self._prompts.chat(messages, structure.tools, structure.fmt)
