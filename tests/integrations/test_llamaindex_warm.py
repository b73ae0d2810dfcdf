"""warm_corpus(llm, nodes, prefix=query_engine): the query engine's LLM calls reuse the
warmed passages under their exact prefix, through complete() and through chat()."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("llama_index.core")

from conftest import make_model  # noqa: E402
from llama_index.core import VectorStoreIndex  # noqa: E402
from llama_index.core.embeddings import MockEmbedding  # noqa: E402
from llama_index.core.instrumentation import get_dispatcher  # noqa: E402
from llama_index.core.instrumentation.event_handlers import BaseEventHandler  # noqa: E402
from llama_index.core.instrumentation.events.llm import (  # noqa: E402
    LLMChatEndEvent,
    LLMChatStartEvent,
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.prompts import PromptTemplate  # noqa: E402
from llama_index.core.schema import TextNode  # noqa: E402

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus  # noqa: E402
from kvboost_rag.core.prompt.chunker import parse_segments  # noqa: E402
from kvboost_rag.integrations.llamaindex import (  # noqa: E402
    KVBoostLLM,
    passage_query_engine,
    query_engine_prefix,
)
from kvboost_rag.integrations.llamaindex.llm import engine_messages  # noqa: E402

TEXTS = [f"Note {i}: item {i} costs {i * 3} dollars." for i in range(3)]


class Sent(BaseEventHandler):
    """What each LLM call sent (a completion prompt or chat messages) and its statistics."""

    prompts: list[Any] = []
    stats: list[dict[str, Any]] = []

    def handle(self, event: object, **kwargs: object) -> None:
        if isinstance(event, LLMChatStartEvent):
            self.prompts.append(engine_messages(event.messages))
        elif isinstance(event, LLMCompletionStartEvent):
            self.prompts.append(event.prompt)
        elif isinstance(event, (LLMChatEndEvent, LLMCompletionEndEvent)) and event.response:
            self.stats.append(event.response.additional_kwargs)


@pytest.fixture
def sent() -> Iterator[Sent]:
    handler = Sent(prompts=[], stats=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    yield handler
    dispatcher.event_handlers.remove(handler)


@pytest.fixture
def tiny_llm(tokenizer) -> KVBoostLLM:  # type: ignore[no-untyped-def]
    engine = KVBoost(make_model("llama"), tokenizer, KVBoostConfig(fidelity="fast"))
    return KVBoostLLM(engine=engine, max_tokens=2, is_chat_model=False)


def query_engine(llm: KVBoostLLM, mode: str = "compact", **kwargs: Any) -> Any:
    nodes = [TextNode(text=t) for t in TEXTS]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    return passage_query_engine(index, llm, response_mode=mode, similarity_top_k=3, **kwargs)


def check_exact_reuse(llm: KVBoostLLM, source: Any, sent: Sent) -> None:
    """The query's first LLM call reused each of its passages under its own prefix, and that
    prefix is what ``prefix=source`` warmed: the tokens before the call's first passage.
    (Refine calls, the query before their passages, reach the warmed head as foreign.)"""
    prompt, stats = sent.prompts[0], sent.stats[0]
    text = prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
    passages = [s.text for s in parse_segments(text) if s.kind == "passage"]
    assert passages and stats["passages_hit"] == len(passages)
    assert (stats["passages_foreign"], stats["passages_missed"]) == (0, 0)
    engine = llm.engine
    tokens = engine.tokenize(prompt) if isinstance(prompt, str) else engine.tokenize_chat(prompt)
    prefix = engine.passage_prefix(query_engine_prefix(source, llm))
    first = engine.tokenizer(passages[0], add_special_tokens=False)["input_ids"]
    assert tokens[: len(prefix) + len(first)] == prefix + first


@pytest.mark.parametrize("mode", ["compact", "tree_summarize", "simple_summarize"])
def test_completion_calls_reuse_passages_warmed_for_the_query_engine(
    tiny_llm: KVBoostLLM, sent: Sent, mode: str
) -> None:
    engine = query_engine(tiny_llm, mode)
    warm_corpus(tiny_llm, TEXTS, prefix=engine, progress=False)
    engine.query("Which costs 6?")
    check_exact_reuse(tiny_llm, engine, sent)


def test_a_prompt_template_is_a_prefix_too(tiny_llm: KVBoostLLM, sent: Sent) -> None:
    template = PromptTemplate("Notes:\n{context_str}\nQ: {query_str}\nA:")
    engine = query_engine(tiny_llm, text_qa_template=template)
    warm_corpus(tiny_llm, TEXTS, prefix=template, progress=False)
    engine.query("Which costs 6?")
    check_exact_reuse(tiny_llm, template, sent)


def test_bad_llamaindex_prefixes_get_specific_errors(tiny_llm: KVBoostLLM) -> None:
    engine = query_engine(tiny_llm)
    with pytest.raises(TypeError, match="pass the query engine's KVBoostLLM"):
        warm_corpus(tiny_llm.engine, TEXTS, prefix=engine)
    retriever = engine.retriever
    with pytest.raises(TypeError, match="has none of the prompts"):
        warm_corpus(tiny_llm, TEXTS, prefix=retriever)


@pytest.mark.embedded
def test_chat_calls_reuse_passages_warmed_for_the_query_engine(
    embedded: KVBoost, sent: Sent
) -> None:
    engine = KVBoost(embedded.model, embedded.tokenizer, KVBoostConfig(fidelity="fast"))
    llm = KVBoostLLM(engine=engine, max_tokens=2)
    assert llm.metadata.is_chat_model  # the query engine calls chat(), through the template
    query = query_engine(llm)
    warm_corpus(llm, TEXTS, prefix=query, progress=False)
    query.query("Which costs 6?")
    check_exact_reuse(llm, query, sent)
