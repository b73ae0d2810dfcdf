"""Reuse with no change to the prompt: the frameworks' default chains and query engines,
with no markers and no extra arguments, hit every warmed passage their prompts hold."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import make_model
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.integrations.langchain import ChatKVBoost, KVBoostPipeline

CITIES = ["Lyon", "Osaka", "Quito", "Perth"]
TEXTS = [
    f"Note {i}: item {i} is a widget assembled in {city}; it costs {i * 3} dollars, weighs "
    f"{i + 2} kilograms and ships within {i + 4} days from the northern warehouse."
    for i, city in enumerate(CITIES)
]


@pytest.fixture
def engine(tokenizer) -> KVBoost:  # type: ignore[no-untyped-def]
    model = make_model("llama")
    model.config.max_position_embeddings = 2048  # room for LlamaIndex's 500-token padding
    return KVBoost(model, tokenizer, KVBoostConfig(fidelity="balanced"))


class Stats(BaseCallbackHandler):
    """Each LangChain answer's statistics."""

    def __init__(self) -> None:
        self.stats: list[dict[str, Any]] = []

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        generation = response.generations[0][0]
        message = getattr(generation, "message", None)
        self.stats.append(message.response_metadata if message else generation.generation_info)


TEMPLATES = {
    "chat": ChatPromptTemplate.from_messages(
        [("system", "Answer from these notes.\n\n{context}"), ("human", "{input}")]
    ),
    "text": PromptTemplate.from_template("Notes:\n{context}\nQuestion: {input}\nAnswer:"),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_default_stuff_documents_chain_hits_every_warmed_passage(
    engine: KVBoost, name: str
) -> None:
    llm = (
        ChatKVBoost(engine=engine, max_tokens=2)
        if name == "chat"
        else KVBoostPipeline(engine=engine, max_tokens=2)
    )
    warm_corpus(engine, TEXTS, progress=False)
    chain = create_stuff_documents_chain(llm, TEMPLATES[name])  # no markers, no kwargs
    stats = Stats()
    docs = [Document(page_content=t) for t in TEXTS[::-1][:3]]
    chain.invoke({"context": docs, "input": "Which costs 6?"}, config={"callbacks": [stats]})
    (answer,) = stats.stats
    # found (used, or recomputed whole by the repair on this random model)
    assert (answer["passages_hit"] + answer["passages_unused"], answer["passages_missed"]) == (3, 0)


def test_an_f_string_prompt_hits_passages_at_any_offset(engine: KVBoost) -> None:
    warm_corpus(engine, TEXTS, progress=False)
    for picked in (TEXTS[:2], [TEXTS[3], TEXTS[1], TEXTS[0]]):
        context = "\n".join(f"- {t}" for t in picked)
        result = engine.generate(f"Facts:\n{context}\nWhich costs 3?\n", max_new_tokens=2)
        assert (result.passages_hit + result.passages_unused, result.passages_missed) == (
            len(picked),
            0,
        )


def test_a_passage_seen_marked_is_found_unmarked_next_time(engine: KVBoost) -> None:
    engine.generate("Q?", passages=TEXTS[:2], max_new_tokens=1)
    result = engine.generate(f"Read: {TEXTS[1]} And: {TEXTS[0]} Q?", max_new_tokens=1)
    assert (result.passages_hit + result.passages_unused, result.passages_missed) == (2, 0)


# -- LlamaIndex ----------------------------------------------------------------------


class Sent:
    """Each LlamaIndex LLM call's statistics."""

    def __init__(self) -> None:
        from llama_index.core.instrumentation.event_handlers import BaseEventHandler
        from llama_index.core.instrumentation.events.llm import (
            LLMChatEndEvent,
            LLMCompletionEndEvent,
        )

        stats: list[dict[str, Any]] = []

        class Handler(BaseEventHandler):
            def handle(self, event: object, **kwargs: object) -> None:
                ends = (LLMChatEndEvent, LLMCompletionEndEvent)
                if isinstance(event, ends) and event.response:  # type: ignore[attr-defined]
                    stats.append(event.response.additional_kwargs)  # type: ignore[attr-defined]

        self.stats = stats
        self.handler = Handler()


@pytest.fixture
def sent() -> Iterator[Sent]:
    pytest.importorskip("llama_index.core")
    from llama_index.core.instrumentation import get_dispatcher

    watcher = Sent()
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(watcher.handler)
    yield watcher
    dispatcher.event_handlers.remove(watcher.handler)


@pytest.mark.parametrize("mode", ["compact", "refine", "tree_summarize"])
@pytest.mark.parametrize("chat", [False, True], ids=["complete", "chat"])
def test_a_default_query_engine_hits_every_warmed_passage(
    engine: KVBoost, sent: Sent, mode: str, chat: bool
) -> None:
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.schema import TextNode

    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_tokens=2, is_chat_model=chat)
    nodes = [TextNode(text=t) for t in TEXTS]
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    warm_corpus(engine, TEXTS, progress=False)
    index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=3).query("Which costs 6?")
    assert sent.stats
    # compact and tree_summarize read all three in one call; refine one call per node
    assert sum(s["passages_hit"] + s["passages_unused"] for s in sent.stats) >= 3
    assert all(s["passages_missed"] == 0 for s in sent.stats)


def test_paragraphs_seen_in_one_unmarked_prompt_are_found_in_the_next(engine: KVBoost) -> None:
    """A prompt that marks nothing and holds no known passage: its long paragraphs are
    encoded after the answer, and a later prompt holding them in another order hits."""
    long = [f"{t} {t}" for t in TEXTS]  # past the 64 tokens a paragraph needs
    first = engine.generate("\n\n".join(long[:3]) + "\n\nWhich costs 3?", max_new_tokens=1)
    assert first.passages_hit == 0
    engine.flush()
    later = "Docs:\n\n" + "\n\n".join([long[2], long[0]]) + "\n\nWhich costs 6?"
    result = engine.generate(later, max_new_tokens=1)
    assert (result.passages_hit + result.passages_unused, result.passages_missed) == (2, 0)


def test_passages_warmed_to_disk_are_found_unmarked_by_a_later_engine(tokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """What ``kvboost-rag warm`` leaves on disk serves later processes' unmarked prompts:
    a new engine over the same folder reads the disk tier's passage catalogue."""
    model = make_model("llama")
    config = KVBoostConfig(fidelity="balanced", cache_dir=str(tmp_path))
    first = KVBoost(model, tokenizer, config)
    warm_corpus(first, TEXTS, progress=False)
    first.flush()
    later = KVBoost(model, tokenizer, config)
    result = later.generate(f"Facts: {TEXTS[2]}\n{TEXTS[0]}\nWhich costs 6?", max_new_tokens=1)
    assert (result.passages_hit + result.passages_unused, result.passages_missed) == (2, 0)


def keyword_embedding() -> Any:
    """A LlamaIndex embedding that scores a text by the cities it names: two questions
    naming different cities retrieve different notes."""
    from llama_index.core.embeddings import BaseEmbedding

    class Cities(BaseEmbedding):
        def _vector(self, text: str) -> list[float]:
            return [float(city in text) + 0.01 for city in CITIES]

        def _get_text_embedding(self, text: str) -> list[float]:
            return self._vector(text)

        def _get_query_embedding(self, query: str) -> list[float]:
            return self._vector(query)

        async def _aget_query_embedding(self, query: str) -> list[float]:
            return self._vector(query)

    return Cities(model_name="cities")


@pytest.mark.parametrize("mode", ["context", "condense_plus_context"])
def test_a_chat_engine_reuses_its_history_and_its_passages(
    engine: KVBoost, sent: Sent, mode: str
) -> None:
    """LlamaIndex's chat engines put the retrieved context in the system message, unmarked:
    every turn finds the warmed note it retrieved by content (none encoded again), and in
    the context mode a turn that retrieves the same note continues the last turn's KV (its
    history). (condense_plus_context retrieves with the question the model rewrote: on a
    random model, any note.)"""
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode

    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_tokens=2)
    index = VectorStoreIndex([TextNode(text=t) for t in TEXTS], embed_model=keyword_embedding())
    warm_corpus(engine, TEXTS, progress=False)
    chat = index.as_chat_engine(chat_mode=mode, llm=llm, similarity_top_k=1)
    turns = []
    for question in ("What is made in Lyon?", "What is made in Lyon, again?", "And in Perth?"):
        chat.chat(question)
        turns.append(sent.stats[-1])  # the answer's call (condense calls come before it)
    assert all(t["passages_missed"] == 0 for t in turns)  # nothing encoded again
    assert turns[0]["passages_hit"] == 1
    if mode == "context":  # the same note: the second turn continues the first, whose
        # KV holds the note already (the exact prefix, so no passage to find after it);
        # another note is found by content
        assert turns[1]["reused_tokens"] >= turns[0]["prompt_tokens"] - 1
        assert turns[2]["passages_hit"] == 1


def chat_turns(engine: KVBoost, sent: Sent, mode: str, warm: bool) -> list[tuple[str, dict]]:
    from llama_index.core import VectorStoreIndex
    from llama_index.core.schema import TextNode

    from kvboost_rag.integrations.llamaindex import KVBoostLLM

    llm = KVBoostLLM(engine=engine, max_tokens=6)
    index = VectorStoreIndex([TextNode(text=t) for t in TEXTS], embed_model=keyword_embedding())
    chat = index.as_chat_engine(chat_mode=mode, llm=llm, similarity_top_k=1)
    if warm:
        warm_corpus(llm, TEXTS, prefix=chat, progress=False)
    turns = []
    for question in ("What is made in Lyon?", "What is made in Lyon, again?", "And in Perth?"):
        answer = str(chat.chat(question))
        turns.append((answer, sent.stats[-1]))
    return turns


@pytest.mark.parametrize("mode", ["context", "condense_plus_context"])
def test_a_chat_engine_warmed_for_its_own_prefix_answers_as_without(
    engine: KVBoost, sent: Sent, tokenizer: Any, mode: str
) -> None:
    """``warm_corpus(llm, nodes, prefix=chat_engine)`` encodes each note after the system
    message's head the chat engine sends: every turn's note is found in that variant (none
    foreign, none encoded again) and the answers are an unwarmed engine's, token for token.
    (Warmed without the prefix, a Qwen 0.5B chat engine's third turn answered the
    Colosseum's completion with the Eiffel Tower's year from its history.)"""
    warmed = chat_turns(engine, sent, mode, warm=True)
    assert all(s["passages_foreign"] == 0 and s["passages_missed"] == 0 for _, s in warmed)
    assert sum(s["passages_hit"] for _, s in warmed) >= (2 if mode == "context" else 1)
    if mode == "context":  # (condense_plus_context retrieves with the random model's own
        # rewrite of the question, whose near-tied logits the split of a prefill flips)
        plain = KVBoost(engine.model, tokenizer, KVBoostConfig(fidelity="balanced"))
        unwarmed = chat_turns(plain, sent, mode, warm=False)
        assert [answer for answer, _ in warmed] == [answer for answer, _ in unwarmed]
