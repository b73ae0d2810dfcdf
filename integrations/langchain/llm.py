"""``KVBoostPipeline``: a LangChain text-completion LLM whose prompts reuse cached passage KV."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Iterator
from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from kvboost_rag.core.results import GenerationResult
from kvboost_rag.documents import document_texts
from kvboost_rag.integrations._common import aiter_thread, concurrently, in_thread
from kvboost_rag.integrations.langchain._fields import KVBoostFields


class KVBoostPipeline(KVBoostFields, BaseLLM):
    """A local HF model as a completion LLM that computes each retrieved passage's KV once.

    Drop-in for ``HuggingFacePipeline``. Mark passages with ``format_passages(docs)`` /
    ``stuff_documents_kwargs()`` in the prompt, or pass ``documents=`` to ``invoke`` /
    ``bind`` (placed before the prompt). Each generation's ``generation_info`` carries
    ``ttft_ms``, ``kv_reuse_ratio``, passages hit/missed and token counts; ``llm_output``
    sums the token usage.
    """

    # Set here: pydantic takes the last base's config, and LangChain's ignores extras.
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    @property
    def _llm_type(self) -> str:
        return "kvboost"

    _ls_model_type = "llm"

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        def one(prompt: str) -> Generation:
            if self.streaming:
                chunks = list(self._stream(prompt, stop, run_manager, **kwargs))
                text = "".join(c.text for c in chunks)
                return Generation(text=text, generation_info=chunks[-1].generation_info)
            options, documents = self._request(stop, kwargs)
            result = self.kv_engine.generate(prompt, passages=_texts(documents), **options)
            return Generation(text=result.text, generation_info=self._stats(result))

        # LangChain's batch() hands every prompt to one call: they decode in one batch.
        results = concurrently(one, prompts)
        return LLMResult(generations=[[g] for g in results], llm_output=_usage(results))

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        if self.streaming:

            async def one(prompt: str) -> Generation:
                chunks = [c async for c in self._astream(prompt, stop, run_manager, **kwargs)]
                text = "".join(c.text for c in chunks)
                return Generation(text=text, generation_info=chunks[-1].generation_info)

            generations = list(await asyncio.gather(*(one(p) for p in prompts)))
            return LLMResult(generations=[[g] for g in generations], llm_output=_usage(generations))
        return await in_thread(self._generate, prompts, stop, None, **kwargs)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        for chunk in self._chunks(prompt, stop, kwargs):
            if run_manager and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        chunks = self._chunks(prompt, stop, kwargs)
        async for chunk in aiter_thread(chunks, close=chunks.close):
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunks(
        self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]
    ) -> Generator[GenerationChunk, None, None]:
        """Text deltas as they decode, then an empty chunk carrying the statistics.
        Closing this generator early cancels the generation."""
        options, documents = self._request(stop, kwargs)
        stream = self.kv_engine.stream(prompt, passages=_texts(documents), **options)
        for delta in stream:
            yield GenerationChunk(text=delta)
        result = stream.result
        assert isinstance(result, GenerationResult)
        yield GenerationChunk(text="", generation_info=self._stats(result))


def _texts(documents: list[Any]) -> list[str] | None:
    return document_texts(documents) or None


def _usage(generations: list[Generation]) -> dict[str, Any]:
    infos = [g.generation_info or {} for g in generations]
    prompt = sum(i.get("prompt_tokens", 0) for i in infos)
    completion = sum(i.get("completion_tokens", 0) for i in infos)
    return {
        "model_name": infos[0].get("model_name") if infos else None,
        "token_usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "cached_tokens": sum(i.get("reused_tokens", 0) for i in infos),
        },
    }
