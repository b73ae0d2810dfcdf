"""``ChatKVBoost``: a LangChain chat model whose prompts reuse cached passage KV."""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import BaseModel, ConfigDict

from kvboost_rag.core.results import GenerationResult
from kvboost_rag.integrations._common import aiter_thread, in_thread
from kvboost_rag.integrations.langchain._fields import FORM_OPTIONS, TOOL_OPTIONS, KVBoostFields
from kvboost_rag.integrations.langchain.messages import (
    ai_message,
    engine_messages,
    tool_call_chunks,
    usage,
)
from kvboost_rag.integrations.langchain.structured import StructuredMethod, structured_output
from kvboost_rag.integrations.langchain.tools import engine_tools


class ChatKVBoost(KVBoostFields, BaseChatModel):
    """A local HF chat model that computes each retrieved passage's KV once.

    Mark passages with ``format_passages(docs)`` / ``stuff_documents_kwargs()`` in the
    prompt, or pass ``documents=`` to ``invoke`` / ``bind`` (they go before the last user
    message). ``usage_metadata.input_token_details.cache_read`` counts reused prompt tokens;
    ``response_metadata`` carries ``ttft_ms``, ``kv_reuse_ratio`` and passages hit/missed.

    ``bind_tools`` and ``with_structured_output`` decode calls and JSON under a grammar, so
    they are valid even from a small model; each agent step's prompt extends the last one
    and reads it from the cache. ``retriever_tool`` returns documents as marked passages.

    >>> chat = ChatKVBoost.from_model_id("smollm2-135m-instruct", max_tokens=64)  # doctest: +SKIP
    """

    # Set here: pydantic takes the last base's config, and LangChain's ignores extras.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    _ls_model_type = "chat"
    _form_options = FORM_OPTIONS + TOOL_OPTIONS

    def bind_tools(
        self,
        tools: Sequence[Any],
        *,
        tool_choice: Any = None,
        parallel_tool_calls: bool | None = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """This model offered ``tools`` (BaseTools, pydantic classes, TypedDicts, functions,
        OpenAI dicts); its calls come back in ``AIMessage.tool_calls``.

        ``tool_choice``: None / "auto" (text or a call), "any" / "required" / True (a call),
        "none" (text), or a tool's name (that tool; also as ``{"type": "function",
        "function": {"name": ...}}``). ``parallel_tool_calls``: several calls per answer
        (default one). ``strict``: True decodes under the tools' grammar, so calls always
        match their schemas; False lets the model write freely (calls are still parsed);
        None keeps the engine's ``config.constrained_decoding`` (on by default).
        """
        options = engine_tools(tools, tool_choice)  # checked now, not at the first call
        if parallel_tool_calls is not None:
            options["parallel_tool_calls"] = parallel_tool_calls
        if strict is not None:
            options["constrain"] = strict
        return self.bind(**options, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: StructuredMethod = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict[str, Any] | BaseModel]:
        """This model answering with an instance of ``schema`` (a pydantic class) or a dict
        (a TypedDict, JSON schema or OpenAI function dict).

        ``method``: "function_calling" (a forced call of ``schema`` as a tool: the model
        sees its description and field docs), "json_schema" (JSON decoded under the
        schema's grammar) or "json_mode" (any JSON object; say the keys in the prompt).
        ``include_raw``: return ``{"raw", "parsed", "parsing_error"}`` instead of raising
        when the answer cannot be parsed. ``strict`` as in ``bind_tools``.
        """
        if kwargs:
            raise ValueError(f"unsupported argument(s) {sorted(kwargs)}")
        return structured_output(self, schema, method, include_raw, strict)

    def batch(
        self,
        inputs: list[LanguageModelInput],
        config: RunnableConfig | list[RunnableConfig] | None = None,
        *,
        return_exceptions: bool = False,
        **kwargs: Any,
    ) -> list[AIMessage]:
        """As LangChain's ``batch``, with every input in flight at once unless the config
        sets ``max_concurrency`` (LangChain's default pool has cores + 4 threads), so the
        engine decodes them in one batch."""
        configs = config if isinstance(config, list) else [config or {}] * len(inputs)
        configs = [{"max_concurrency": len(inputs), **c} for c in configs]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)  # type: ignore[arg-type]

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        options, documents = self._request(stop, kwargs)
        result = self.kv_engine.chat(engine_messages(messages, documents), **options)
        stats = self._stats(result)
        generation = ChatGeneration(
            message=ai_message(result, stats),
            generation_info={"finish_reason": stats["finish_reason"]},
        )
        return ChatResult(generations=[generation], llm_output=stats)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # In a worker thread; concurrent requests decode together in the engine's batch.
        return await in_thread(self._generate, messages, stop, None, **kwargs)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._chunks(messages, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        chunks = self._chunks(messages, stop, kwargs)
        async for chunk in aiter_thread(chunks, close=chunks.close):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunks(
        self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Generator[ChatGenerationChunk, None, None]:
        """Content deltas as they decode, then one last chunk with the tool calls, usage and
        statistics. Closing this generator early cancels the generation."""
        options, documents = self._request(stop, kwargs)
        stream = self.kv_engine.stream_chat(engine_messages(messages, documents), **options)
        for delta in stream:
            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
        result = stream.result
        assert isinstance(result, GenerationResult)
        stats = self._stats(result)
        last = AIMessageChunk(
            content="",
            tool_call_chunks=tool_call_chunks(result),
            usage_metadata=usage(result),
            response_metadata=stats,
            chunk_position="last",
        )
        yield ChatGenerationChunk(
            message=last, generation_info={"finish_reason": stats["finish_reason"]}
        )
