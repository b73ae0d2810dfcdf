"""warm_corpus(llm, docs, prefix=prompt): a stuff-documents chain's requests reuse the
warmed passages under their exact prefix, for the chat model and for the LLM."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import make_model
from langchain_classic.chains.combine_documents import create_stuff_documents_chain
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document
from langchain_core.prompts import ChatPromptTemplate, PromptTemplate

from kvboost_rag import KVBoost, KVBoostConfig, warm_corpus
from kvboost_rag.integrations.langchain import (
    ChatKVBoost,
    KVBoostPipeline,
    prompt_prefix,
    stuff_documents_kwargs,
)
from kvboost_rag.integrations.langchain.chat import engine_messages

DOCS = [Document(page_content=f"Note {i}: item {i} costs {i * 3} dollars.") for i in range(3)]
TEMPLATES = {
    "chat template": ChatPromptTemplate.from_messages(
        [("system", "Answer from these notes.\n\n{context}"), ("human", "{input}")]
    ),
    "text template": PromptTemplate.from_template("Notes:\n{context}\nQuestion: {input}\nAnswer:"),
}


class Sent(BaseCallbackHandler):
    """The engine's tokens for each prompt LangChain sent, and each answer's statistics."""

    def __init__(self, engine: KVBoost) -> None:
        self.engine = engine
        self.tokens: list[list[int]] = []
        self.stats: list[dict[str, Any]] = []

    def on_chat_model_start(self, serialized: Any, messages: Any, **kwargs: Any) -> None:
        self.tokens.append(self.engine.tokenize_chat(engine_messages(messages[0], [])))

    def on_llm_start(self, serialized: Any, prompts: list[str], **kwargs: Any) -> None:
        self.tokens.append(self.engine.tokenize(prompts[0]))

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        generation = response.generations[0][0]
        message = getattr(generation, "message", None)
        self.stats.append(message.response_metadata if message else generation.generation_info)


@pytest.fixture
def engine(tokenizer) -> KVBoost:  # type: ignore[no-untyped-def]
    return KVBoost(make_model("llama"), tokenizer, KVBoostConfig(block_tokens=8, fidelity="fast"))


def ask(llm: Any, template: Any, docs: list[Document], sent: Sent) -> dict[str, Any]:
    chain = create_stuff_documents_chain(llm, template, **stuff_documents_kwargs())
    chain.invoke({"context": docs, "input": "Which costs 6?"}, config={"callbacks": [sent]})
    return sent.stats[-1]


@pytest.mark.parametrize("kind", ["chat", "llm"])
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chains_reuse_passages_warmed_for_their_prompt(
    engine: KVBoost, kind: str, name: str
) -> None:
    llm = (
        ChatKVBoost(engine=engine, max_tokens=2)
        if kind == "chat"
        else KVBoostPipeline(engine=engine, max_tokens=2)
    )
    template = TEMPLATES[name]
    warm_corpus(llm, DOCS, prefix=template, progress=False)
    sent = Sent(engine)
    stats = ask(llm, template, DOCS[::-1], sent)
    assert (stats["passages_hit"], stats["passages_foreign"], stats["passages_missed"]) == (3, 0, 0)
    # The warmed prefix is exactly what the sent prompt has before its first passage.
    prefix = engine.passage_prefix(prompt_prefix(template, llm))
    first = engine.tokenizer(DOCS[-1].page_content, add_special_tokens=False)["input_ids"]
    assert sent.tokens[0][: len(prefix) + len(first)] == prefix + first


def test_the_model_kind_changes_the_prefix(engine: KVBoost) -> None:
    template = TEMPLATES["chat template"]
    chat, llm = (
        ChatKVBoost(engine=engine, max_tokens=2),
        KVBoostPipeline(engine=engine, max_tokens=2),
    )
    warm_corpus(chat, DOCS, prefix=template, progress=False)
    stats = ask(llm, template, DOCS, Sent(engine))  # "System: ..." text, not the chat template
    assert (stats["passages_foreign"], stats["passages_missed"]) == (3, 0)


def test_a_question_before_the_documents_ends_the_warmed_prefix(engine: KVBoost) -> None:
    template = PromptTemplate.from_template("Question: {input}\nNotes:\n{context}\nAnswer:")
    llm = KVBoostPipeline(engine=engine, max_tokens=2)
    assert prompt_prefix(template, llm).startswith("Question: \u27e6")
    warm_corpus(llm, DOCS, prefix=template, progress=False)
    sent = Sent(engine)
    stats = ask(llm, template, DOCS, sent)
    # The fixed head is warmed; the prompt's prefix (with its question) reaches it through
    # the nearest-prefix fallback.
    assert (stats["passages_foreign"], stats["passages_missed"]) == (3, 0)
    head = engine.passage_prefix(prompt_prefix(template, llm))
    assert sent.tokens[0][: len(head)] == head


def test_bad_prompt_prefixes_get_specific_errors(engine: KVBoost) -> None:
    chat = ChatKVBoost(engine=engine, max_tokens=2)
    with pytest.raises(TypeError, match="pass the chain's ChatKVBoost or KVBoostPipeline"):
        warm_corpus(engine, DOCS, prefix=TEMPLATES["chat template"])
    with pytest.raises(ValueError, match=r"no \{context\} variable"):
        warm_corpus(chat, DOCS, prefix=PromptTemplate.from_template("Docs: {docs}"))
    custom = PromptTemplate.from_template("Docs: {docs}")
    assert prompt_prefix(custom, chat, document_variable="docs")[0]["content"].startswith("Docs: ")
