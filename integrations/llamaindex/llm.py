"""``KVBoostLLM``: the engine as a LlamaIndex function-calling LLM, so query engines reuse
passage KV and agents call tools under constrained decoding."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM

from kvboost_rag.core.config import Fidelity
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.errors import KVBoostError
from kvboost_rag.core.generation.streaming import GenerationStream
from kvboost_rag.core.results import GenerationResult
from kvboost_rag.integrations._common import (
    DEFAULT_MODEL,
    SAMPLING_OPTIONS,
    SamplingFields,
    aiter_thread,
    check_engine_fidelity,
    in_thread,
    load_engine,
    result_stats,
)
from kvboost_rag.integrations.llamaindex.function_calling import (
    TOOL_OPTIONS,
    ToolCalling,
    tool_specs,
)
from kvboost_rag.integrations.llamaindex.messages import engine_messages, response_message

# What chat takes beside sampling options; complete takes only the JSON format.
CHAT_OPTIONS = (*TOOL_OPTIONS, "response_format")

# LlamaIndex's refine loop (compact and refine modes) logs ValueErrors raised by the LLM
# and answers "Empty Response". Engine errors are ValueErrors (a prompt over the context
# window, broken markers), so while a PassageSynthesizer runs they are also noted here,
# and it raises them once LlamaIndex returns.
ENGINE_ERRORS: ContextVar[list[KVBoostError] | None] = ContextVar(
    "kvboost_engine_errors", default=None
)


@contextmanager
def noting_engine_errors() -> Iterator[None]:
    try:
        yield
    except KVBoostError as error:
        noted = ENGINE_ERRORS.get()
        if noted is not None:
            noted.append(error)
        raise


class KVBoostLLM(SamplingFields, ToolCalling, FunctionCallingLLM):
    """A local HF model whose passage KV is computed once and reused at any position.

    Text inside ``kvboost_rag.passage()`` markers (what ``PassageSynthesizer`` puts around
    each retrieved node, and ``retriever_tool`` around each node it returns) is served from
    the passage cache. Tools (``chat_with_tools``, ``FunctionAgent``, ``structured_predict``)
    are called under constrained decoding, so calls are always valid. Every answer carries
    its timing and reuse statistics in ``additional_kwargs``; ``last_stats`` holds the
    latest ones.
    """

    # An unknown field is an error, not ignored (LlamaIndex's LLMs accept and drop them:
    # max_new_tokens=12 decoded 256 tokens).
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model_name: str = Field(
        default=DEFAULT_MODEL, description="The model's name or path (reported in metadata)."
    )
    fidelity: Fidelity | None = Field(
        default=None,
        description="exact, balanced or fast; must match a wrapped engine's (None: its own).",
    )
    context_window: int | None = Field(
        default=None, gt=0, description="Tokens the model attends to; None: the model's."
    )
    is_chat_model: bool | None = Field(
        default=None,
        description="Answer chat through the tokenizer's chat template; None: when it has one.",
    )

    _engine: KVBoost = PrivateAttr()
    _last_stats: dict[str, Any] | None = PrivateAttr(default=None)

    def __init__(self, engine: KVBoost | None = None, **fields: Any) -> None:
        if not isinstance(engine, KVBoost):
            raise TypeError(
                "KVBoostLLM wraps an engine: KVBoostLLM(engine=KVBoost.from_pretrained(...)), "
                "or load one with KVBoostLLM.from_model_id(model_id)"
            )
        check_engine_fidelity(engine, fields.get("fidelity"))
        fields["fidelity"] = engine.config.fidelity
        window = fields.get("context_window") or engine.context_window
        if window > engine.context_window:
            raise ValueError(
                f"context_window={window} exceeds the model's {engine.context_window} tokens"
            )
        fields["context_window"] = window
        if fields.get("is_chat_model") is None:
            fields["is_chat_model"] = getattr(engine.tokenizer, "chat_template", None) is not None
        fields.setdefault("model_name", engine.name)
        super().__init__(**fields)
        self._engine = engine

    @classmethod
    def from_model_id(
        cls,
        model_id: str = DEFAULT_MODEL,
        *,
        fidelity: str | None = None,
        dtype: Any = None,
        device: Any = None,
        weights: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        **fields: Any,
    ) -> KVBoostLLM:
        """Load ``model_id`` (an embedded alias, a local path or an HF id) into a new engine
        (``weights``: "int8" / "int4" / "int8-dynamic" to store the linear weights quantized,
        on a CPU)."""
        engine = load_engine(
            model_id,
            fidelity=fidelity,
            dtype=dtype,
            device=device,
            weights=weights,
            **(model_kwargs or {}),
        )
        return cls(engine=engine, model_name=model_id, fidelity=fidelity, **fields)

    @classmethod
    def class_name(cls) -> str:
        return "KVBoostLLM"

    @property
    def engine(self) -> KVBoost:
        """The wrapped engine (``warm_corpus(llm, nodes)`` warms it)."""
        return self._engine

    @property
    def last_stats(self) -> dict[str, Any] | None:
        """Statistics of the latest answer that finished (see ``result_stats``)."""
        return self._last_stats

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=cast(int, self.context_window),
            num_output=self.max_tokens,
            is_chat_model=bool(self.is_chat_model),
            is_function_calling_model=bool(self.is_chat_model),
            model_name=self.model_name,
        )

    # -- LlamaIndex's endpoints: each one translates, the engine does the work ----------

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        return self._completion_chunks(self._open_stream(prompt, formatted, kwargs))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        """Content deltas (a tool call being written is held back); the last chunk has
        an empty delta and carries the whole answer, tool calls included, and its stats."""
        return self._chat_chunks(self._open_chat_stream(messages, kwargs))

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        return await in_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        stream = await in_thread(self._open_stream, prompt, formatted, kwargs)
        return cast(
            CompletionResponseAsyncGen,
            aiter_thread(self._completion_chunks(stream), close=stream.close),
        )

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await in_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        stream = await in_thread(self._open_chat_stream, messages, kwargs)
        chunks = self._chat_chunks(stream)
        return cast(ChatResponseAsyncGen, aiter_thread(chunks, close=stream.close))

    # -- translation ---------------------------------------------------------------------

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        with noting_engine_errors():
            result = self._engine.generate(self._prompt(prompt, formatted), **self._options(kwargs))
        return CompletionResponse(text=result.text, additional_kwargs=self._record(result))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        with noting_engine_errors():
            result = self._chat_request(messages, kwargs, stream=False)
        return ChatResponse(
            message=response_message(result), additional_kwargs=self._record(result)
        )

    def _open_stream(
        self, prompt: str, formatted: bool, kwargs: dict[str, Any]
    ) -> GenerationStream:
        with noting_engine_errors():
            return self._engine.stream(self._prompt(prompt, formatted), **self._options(kwargs))

    def _open_chat_stream(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> GenerationStream:
        with noting_engine_errors():
            return self._chat_request(messages, kwargs, stream=True)

    def _chat_request(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any], stream: bool
    ) -> Any:
        """The engine's chat (through the chat template) or, without a template, its
        completion of ``messages_to_prompt``; a stream when ``stream``."""
        options = self._options(kwargs, CHAT_OPTIONS)
        tools = tool_specs(options.pop("tools", None) or [])
        if self.is_chat_model:
            run = self._engine.stream_chat if stream else self._engine.chat
            return run(engine_messages(messages), tools=tools, **options)
        if tools:
            raise ValueError("tools need a chat template; this KVBoostLLM has is_chat_model=False")
        options = {k: v for k, v in options.items() if k not in TOOL_OPTIONS}
        complete = self._engine.stream if stream else self._engine.generate
        return complete(self._messages_prompt(messages), **options)

    def _completion_chunks(
        self, stream: GenerationStream
    ) -> Generator[CompletionResponse, None, None]:
        """Cumulative ``text`` and the new ``delta`` per chunk; a last chunk with an empty
        delta carries the statistics, which exist only once generation ends."""
        text = ""
        for delta in stream:
            text += delta
            yield CompletionResponse(text=text, delta=delta)
        result = cast(GenerationResult, stream.result)
        yield CompletionResponse(text=result.text, delta="", additional_kwargs=self._record(result))

    def _chat_chunks(self, stream: GenerationStream) -> Generator[ChatResponse, None, None]:
        """As ``_completion_chunks``; the last chunk's message also has the tool calls."""
        text = ""
        for delta in stream:
            text += delta
            yield ChatResponse(
                message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta
            )
        result = cast(GenerationResult, stream.result)
        yield ChatResponse(
            message=response_message(result), delta="", additional_kwargs=self._record(result)
        )

    def _prompt(self, prompt: str, formatted: bool) -> str:
        """A raw prompt gets the system prompt, query wrapper and ``completion_to_prompt``;
        a formatted one (from ``predict``) already has them."""
        if formatted:
            return prompt
        return cast(Any, self.completion_to_prompt)(self._extend_prompt(prompt))

    def _messages_prompt(self, messages: Sequence[ChatMessage]) -> str:
        return str(cast(Any, self.messages_to_prompt)(messages))

    def _options(
        self, kwargs: dict[str, Any], more: Sequence[str] = ("response_format",)
    ) -> dict[str, Any]:
        """Sampling options (fields as defaults) and the request's ``more`` options."""
        taken = [*SAMPLING_OPTIONS, *more]
        unknown = sorted(set(kwargs) - set(taken))
        if unknown:
            raise TypeError(f"unknown option(s) {unknown}; KVBoostLLM takes {taken}")
        sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_OPTIONS}
        return {**self.engine_options(sampling), **{k: kwargs[k] for k in more if k in kwargs}}

    def _record(self, result: GenerationResult) -> dict[str, Any]:
        stats = result_stats(result)
        self._last_stats = stats
        return stats
