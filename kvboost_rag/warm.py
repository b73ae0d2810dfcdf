"""``warm_corpus()``: preload a whole document collection's passage KV."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvboost_rag.core.engine import KVBoost
from kvboost_rag.core.generation.result import WarmResult
from kvboost_rag.core.prompt.chunker import MarkerError, passage

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

    With ``cache_dir`` set the KV is written through to disk. A document given twice is
    encoded and counted once. Raises ``TypeError`` for an unknown target, one string
    instead of a list, an unknown document or prefix, ``ValueError`` for a document that
    cannot be a passage (empty, only whitespace, not valid Unicode, holding a passage
    marker) and ``ContextWindowError`` for one too long to encode after the prefix: each
    names the document (index, id, source, start of its text) and the fix.
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


def document_list(documents: Iterable[Any]) -> list[Any]:
    """``documents`` as a list; one string (or one document) is refused, not read as a
    document per character."""
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Iterable):
        kind = type(documents).__name__
        raise TypeError(
            f"documents is a {kind}, not a collection of documents: pass a list of them "
            "(for one document, [document])"
        )
    return list(documents)


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
    """The text of one document: a str, a LangChain Document or a LlamaIndex node.

    Raises ``TypeError`` or ``ValueError`` naming the document (``document_label``), why it
    cannot be a passage and what to pass instead."""
    if isinstance(doc, str):
        text = doc
    elif isinstance(getattr(doc, "page_content", None), str):
        text = doc.page_content
    elif callable(getattr(doc, "get_content", None)):
        text = doc.get_content()
    else:
        fix = "decode it to a str first" if isinstance(doc, (bytes, bytearray)) else _FIX_TYPE
        raise TypeError(f"{document_label(doc, index)} is a {type(doc).__name__}: {fix}")
    if not isinstance(text, str):
        raise TypeError(
            f"{document_label(doc, index)}: its content is a {type(text).__name__}, "
            "not text: pass documents whose content is a str"
        )
    problem = _text_problem(text)
    if problem is not None:
        error, why = problem
        raise error(f"{document_label(doc, index, text)} {why}")
    return text


_FIX_TYPE = "pass strings, LangChain Documents or LlamaIndex nodes"
_PREVIEW_CHARS = 40


def document_label(doc: Any, index: int, text: str | None = None) -> str:
    """How an error names a document: ``documents[i]``, then its id and source (LangChain
    ``id`` / ``metadata["source"]``, LlamaIndex ``id_`` / ``metadata["file_path"]`` or
    ``["file_name"]``) when it has them, then the start of its text (or of its repr)."""
    parts = [f"id {ident!r}" for ident in [_identity(doc)] if ident]
    metadata = getattr(doc, "metadata", None)
    if isinstance(metadata, dict):
        key = next((k for k in ("source", "file_path", "file_name") if metadata.get(k)), None)
        parts += [f"{key} {metadata[key]!r}"] if key else []
    shown = text if text is not None else doc if isinstance(doc, str) else None
    if shown is None:  # not text: the start of its repr
        parts.append(_cut(repr(doc)))
    elif shown.strip():
        parts.append(repr(_cut(shown)))
    return f"documents[{index}]" + (f" ({', '.join(parts)})" if parts else "")


def _cut(text: str) -> str:
    return text[:_PREVIEW_CHARS] + ("..." if len(text) > _PREVIEW_CHARS else "")


def _identity(doc: Any) -> str | None:
    ident = getattr(doc, "id", None) or getattr(doc, "id_", None)
    return ident if isinstance(ident, str) else None


def _text_problem(text: str) -> tuple[type[ValueError], str] | None:
    """Why ``text`` cannot be a passage, with the fix, and the error to raise; None when it
    can."""
    if not text.strip():
        what = "empty" if not text else "only whitespace"
        return ValueError, f"is {what}: leave it out"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return ValueError, (
            f"is not valid Unicode: character {error.start} is a lone surrogate "
            f"{text[error.start]!r} (bytes that were not UTF-8, decoded with "
            "surrogateescape); read the file with its real encoding or errors='replace'"
        )
    try:
        passage(text)
    except MarkerError as error:
        return MarkerError, f"cannot be a passage: {error}"
    return None


__all__: Sequence[str] = [
    "chat_prefix",
    "document_text",
    "resolve_prefix",
    "warm_corpus",
]
