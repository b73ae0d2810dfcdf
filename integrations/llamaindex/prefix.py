"""The prompt a LlamaIndex query engine or chat engine sends ``KVBoostLLM`` up to its first
passage: what ``warm_corpus(llm, nodes, prefix=query_engine)`` warms for."""

from __future__ import annotations

from typing import Any

from llama_index.core.prompts import BasePromptTemplate

from kvboost_rag.documents import PASSAGE_SLOT
from kvboost_rag.integrations.llamaindex.llm import KVBoostLLM, engine_messages

# The synthesizers' first-call templates: text_qa_template (compact, refine,
# simple_summarize, accumulate) or summary_template (tree_summarize).
QA_TEMPLATES = ("text_qa_template", "summary_template")


def query_engine_prefix(source: Any, llm: Any) -> str | list[dict[str, str]]:
    """``template_prefix`` of ``source`` (a prompt template, or a query engine, synthesizer
    or context chat engine whose QA template is taken) as sent to ``llm``, the engine's
    ``KVBoostLLM``. A chat engine's is its first turn's: the system message that holds the
    retrieved context comes before the history, so every later turn has the same prefix."""
    if not isinstance(llm, KVBoostLLM):
        raise TypeError(
            "a LlamaIndex prompt's prefix depends on the LLM it is sent to: pass the query "
            f"engine's KVBoostLLM as warm_corpus's target, not a {type(llm).__name__}"
        )
    if isinstance(source, BasePromptTemplate):
        return template_prefix(source, llm)
    # ContextChatEngine and CondensePlusContextChatEngine build each turn's synthesizer
    # (its QA template: the context's system message, the history, the question) here.
    if callable(getattr(source, "_get_response_synthesizer", None)):
        return template_prefix(qa_template(source._get_response_synthesizer([])), llm)
    if callable(getattr(source, "get_prompts", None)):
        return template_prefix(qa_template(source), llm)
    raise TypeError(
        f"prefix is a LlamaIndex {type(source).__name__}: pass a query engine, a context "
        "chat engine, a response synthesizer or a prompt template"
    )


def qa_template(query_engine: Any) -> BasePromptTemplate:
    """The template of a query engine's (or synthesizer's) first LLM call."""
    prompts = query_engine.get_prompts()
    for name in QA_TEMPLATES:
        for key, template in prompts.items():
            if key.rsplit(":", 1)[-1] == name:
                return template  # type: ignore[no-any-return]
    raise TypeError(
        f"{type(query_engine).__name__} has none of the prompts {QA_TEMPLATES} "
        f"(it has {sorted(prompts)}); pass the prompt template its LLM calls use"
    )


def template_prefix(template: BasePromptTemplate, llm: KVBoostLLM) -> str | list[dict[str, str]]:
    """What ``llm.predict(template, ...)`` sends the engine, every variable holding a marked
    passage: the prefix ends at the first variable, ``context_str`` or a ``query_str``
    before it (then the template's fixed head is warmed, and prompts reuse it through
    ``prefix_fallback="nearest"``). A node's metadata header, when nodes have one, sits in
    front of its passage: then prompts also reach the head through the fallback."""
    values = {name: PASSAGE_SLOT for name in template.template_vars if name not in template.kwargs}
    # LLM.predict and LLM.stream format through these two, then call chat() or complete().
    if llm.metadata.is_chat_model:
        return engine_messages(llm._get_messages(template, **values))
    return llm._get_prompt(template, **values)
