"""Passage boundaries for LangChain: documents in, marked passages out, and a splitter whose
chunks are the engine's KV units."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.prompts import BasePromptTemplate, MessagesPlaceholder, PromptTemplate
from langchain_text_splitters import TextSplitter

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.prompt.chunker import CLOSE, OPEN, PASSAGE_SEPARATOR
from kvboost_rag.documents import PASSAGE_SLOT
from kvboost_rag.integrations._common import documents_as_passages, split_into_units
from kvboost_rag.integrations.langchain.chat import ChatKVBoost
from kvboost_rag.integrations.langchain.llm import KVBoostPipeline
from kvboost_rag.integrations.langchain.messages import engine_messages

# ``create_stuff_documents_chain`` joins formatted documents with this: the blank line
# ``format_passages`` puts between passages (any other separator finds the same passages).
PASSAGE_DOCUMENT_SEPARATOR = PASSAGE_SEPARATOR


def format_passages(documents: Sequence[Document | str]) -> str:
    """Documents as marked passages, for plain LCEL (``{"context": retriever |
    format_passages, ...}``): each one marked, followed by a blank line."""
    return documents_as_passages(documents)


def passage_document_prompt() -> PromptTemplate:
    """The ``document_prompt`` for ``create_stuff_documents_chain``: each document becomes
    a marked passage. Pass ``document_separator=PASSAGE_DOCUMENT_SEPARATOR`` with it."""
    return PromptTemplate.from_template(f"{OPEN}{{page_content}}{CLOSE}")


def stuff_documents_kwargs() -> dict[str, Any]:
    """``create_stuff_documents_chain(llm, prompt, **stuff_documents_kwargs())``."""
    return {
        "document_prompt": passage_document_prompt(),
        "document_separator": PASSAGE_DOCUMENT_SEPARATOR,
    }


def prompt_prefix(
    template: BasePromptTemplate, llm: Any, document_variable: str = "context"
) -> str | list[dict[str, str]]:
    """The prompt ``llm`` gets from a chain over ``template``, with one marked document in
    ``document_variable``: what ``warm_corpus(llm, docs, prefix=template)`` warms for.

    ``create_stuff_documents_chain(llm, template, **stuff_documents_kwargs())`` puts the
    documents in ``{context}``; the engine's prefix ends at the first one. Every other
    variable holds a passage marker too, so a variable before the documents (a question)
    ends the prefix there: the template's fixed head is warmed, and prompts, whose prefix
    starts with it, reuse it through ``prefix_fallback="nearest"``. ``ChatKVBoost`` gets
    the messages (its chat template applies), ``KVBoostPipeline`` the text, as LangChain
    converts the prompt for each.
    """
    if document_variable not in template.input_variables:
        raise ValueError(
            f"the prompt has no {{{document_variable}}} variable for the documents (it has "
            f"{template.input_variables}); pass document_variable= the one it uses"
        )
    placeholders = {
        m.variable_name
        for m in getattr(template, "messages", [])
        if isinstance(m, MessagesPlaceholder)
    }
    values = {
        name: [("human", PASSAGE_SLOT)] if name in placeholders else PASSAGE_SLOT
        for name in template.input_variables
    }
    prompt = template.format_prompt(**values)
    if isinstance(llm, ChatKVBoost):
        return engine_messages(prompt.to_messages(), [])
    if isinstance(llm, KVBoostPipeline):
        return prompt.to_string()
    raise TypeError(
        f"a LangChain prompt's prefix depends on the model it is sent to: pass the chain's "
        f"ChatKVBoost or KVBoostPipeline as warm_corpus's target, not a {type(llm).__name__}"
    )


class KVBoostTextSplitter(TextSplitter):
    """Splits text at sentence boundaries into chunks the engine caches whole, so what a
    retriever returns is exactly one KV unit each.

    ``engine`` is a ``KVBoost`` engine or an object holding one as ``.engine``
    (``ChatKVBoost``, ``KVBoostPipeline``); its tokenizer counts tokens and its
    ``max_passage_tokens`` is the default (and largest) ``chunk_size``. Chunks do not
    overlap: an overlap would store the shared sentences twice.
    """

    def __init__(self, engine: Any, chunk_size: int | None = None, **kwargs: Any) -> None:
        kv = KVBoost.of(engine)
        limit = kv.config.max_passage_tokens
        size = limit if chunk_size is None else chunk_size
        if not 1 <= size <= limit:
            raise ValueError(
                f"chunk_size must be in [1, {limit}] tokens (the engine's max_passage_tokens; "
                f"longer chunks would be split again), got {size}"
            )
        if kwargs.get("chunk_overlap", 0):
            raise ValueError("chunk_overlap must be 0: overlapping chunks cache text twice")
        if "length_function" in kwargs:
            raise ValueError("length_function is fixed: chunks are measured in model tokens")
        super().__init__(chunk_size=size, chunk_overlap=0, **kwargs)
        self._tokenizer = kv.tokenizer

    def split_text(self, text: str) -> list[str]:
        pieces = split_into_units(text, self._tokenizer, self._chunk_size)
        return [p.strip() for p in pieces] if self._strip_whitespace else pieces
