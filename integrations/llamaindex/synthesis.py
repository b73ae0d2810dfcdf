"""Retrieved nodes reach the LLM as whole marked passages, in every response mode.

LlamaIndex's synthesizers turn nodes into ``context_str`` themselves: compact and
tree_summarize join every node and re-split the text on spaces to fill the window (cutting
nodes, with overlap), simple_summarize truncates the joined text and refine re-splits each
node when it does not fit. ``PassageSynthesizer`` marks each node as a passage, and
``PassagePromptHelper`` (which all four modes use to pack and truncate) moves only whole
passages, counting the model's own tokens. A passage is the node's text alone (metadata
headers and separators stay outside it), so a corpus warmed with ``warm_corpus`` is reused
as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core import get_response_synthesizer
from llama_index.core.base.response.schema import RESPONSE_TYPE
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.response_synthesizers import BaseSynthesizer
from llama_index.core.schema import NodeWithScore, QueryType
from llama_index.core.types import RESPONSE_TEXT_TYPE

from kvboost_rag.core.errors import KVBoostError
from kvboost_rag.core.prompt.chunker import passage
from kvboost_rag.integrations.llamaindex.llm import ENGINE_ERRORS, KVBoostLLM
from kvboost_rag.integrations.llamaindex.prompt_helper import PassagePromptHelper

RESPONSE_MODES = ("compact", "refine", "tree_summarize", "simple_summarize")


def mark_text(text: str) -> str:
    """A node's text as one passage (LlamaIndex puts its own separators between nodes)."""
    return passage(text)


def mark_nodes(nodes: Sequence[NodeWithScore]) -> list[NodeWithScore]:
    """Copies of ``nodes`` whose content is marked (metadata the LLM sees stays in front,
    outside the passage, so the passage equals the node text ``warm_corpus`` warmed)."""
    marked = []
    for item in nodes:
        node = item.node.model_copy(deep=True)
        node.set_content(mark_text(item.node.get_content()))
        marked.append(NodeWithScore(node=node, score=item.score))
    return marked


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
