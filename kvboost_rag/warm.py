"""``warm_corpus()``: preload a whole document collection's passage KV."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvboost_rag.core.chunker import passage
from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.result import WarmResult

# What ``engine.warm_passages(prefix=...)`` takes: None, a completion prompt, or messages.
EnginePrefix = str | list[dict[str, str]] | None
# Where passages go in a prefix given as a template or a layout: one marked passage, as the
# adapters mark a document. Filled into every template variable, so the prefix ends at the
# first one (the documents, or a question placed before them).
PASSAGE_SLOT = passage("passage")


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
      its ``ChatKVBoost`` or ``KVBoostLLM``), or a LlamaIndex query engine or prompt
      template (``target`` its ``KVBoostLLM``): the prefix their requests will have. A
      template variable before the documents (a question) ends it: the fixed head is
      warmed, and prompts starting with it reuse it through ``prefix_fallback="nearest"``.

    With ``cache_dir`` set the KV is written through to disk. Raises ``TypeError`` for an
    unknown target, document or prefix.
    """
    engine = KVBoost.of(target)
    texts = [document_text(doc, i) for i, doc in enumerate(documents)]
    engine_prefix = resolve_prefix(prefix, target)
    # One call over the whole corpus, so encoding batches group similar lengths globally.
    with tqdm(unit="passage", disable=not progress, desc="encoding") as bar:
        return engine.warm_passages(
            texts, prefix=engine_prefix, batch_size=batch_size, progress=bar.update
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
        "query engine or prompt template"
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


def document_text(doc: Any, index: int) -> str:
    """The text of one document: a str, a LangChain Document or a LlamaIndex node."""
    if isinstance(doc, str):
        text = doc
    elif isinstance(getattr(doc, "page_content", None), str):
        text = doc.page_content
    elif callable(getattr(doc, "get_content", None)):
        text = doc.get_content()
    else:
        raise TypeError(
            f"documents[{index}] is a {type(doc).__name__}: pass strings, LangChain "
            "Documents or LlamaIndex nodes"
        )
    if not text:
        raise ValueError(f"documents[{index}] is empty")
    return text


__all__: Sequence[str] = ["chat_prefix", "document_text", "resolve_prefix", "warm_corpus"]
