"""``ChatKVBoost``: a LangChain chat model whose prompts reuse cached passage KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict

from kvboost_rag.core.result import GenerationResult
from kvboost_rag.integrations._common import aiter_thread, documents_as_passages
from kvboost_rag.integrations.langchain._fields import KVBoostFields

_ROLES: dict[type[BaseMessage], str] = {
    SystemMessage: "system",
    HumanMessage: "user",
    AIMessage: "assistant",
}


class ChatKVBoost(KVBoostFields, BaseChatModel):
    """A local HF chat model that computes each retrieved passage's KV once.

    Mark passages with ``format_passages(docs)`` / ``stuff_documents_kwargs()`` in the
    prompt, or pass ``documents=`` to ``invoke`` / ``bind`` (they go before the last user
    message). ``usage_metadata.input_token_details.cache_read`` counts reused prompt tokens;
    ``response_metadata`` carries ``ttft_ms``, ``kv_reuse_ratio`` and passages hit/missed.

    >>> chat = ChatKVBoost.from_model_id("smollm2-135m-instruct", max_tokens=64)  # doctest: +SKIP
    """

    # Set here: pydantic takes the last base's config, and LangChain's ignores extras.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "kvboost-chat"

    _ls_model_type = "chat"

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
        message = AIMessage(
            content=result.text, usage_metadata=_usage(result), response_metadata=stats
        )
        generation = ChatGeneration(
            message=message, generation_info={"finish_reason": result.finish_reason}
        )
        return ChatResult(generations=[generation], llm_output=stats)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # The model runs in a worker thread; requests still serialize on the model's lock.
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

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
        """Text deltas as they decode, then one last chunk with usage and statistics.
        Closing this generator early cancels the generation."""
        options, documents = self._request(stop, kwargs)
        stream = self.kv_engine.stream_chat(engine_messages(messages, documents), **options)
        for delta in stream:
            yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
        result = stream.result
        assert isinstance(result, GenerationResult)
        last = AIMessageChunk(
            content="",
            usage_metadata=_usage(result),
            response_metadata=self._stats(result),
            chunk_position="last",
        )
        yield ChatGenerationChunk(
            message=last, generation_info={"finish_reason": result.finish_reason}
        )


def _usage(result: GenerationResult) -> UsageMetadata:
    return UsageMetadata(  # type: ignore[typeddict-item]  # no output details to report
        input_tokens=result.prompt_tokens,
        output_tokens=result.completion_tokens,
        total_tokens=result.prompt_tokens + result.completion_tokens,
        input_token_details={"cache_read": result.reused_tokens},
    )


def engine_messages(
    messages: Sequence[BaseMessage], documents: Sequence[Any]
) -> list[dict[str, str]]:
    """LangChain messages as chat-template dicts; ``documents`` become marked passages at
    the start of the last user message."""
    dicts = [{"role": _role(m, i), "content": _text(m, i)} for i, m in enumerate(messages)]
    if documents:
        users = [i for i, d in enumerate(dicts) if d["role"] == "user"]
        if not users:
            raise ValueError("documents= needs a user message to place the passages in")
        last = dicts[users[-1]]
        last["content"] = documents_as_passages(documents) + last["content"]
    return dicts


def _role(message: BaseMessage, index: int) -> str:
    if isinstance(message, ChatMessage):
        return message.role
    for kind, role in _ROLES.items():
        if isinstance(message, kind):
            return role
    raise ValueError(
        f"messages[{index}] is a {type(message).__name__}; ChatKVBoost takes system, human, "
        "AI and generic chat messages (it has no tool calling)"
    )


def _text(message: BaseMessage, index: int) -> str:
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(
                f"messages[{index}] has a {kind!r} content block; only text is supported"
            )
    return "".join(parts)
