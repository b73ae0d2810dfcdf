"""``warm_corpus()``: preload a whole document collection's passage KV."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.results import WarmResult
from kvboost_rag.documents import PASSAGE_SLOT, document_label, document_list, document_text

# What ``engine.warm_passages(prefix=...)`` takes: None, a completion prompt, or messages.
EnginePrefix = str | list[dict[str, str]] | None


def warm_corpus(
    target: Any,
    documents: Iterable[Any],
    *,
    prefix: Any = None,
    batch_size: int | None = None,
    progress: bool = True,
) -> WarmResult:
    """Encode every document's passage KV once, so prompts that retrieve them reuse it.

    ``target`` is a ``KVBoost`` engine or an object holding one as ``.engine`` (the
    package's LangChain / LlamaIndex classes). ``documents`` are strings, LangChain
    ``Document``s (``page_content``) or LlamaIndex nodes / documents (``get_content()``).
    Each document is one passage (long ones split at sentences, as in prompts).

    Passage KV is encoded after the prompt's prefix (everything before its first passage)
    and cached for that prefix. ``prefix`` is what later prompts will look like:

    - ``None``: a generic variant after BOS, which any prompt reuses at lower quality;
    - a ``str``: a completion prompt as ``engine.generate`` sees it, passages marked with
      ``passage()`` (the prefix is the text before the first), or the prefix text itself;
    - chat messages (``[{"role", "content"}]``) with a ``passage()`` marker where the
      passages go, as ``engine.chat`` sees them;
    - a LangChain ``PromptTemplate`` / ``ChatPromptTemplate`` (the chain's; ``target`` is
      its ``ChatKVBoost`` or ``KVBoostPipeline``), or a LlamaIndex query engine, context chat
      engine or prompt template (``target`` its ``KVBoostLLM``): the prefix their requests
      will have. A template variable before the documents (a question) ends it: the
      fixed head is warmed, and prompts starting with it reuse it through
      ``prefix_fallback="nearest"``.

    With ``cache_dir`` set the KV is written through to disk. A document given twice is
    encoded and counted once; one that is empty or only whitespace is skipped with a
    warning naming it (``WarmResult.skipped``). The result is checked against the tiers'
    own stats: ``bytes`` they hold, ``dropped`` units they could not (warned), ``failed``
    tiers. Raises ``TypeError`` for an unknown target, one string instead of a list, an
    unknown document or prefix, ``ValueError`` for a document that cannot be a passage (not
    valid Unicode, holding a passage marker) and ``ContextWindowError`` for one too long to
    encode after the prefix: each names the document (index, id, source, start of its text)
    and the fix.
    """
    engine = KVBoost.of(target)
    documents = document_list(documents)
    texts = [document_text(doc, i) for i, doc in enumerate(documents)]
    names = [document_label(doc, i, text) for i, (doc, text) in enumerate(zip(documents, texts))]
    engine_prefix = resolve_prefix(prefix, target)
    # One call over the whole corpus, so encoding batches group similar lengths globally.
    if not progress:  # no bar at all: even a disabled tqdm starts its monitor thread
        return engine.warm_passages(texts, prefix=engine_prefix, batch_size=batch_size, names=names)
    # tqdm writes the unit right after the count ("0passage"): the space is the unit's.
    with tqdm(unit=" passages", desc="encoding") as bar:
        return engine.warm_passages(
            texts, prefix=engine_prefix, batch_size=batch_size, progress=bar.update, names=names
        )


def chat_prefix(system: str) -> list[dict[str, str]]:
    """The prefix of chats with a ``system`` message and a user message that starts with the
    passages: how ``ChatKVBoost``'s ``documents=`` and ``format_passages(docs) + question``
    lay them out."""
    return [{"role": "system", "content": system}, {"role": "user", "content": PASSAGE_SLOT}]


def resolve_prefix(prefix: Any, target: Any) -> EnginePrefix:
    """``prefix`` in the form ``engine.warm_passages`` takes. Framework objects are rendered
    by their integration, imported only when one is given."""
    if prefix is None or isinstance(prefix, str):
        return prefix
    if _is_messages(prefix):
        return [dict(m) for m in prefix]
    framework = _framework(prefix)
    if framework == "langchain":
        from kvboost_rag.integrations.langchain.documents import prompt_prefix

        return prompt_prefix(prefix, target)
    if framework == "llama_index":
        from kvboost_rag.integrations.llamaindex.prefix import query_engine_prefix

        return query_engine_prefix(prefix, target)
    raise TypeError(
        f"prefix is a {type(prefix).__name__}: pass None, a prompt string, chat messages "
        "([{'role': ..., 'content': ...}]), a LangChain prompt template, or a LlamaIndex "
        "query engine, context chat engine or prompt template"
    )


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) for m in value)
    )


def _framework(value: Any) -> str | None:
    """The framework whose class ``value`` is (or derives from): by module name, so neither
    framework is imported to ask."""
    for cls in type(value).__mro__:
        root = cls.__module__.split(".")[0]
        if root.startswith("langchain"):
            return "langchain"
        if root == "llama_index":
            return "llama_index"
    return None


__all__: Sequence[str] = [
    "chat_prefix",
    "document_text",
    "resolve_prefix",
    "warm_corpus",
]
