"""What a document is to the package: a str, a LangChain ``Document`` or a LlamaIndex node,
its text as a passage, and the name errors call it by. Shared by ``warm_corpus`` and the
framework adapters (a layer below both, so neither imports the other for it)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvboost_rag.core.caller_warnings import warn
from kvboost_rag.core.prompt.chunker import MarkerError, passage

# Where passages go in a prefix given as a template or a layout: one marked passage, as the
# adapters mark a document. Filled into every template variable, so the prefix ends at the
# first one (the documents, or a question placed before them).
PASSAGE_SLOT = passage("passage")


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


def document_texts(documents: Sequence[Any]) -> list[str]:
    """The texts of ``documents`` that hold a passage (``document_text``): one that is
    empty or only whitespace is skipped with a warning naming it, as ``warm_corpus`` and
    the CLI's ``warm`` skip it."""
    texts = []
    for i, doc in enumerate(documents):
        text = document_text(doc, i)
        if text.strip():
            texts.append(text)
            continue
        what = "empty" if not text else "only whitespace"
        warn(f"kvboost-rag: skipping {document_label(doc, i, text)}: it is {what}")
    return texts


def document_text(doc: Any, index: int) -> str:
    """The text of one document: a str, a LangChain Document or a LlamaIndex node (a blank
    one too: callers skip it with a warning, ``document_texts``).

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
