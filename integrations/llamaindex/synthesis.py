"""Retrieved nodes reach the LLM as whole marked passages, in every response mode.

LlamaIndex's synthesizers turn nodes into ``context_str`` themselves: compact and
tree_summarize join every node and re-split the text on spaces to fill the window (cutting
nodes, with overlap), simple_summarize truncates the joined text and refine re-splits each
node when it does not fit. ``PassageSynthesizer`` marks each node as a passage, and
``PassagePromptHelper`` (which all four modes use to pack and truncate) moves only whole
passages, counting the model's own tokens. The node text is laid out as ``format_passages``
lays it out, so a corpus warmed with ``warm_corpus`` is reused as is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core import get_response_synthesizer
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.indices.prompt_helper import DEFAULT_PADDING, PromptHelper
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE

from kvboost_rag.core.chunker import CLOSE, OPEN, parse_segments, passage
from kvboost_rag.core.errors import KVBoostError
from kvboost_rag.core.prompts import PASSAGE_SEPARATOR
from kvboost_rag.integrations.llamaindex.llm import ENGINE_ERRORS, KVBoostLLM

RESPONSE_MODES = ("compact", "refine", "tree_summarize", "simple_summarize")


def mark_text(text: str) -> str:
    """A node's text as one passage, laid out as ``format_passages`` lays it out."""
    return passage(text + PASSAGE_SEPARATOR)


def mark_nodes(nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
    """Copies of ``nodes`` whose content is marked (metadata the LLM sees stays in front,
    outside the passage, so the passage equals the node text ``warm_corpus`` warmed)."""
    marked = []
    for item in nodes:
        node = item.node.model_copy(deep=True)
        node.set_content(mark_text(item.node.get_content()))
        marked.append(NodeWithScore(node=node, score=item.score))
    return marked


class _ModelTokens:
    """The model's token ids for text as the engine sees it (markers removed)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        plain = text.replace(OPEN, "").replace(CLOSE, "")
        return list(self.tokenizer(plain, add_special_tokens=False)["input_ids"])


class PassagePromptHelper(PromptHelper):
    """Packs and truncates text chunks at passage boundaries only, never inside a passage.

    ``repack`` (compact, refine, tree_summarize) groups whole passages into as few chunks
    as fit the window; ``truncate`` (simple_summarize) drops the passages that do not fit.
    A passage longer than the room stays whole in a chunk of its own (the engine raises
    ``ContextWindowError`` if it cannot fit the model). Chunks without passages (tree
    summaries) go through LlamaIndex's own splitting.
    """

    @classmethod
    def from_llm(cls, llm: KVBoostLLM, **kwargs: Any) -> PassagePromptHelper:
        meta = llm.metadata
        return cls(
            context_window=meta.context_window - _template_tokens(llm),
            num_output=meta.num_output,
            tokenizer=_ModelTokens(llm.engine.tokenizer),
            **kwargs,
        )  # type: ignore[call-arg]

    def repack(
        self,
        prompt: BasePromptTemplate,
        text_chunks: Sequence[str],
        padding: int = DEFAULT_PADDING,
        llm: Any = None,
        tools: Any = None,
    ) -> list[str]:
        if not any(OPEN in chunk for chunk in text_chunks):
            return super().repack(prompt, text_chunks, padding, llm, tools)
        room = self._get_available_chunk_size(prompt, 1, padding, llm, tools)
        return _pack(_units(text_chunks), room, self._token_counter.get_string_tokens)

    def truncate(
        self,
        prompt: BasePromptTemplate,
        text_chunks: Sequence[str],
        padding: int = DEFAULT_PADDING,
        llm: Any = None,
        tools: Any = None,
    ) -> list[str]:
        if not any(OPEN in chunk for chunk in text_chunks):
            return super().truncate(prompt, text_chunks, padding, llm, tools)
        room = self._get_available_chunk_size(prompt, len(text_chunks), padding, llm, tools)
        count = self._token_counter.get_string_tokens
        return _JoinedText(_pack(_units([chunk]), room, count)[0] for chunk in text_chunks)


class _JoinedText(list):  # type: ignore[type-arg]
    """simple_summarize formats the list ``truncate`` returns straight into ``context_str``
    (``str(list)``: brackets, quotes and escaped newlines, so no passage would match its
    cached tokens). As text, this list is its items joined."""

    def __str__(self) -> str:
        return "".join(self)

    def __format__(self, spec: str) -> str:
        return format(str(self), spec)


def _template_tokens(llm: KVBoostLLM) -> int:
    """Tokens a chat template adds around the messages LlamaIndex counts (its default
    system prompt included), kept free so packed chunks fit the model."""
    if not llm.metadata.is_chat_model:
        return 0
    return len(llm.engine.tokenize_chat([{"role": "user", "content": ""}]))


def _units(chunks: Sequence[str]) -> list[str]:
    """Each marked passage with the text in front of it (a node's metadata header).
    Whitespace between passages is dropped: each passage already ends with a blank line."""
    units: list[str] = []
    for chunk in chunks:
        lead = ""
        for segment in parse_segments(chunk):
            if segment.kind == "passage":
                units.append((lead if lead.strip() else "") + passage(segment.text))
                lead = ""
            else:
                lead += segment.text
        if lead.strip():  # text after the last passage, or a chunk without one
            units.append(lead.strip() + PASSAGE_SEPARATOR)
    return units


def _pack(units: list[str], room: int, count: Callable[[str], int]) -> list[str]:
    """Consecutive units joined into chunks of at most ``room`` tokens, in order."""
    chunks: list[str] = []
    current, used = "", 0
    for unit in units:
        size = count(unit)
        if current and used + size > room:
            chunks.append(current)
            current, used = "", 0
        current, used = current + unit, used + size
    if current or not chunks:
        chunks.append(current)
    return chunks


class PassageSynthesizer(BaseSynthesizer):
    """Wraps a LlamaIndex synthesizer: nodes go in marked as passages, the response's
    ``source_nodes`` are the nodes as retrieved (unmarked). Prompts are the inner
    synthesizer's (``get_prompts`` / ``update_prompts`` reach them unchanged)."""

    def __init__(self, inner: BaseSynthesizer) -> None:
        super().__init__(
            llm=inner._llm,
            callback_manager=inner.callback_manager,
            prompt_helper=inner._prompt_helper,
            streaming=inner._streaming,
        )
        self._inner = inner

    @property
    def inner(self) -> BaseSynthesizer:
        return self._inner

    def synthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        noted: list[KVBoostError] = []
        token = ENGINE_ERRORS.set(noted)
        try:
            response = self._inner.synthesize(
                query, mark_nodes(nodes), additional_source_nodes, **response_kwargs
            )
        finally:
            ENGINE_ERRORS.reset(token)
        return _with_sources(response, nodes, additional_source_nodes, noted)

    async def asynthesize(
        self,
        query: QueryType,
        nodes: list[NodeWithScore],
        additional_source_nodes: Sequence[NodeWithScore] | None = None,
        **response_kwargs: Any,
    ) -> RESPONSE_TYPE:
        noted: list[KVBoostError] = []
        token = ENGINE_ERRORS.set(noted)
        try:
            response = await self._inner.asynthesize(
                query, mark_nodes(nodes), additional_source_nodes, **response_kwargs
            )
        finally:
            ENGINE_ERRORS.reset(token)
        return _with_sources(response, nodes, additional_source_nodes, noted)

    def get_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        marked = [mark_text(chunk) for chunk in text_chunks]
        return self._inner.get_response(query_str, marked, **response_kwargs)

    async def aget_response(
        self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any
    ) -> RESPONSE_TEXT_TYPE:
        marked = [mark_text(chunk) for chunk in text_chunks]
        return await self._inner.aget_response(query_str, marked, **response_kwargs)

    def _get_prompts(self) -> dict[str, Any]:
        return self._inner.get_prompts()

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        self._inner.update_prompts(prompts)


def _with_sources(
    response: RESPONSE_TYPE,
    nodes: Sequence[NodeWithScore],
    additional: Sequence[NodeWithScore] | None,
    errors: list[KVBoostError],
) -> RESPONSE_TYPE:
    """The response with the nodes as retrieved; an engine error LlamaIndex swallowed is
    raised instead."""
    if errors:
        raise errors[0]
    response.source_nodes = [*nodes, *(additional or [])]
    return response


def passage_synthesizer(
    llm: KVBoostLLM, response_mode: str = "compact", **kwargs: Any
) -> PassageSynthesizer:
    """``get_response_synthesizer(llm=llm, response_mode=..., **kwargs)`` that hands the
    LLM whole marked passages: compact, refine, tree_summarize or simple_summarize."""
    if response_mode not in RESPONSE_MODES:
        raise ValueError(f"response_mode must be one of {RESPONSE_MODES}, got {response_mode!r}")
    if not isinstance(llm, KVBoostLLM):
        raise TypeError(f"llm must be a KVBoostLLM, got {type(llm).__name__}")
    kwargs.setdefault("prompt_helper", PassagePromptHelper.from_llm(llm))
    inner = get_response_synthesizer(llm=llm, response_mode=response_mode, **kwargs)  # type: ignore[arg-type]
    return PassageSynthesizer(inner)


SYNTHESIZER_ARGS = (
    "text_qa_template",
    "refine_template",
    "summary_template",
    "simple_template",
    "streaming",
    "use_async",
    "verbose",
    "output_cls",
    "structured_answer_filtering",
)


def passage_query_engine(
    index: Any, llm: KVBoostLLM, response_mode: str = "compact", **kwargs: Any
) -> RetrieverQueryEngine:
    """``index.as_query_engine(llm=llm, response_mode=..., **kwargs)`` whose synthesizer is
    a ``passage_synthesizer``: retriever options (``similarity_top_k``...) and
    ``node_postprocessors`` go to the index, prompt and streaming options to the synthesizer."""
    synth_kwargs = {k: kwargs.pop(k) for k in SYNTHESIZER_ARGS if k in kwargs}
    synthesizer = passage_synthesizer(llm, response_mode, **synth_kwargs)
    return index.as_query_engine(llm=llm, response_synthesizer=synthesizer, **kwargs)  # type: ignore[no-any-return]
